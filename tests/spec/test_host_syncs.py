"""One device-to-host read per speculative step (issues 58, 59).

Every read of a tensor's values into Python (``tolist``, ``item``, ``int``/``bool``/
``float`` of a tensor, ``numpy``) during steady-state engine steps is counted by patching
those methods; the one the CPU forward makes to decide whether it must rerun with rows
isolated (``backend.forward_checking_rows``: CPU only, never on a GPU) is left out.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig
from specdec.spec.verify import accept_greedy_chain, chain_fault, greedy_chain_readout, verify_greedy

ZOO = Path(__file__).parents[2] / "specdec" / "zoo"
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    for arg in argv:\n        print(arg)\n" * 3
READS = ("tolist", "item", "numpy", "__int__", "__bool__", "__float__", "__index__")
# CPU only, reads of host tensors: the forward's own non-finite check, and a small tree's
# greedy walk, ancestor masks and dynamic-tree selection on host lists (tree.HOST_WALK_NODES,
# HOST_SELECT_CANDIDATES); on a GPU none runs. And a step in which n-gram found nothing to
# draft is plain decoding's (PlainGeneration), not this one.
EXEMPT = {"forward_checking_rows", "_walk_tree_greedy", "_ancestor_mask_host", "_select_host", "_decode_one",
          "_next_tokens"}


class _ReadCounter:
    """Counts value reads of tensors while active (callers outside EXEMPT)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.where: list[str] = []
        for name in READS:
            orig = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(orig))

    def _wrap(self, orig):  # noqa: ANN001, ANN202
        def read(t, *a, **k):  # noqa: ANN001, ANN202
            caller = sys._getframe(1).f_code.co_name
            if caller not in EXEMPT:
                self.count += 1
                self.where.append(f"{caller}:{orig.__name__}")
            return orig(t, *a, **k)

        return read


METHODS = {
    "draft_model": {"name": "draft_model", "path": str(ZOO / "code-draft")},
    "eagle3": {"name": "eagle3", "path": str(ZOO / "code-eagle3")},
    "eagle3_tree": {"name": "eagle3", "path": str(ZOO / "code-eagle3"),
                    "tree": {"kind": "dynamic", "depth": 3, "top_k": 2}},
    "ngram": {"name": "ngram", "max_n": 2},
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_one_host_read_per_speculative_step(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(ZOO / "code-target"), method={**METHODS[method], "num_speculative_tokens": 4},
              runtime=RuntimeConfig(max_batch_size=1, max_seq_len=256), engine_config=EngineConfig(max_batch_size=1))
    engine = llm.new_engine()
    prompt = list(llm.tokenizer.encode(PROMPT).ids)
    ctx = engine.add_request(prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))
    for _ in range(3):  # the prompt, then steady state
        engine.step()
    pipe = llm.pipeline
    pipe.reset_stats()
    calls = []
    forward = pipe.module.forward
    monkeypatch.setattr(pipe.module, "forward", lambda **kw: calls.append(1) or forward(**kw))
    counter = _ReadCounter(monkeypatch)
    steps = 8
    for _ in range(steps):
        engine.step()
    monkeypatch.undo()
    assert not ctx.done
    stats = pipe.stats()
    assert stats.target_forwards == steps and stats.spec_steps == steps
    # Draft-and-verify steps (n-gram: those whose lookups found drafts; the others are plain).
    assert len(calls) == steps if method != "ngram" else len(calls) >= 2
    assert stats.host_syncs == len(calls), stats.host_syncs
    assert counter.count == len(calls), counter.where


def test_greedy_chain_verified_on_the_host_as_on_the_device() -> None:
    """accept_greedy_chain on the one read row == verify_greedy + chain_fault on the device,
    ragged requests, rejections, full acceptance and non-finite rows included."""
    g, v = 4, 11
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        b = 3
        logits = torch.randn(b, g + 1, v, generator=gen)
        argmax = logits.argmax(-1)
        drafts = torch.where(torch.rand(b, g, generator=gen) < 0.7, argmax[:, :g],
                             torch.randint(0, v, (b, g), generator=gen))
        if trial % 3 == 0:
            logits[trial % b, trial % (g + 1), trial % v] = float("nan" if trial % 2 else "inf")
        num_draft = torch.randint(0, g + 1, (b,), generator=gen)
        out, acc = verify_greedy(draft_tokens=drafts, target_logits=logits, num_draft=num_draft)
        fault = chain_fault(logits, None, acc, num_draft)
        rows = greedy_chain_readout(logits, drafts).tolist()
        for i in range(b):
            toks, k, f = accept_greedy_chain(rows[i], g, int(num_draft[i]))
            assert (k, f) == (int(acc[i]), int(fault[i]))
            assert toks == out[i, : k + 1].tolist()
