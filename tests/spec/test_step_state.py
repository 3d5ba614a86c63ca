"""The per-step results in the shared state store (``num_accepted``, ``draft_tokens``)
are written for a proposer that reads them, and skipped for one that does not."""

from __future__ import annotations

import pytest
import torch

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig
from specdec.spec.proposers.draft_model import DraftModelConfig


@pytest.mark.parametrize("reads", [True, False])
def test_step_results_reach_the_state_store_only_when_read(tiny_llama, reads: bool) -> None:
    target = tiny_llama(vocab=64, seed=0, qk_scale=0.1)
    draft = tiny_llama(vocab=64, seed=0, qk_scale=0.1, perturb=0.01, perturb_seed=1)
    llm = LLM(str(target.path), DraftModelConfig(path=str(draft.path), num_speculative_tokens=3),
              runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64), engine_config=EngineConfig(max_batch_size=2))
    pipe = llm.pipeline
    pipe.proposer.reads_step_state = reads  # the class default is False for a draft model
    steps = []
    module = pipe.module

    def record(**kw):
        out = module(**kw)
        steps.append((kw["num_draft"].clone(), out))
        return out

    pipe.module = record
    seen = []
    release = pipe.state.release

    def snapshot(slot: int) -> None:  # the slot's values when its request ends
        seen.append((pipe.state.tensors["num_accepted"][slot].item(), pipe.state.tensors["draft_tokens"][slot].tolist()))
        release(slot)

    pipe.state.release = snapshot
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=12))
    (acc, drafts), = seen
    last = steps[-1][1]
    if reads:
        g = last.draft_tokens.shape[1]
        assert acc == last.num_accepted[0].item()
        assert drafts[:g] == last.draft_tokens[0].tolist()
    else:  # untouched since allocation: the specs' fill values
        assert acc == 0 and drafts == [0] * len(drafts)
    assert len(steps) > 1 and isinstance(last.num_accepted, torch.Tensor)
