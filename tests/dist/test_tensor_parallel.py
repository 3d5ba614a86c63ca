"""Tensor parallelism: two Gloo processes give the tokens one process gives.

The test models run in float64 (``runtime.dtype``): an all-reduce sums the
ranks' partial products in another order than one matmul, so logits differ
in the last bits; in float64 that is far below any gap between the top two
logits, so greedy tokens are compared exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.dist.group import DistContext, DistError
from tests.dist.helpers import WORKER, run_worker, tiny_checkpoint, tiny_pair, torchrun

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [10, 20, 30], [5, 9, 5, 9, 5, 9, 5, 9, 5], [100, 7, 42, 3, 3]]
RUNTIME = {"dtype": "float64", "max_seq_len": 64, "max_batch_size": 4}
NEW = 10


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tp")
    return {
        "qwen2": tiny_checkpoint(d / "qwen2", "qwen2", vocab=131, tie=False, seed=1),  # bias, GQA, padded vocab
        "draft": tiny_checkpoint(d / "draft", "llama", vocab=131, tie=True, layers=1, heads=2, kv_heads=2, seed=2),
        "qwen3": tiny_checkpoint(d / "qwen3", "qwen3", vocab=128, tie=True, seed=3),  # q/k norm, tied head
    }


def _reference(target: Path, method: object) -> list[list[int]]:
    llm = LLM(target, method=method, **RUNTIME)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))]


def test_tensor_parallel_greedy_is_token_identical(ckpts: dict[str, Path], tmp_path: Path) -> None:
    from specdec.measure import random_head

    draft = {"name": "draft_model", "path": str(ckpts["draft"]), "num_speculative_tokens": 3}
    # EAGLE heads are replicated on every rank; they read the target's (all-reduced) hidden
    # states and its vocabulary-parallel embedding / lm_head, which return whole rows.
    heads = {k: {"name": k, "path": str(random_head(ckpts["qwen2"], k, seed=4)), "num_speculative_tokens": 3}
             for k in ("eagle", "eagle3")}
    cases = [
        {"target": str(ckpts["qwen2"]), "methods": {"plain": None, "draft_model": draft,
                                                     "ngram": {"name": "ngram", "num_speculative_tokens": 2},
                                                     # adaptive γ: exact under TP (the ranks share rank 0's
                                                     # timings, so they agree on γ; not provoked here)
                                                     "adaptive": {**draft, "adaptive_gamma": True},
                                                     **heads}},
        {"target": str(ckpts["qwen3"]), "methods": {"plain": None}},
    ]
    # Rank 1's clock runs 1e5x fast: its requests would pass their deadline at once, had it
    # decided by its own clock (the engine ends the requests rank 0 finds late).
    ranks = run_worker(tmp_path, "tp", {"cases": cases, "prompts": PROMPTS, "max_new_tokens": NEW,
                                        "runtime": RUNTIME, "sampling": {"deadline_s": 600},
                                        "clock_rate": {"1": 1e5}})
    assert [r["ctx"] for r in ranks] == [{"rank": i, "tp": 2, "dp": 1, "backend": "gloo"} for i in range(2)]
    for i, case in enumerate(cases):
        full = LLM(case["target"], **RUNTIME).pipeline.target
        full_params = sum(p.numel() for p in full.module.parameters())
        for name, method in case["methods"].items():
            want = _reference(Path(case["target"]), method)
            for r in ranks:
                key = f"{i}/{name}"
                assert r[key + "/errors"] == [None] * len(PROMPTS)
                assert r[key] == want, f"rank {r['ctx']['rank']}, {case['target']}, {name}"
                # A rank holds its shard: about half the weights (norms are replicated), half the KV heads.
                assert r[key + "/params"] < 0.6 * full_params
                assert r[key + "/kv_heads"] == full.caches[0].params.num_kv_heads // 2


def test_ranks_that_read_different_clocks_take_the_same_steps(tmp_path: Path) -> None:
    """The experiment's turns (one pipeline's steps, then the next's, by the clock) and the
    requests' deadlines are host decisions read off a clock. Here rank 1's clock runs 1000x
    fast: had it decided for itself, it would end every turn after one step and every
    request at its 60 s deadline while rank 0 went on (a collective mismatch: a crash, a
    hang, or outputs mixed across pipelines). Rank 0 decides for both: every method equals
    plain decoding, nothing passes its deadline."""
    run = tmp_path / "run"
    argv = [*tiny_pair(tmp_path), "experiment=quick", "plots=false", "warmup=0", "data.limit=2",
            "sampling.max_new_tokens=8", "sampling.deadline_s=60", "runtime.dtype=float64",
            "runtime.max_seq_len=128", "method=[draft_model,ngram]", "runtime.tensor_parallel_degree=2",
            f"hydra.run.dir={run}"]
    torchrun([str(WORKER), "run", str(tmp_path), json.dumps({"argv": argv, "clock_rate": {"1": 1000}})],
             env={"SPECDEC_DIST_TIMEOUT": "30"}, timeout=120)
    recs = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    for r in recs:
        assert r["plain"]["error"] is None and r["plain"]["finish_reason"] == "length", r["plain"]
        for name in ("draft_model", "ngram"):
            assert r["methods"][name]["equal_to_plain"] is True, (r["id"], name, r["methods"][name])


def test_a_collective_that_waits_too_long_names_the_rank_and_collective(tmp_path: Path) -> None:
    """Rank 1 skips an all-reduce rank 0 enters: rank 0 fails after the timeout with an
    error naming its rank and the collective's number, not a hang."""
    out = torchrun([str(WORKER), "stall", str(tmp_path), "{}"], env={"SPECDEC_DIST_TIMEOUT": "3"}, timeout=120,
                   check=False)
    assert out.returncode != 0
    log = out.stdout + out.stderr
    assert "rank 0 of 2 (tensor-parallel ranks [0, 1]): all_reduce of torch.float32 [4]" in log, log[-3000:]
    assert "collective #2 of this rank" in log


