"""The CUDA / NCCL path (runtime.device=cuda): skipped without GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams
from tests.dist.helpers import run_worker, tiny_checkpoint

pytestmark = pytest.mark.gpu
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [10, 20, 30], [5, 9, 5, 9, 5, 9, 5, 9, 5]]
RUNTIME = {"dtype": "float64", "max_seq_len": 64, "max_batch_size": 4}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_replicas_match_cpu(tmp_path: Path) -> None:
    path = tiny_checkpoint(tmp_path / "t", "qwen2", vocab=131, seed=8)
    sp = SamplingParams(max_new_tokens=10)
    want = [o.token_ids for o in LLM(path, **RUNTIME).generate(PROMPTS, sp)]
    got = LLM(path, device="cuda", data_parallel_degree=2, **RUNTIME).generate(PROMPTS, sp)
    assert [o.token_ids for o in got] == want


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL tensor parallelism needs 2 CUDA devices")
def test_nccl_tensor_parallel_matches_one_device(tmp_path: Path) -> None:
    target = tiny_checkpoint(tmp_path / "t", "qwen2", vocab=131, seed=9)
    draft = tiny_checkpoint(tmp_path / "d", "llama", vocab=131, layers=1, seed=10)
    methods = {"plain": None, "draft_model": {"name": "draft_model", "path": str(draft), "num_speculative_tokens": 3}}
    runtime = {**RUNTIME, "device": "cuda"}
    ranks = run_worker(tmp_path / "out", "tp", {"cases": [{"target": str(target), "methods": methods}],
                                                "prompts": PROMPTS, "max_new_tokens": 10, "runtime": runtime})
    assert {r["ctx"]["backend"] for r in ranks} == {"nccl"}
    for name, m in methods.items():
        want = [o.token_ids for o in LLM(target, method=m, **RUNTIME).generate(PROMPTS, SamplingParams(max_new_tokens=10))]
        assert all(r[f"0/{name}"] == want for r in ranks), name
