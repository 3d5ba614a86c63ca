"""``runtime.keep_allocations``: large temporaries come from glibc's heap, not a fresh mmap each.

A decode forward allocates and frees large tensors every call, and some of them (a batch's
gathered keys and values) grow a little with the context at each step. Counted in minor
page faults, in a fresh process each: 40 rounds of a tensor that starts at 4 MiB and grows
by 512 KiB a round fault on every page of every round by default (each new size is over
glibc's dynamic mmap threshold, so it is a fresh ``mmap``), and once
:func:`keep_large_allocations` has run only on about the pages the heap grows by.

(A tensor of one fixed size is no test: glibc's dynamic threshold soon serves it from the
heap by default too, after a number of faulting rounds that varies from run to run.)
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
for nbytes in map(int, sys.argv[2:]):
    t = torch.empty(nbytes // 4)  # float32
    t.fill_(1.0)
    del t
print(faults() - f0)
'''


SIZES = [(4 << 20) + i * (512 << 10) for i in range(40)]  # bytes: 4 MiB, then 512 KiB more a round


def _faults(mode: str) -> int:
    cmd = [sys.executable, "-c", ROUNDS, mode, *map(str, SIZES)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_large_temporaries_stop_faulting_once_kept() -> None:
    default, kept = _faults("default"), _faults("keep")
    every_page = sum(n // 4096 for n in SIZES)
    assert default > 0.9 * every_page  # each round a fresh mmap, faulted page by page
    assert kept < every_page / 5  # the heap's pages reused; only its growth faults