def test_shards_read_from_safetensors_slices(ckpts: dict[str, Path]) -> None:
    """Each rank's shard is exactly its slice of the full tensor (no process group needed to load)."""
    from specdec.core.checkpoint import load_decoder
    from specdec.dist.tensor_parallel import loader

    path = ckpts["qwen2"]
    full = load_decoder(path, dtype=torch.float64).module.state_dict()
    parts = [load_decoder(path, dtype=torch.float64, build=loader(DistContext(rank=r, world_size=2, tp=2))).module
             for r in range(2)]
    q = "model.layers.0.self_attn.q_proj"
    o = "model.layers.0.self_attn.o_proj.weight"
    for r, m in enumerate(parts):
        sd = m.state_dict()
        n = full[f"{q}.weight"].shape[0] // 2
        assert torch.equal(sd[f"{q}.weight"], full[f"{q}.weight"][r * n : (r + 1) * n])
        assert torch.equal(sd[f"{q}.bias"], full[f"{q}.bias"][r * n : (r + 1) * n])
        k = full[o].shape[1] // 2
        assert torch.equal(sd[o], full[o][:, r * k : (r + 1) * k])
        rows = -(-131 // 2)  # 66 per rank; rank 1's last row is padding
        emb = sd["model.embed_tokens.weight"]
        assert emb.shape == (rows, full["model.embed_tokens.weight"].shape[1])
        want = full["model.embed_tokens.weight"][r * rows : (r + 1) * rows]
        assert torch.equal(emb[: len(want)], want) and not emb[len(want):].any()
        assert m.model.layers[0].self_attn.n_heads == 2 and m.model.layers[0].self_attn.n_kv == 1


def test_heads_not_divisible_is_named(tmp_path: Path) -> None:
    from specdec.core.checkpoint import load_decoder
    from specdec.dist.tensor_parallel import loader

    path = tiny_checkpoint(tmp_path / "odd", "llama", heads=3, kv_heads=3, hidden=24)
    with pytest.raises(DistError, match="num_attention_heads = 3 is not divisible by runtime.tensor_parallel_degree=2"):
        load_decoder(path, build=loader(DistContext(rank=0, world_size=2, tp=2)))


def test_tensor_parallel_needs_torchrun(ckpts: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        LLM(ckpts["qwen3"], tensor_parallel_degree=2)
