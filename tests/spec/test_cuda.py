"""The CUDA path (``runtime.device=cuda``): the same greedy tokens as plain
decoding on the CPU, for plain decoding and both proposers, in a ragged batch.
Skipped without a CUDA device; ``experiments/bench/gpu.sh`` runs it."""

from __future__ import annotations

import pytest
import torch

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig
from specdec.spec.proposers.draft_model import DraftModelConfig
from specdec.spec.proposers.ngram import NgramConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("method", ["plain", "draft_model", "ngram"])
def test_cuda_greedy_matches_cpu_plain(tiny_llama, method: str) -> None:
    target = tiny_llama(vocab=64, seed=0, qk_scale=0.1)  # loopy: n-gram drafts get accepted
    draft = tiny_llama(vocab=64, seed=0, qk_scale=0.1, perturb=0.01, perturb_seed=1)
    prompts = [[3, 5, 7, 3, 5, 7, 3], [1, 2], list(range(30))]
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ec = EngineConfig(max_batch_size=3)
    ref = [o.token_ids for o in LLM(target.path, runtime=RuntimeConfig(max_batch_size=3, max_seq_len=64),
                                    engine_config=ec).generate(prompts, sp)]
    mc = {"plain": None, "draft_model": DraftModelConfig(path=str(draft.path), num_speculative_tokens=3),
          "ngram": NgramConfig(num_speculative_tokens=3)}[method]
    rt = RuntimeConfig(max_batch_size=3, max_seq_len=64, device="cuda", dtype="float32", tf32=False)
    out = [o.token_ids for o in LLM(target.path, method=mc, runtime=rt, engine_config=ec).generate(prompts, sp)]
    assert out == ref
