"""``runtime.keep_allocations``: large temporaries come from glibc's heap, not a fresh mmap each.

A forward allocates and frees the same large tensors every call. Counted in minor page
faults, in a fresh process each: 50 rounds of an 8 MiB tensor fault on nearly every round
by default (the heap top is trimmed after each free), and on about the first only once
:func:`keep_large_allocations` has run.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

ROUNDS = '''
import resource, sys, torch
if sys.argv[1] == "keep":
    from specdec.core.pipeline_model import keep_large_allocations
    assert keep_large_allocations()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(1)
f0 = faults()
for _ in range(50):
    t = torch.empty(2 << 20)  # 8 MiB
    t.fill_(1.0)
    del t
print(faults() - f0)
'''


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_large_temporaries_stop_faulting_once_kept() -> None:
    default, kept = _faults("default"), _faults("keep")
    pages = (8 << 20) // 4096
    assert default > 5 * pages  # re-faulted round after round
    assert kept < 3 * pages  # the first round's pages, then reused
