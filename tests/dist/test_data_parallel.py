"""Data parallelism: replicas in one process, and processes under torchrun (Gloo), equal to one replica."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec import LLM, SamplingParams
from tests.dist.helpers import REPO, run_worker, tiny_checkpoint, tiny_pair, torchrun

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [10, 20, 30], [5, 9, 5, 9, 5, 9, 5, 9, 5], [100, 7, 42, 3, 3], [8, 8, 8]]
RUNTIME = {"dtype": "float64", "max_seq_len": 64, "max_batch_size": 4}
NEW = 10


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("dp")
    return {"target": tiny_checkpoint(d / "target", "llama", vocab=128, seed=4),
            "draft": tiny_checkpoint(d / "draft", "llama", vocab=128, layers=1, seed=5)}


def _methods(ckpts: dict[str, Path]) -> dict[str, object]:
    return {"plain": None, "draft_model": {"name": "draft_model", "path": str(ckpts["draft"]),
                                           "num_speculative_tokens": 3}}


@pytest.mark.parametrize("method", ["plain", "draft_model"])
def test_replicas_in_one_process_spread_requests_and_match(ckpts: dict[str, Path], method: str) -> None:
    m = _methods(ckpts)[method]
    sp = SamplingParams(max_new_tokens=NEW)
    want = [o.token_ids for o in LLM(ckpts["target"], method=m, **RUNTIME).generate(PROMPTS, sp)]
    llm = LLM(ckpts["target"], method=m, data_parallel_degree=2, **RUNTIME)
    engine = llm.new_engine()
    ctxs = [engine.add_request(p, sp) for p in PROMPTS]
    engine.run()
    assert [c.generated for c in ctxs] == want
    assert sorted({c.replica for c in ctxs}) == [0, 1]  # requests spread over both replicas
    if method == "plain":  # one pipeline model, its replica concat and splits: both caches used
        assert len(llm.pipeline.target.caches) == 2
    else:  # one speculative pipeline per replica, each one stepped
        assert [p.stats().target_forwards > 0 for p in llm.pipeline.pipelines] == [True, True]
        assert llm.pipeline.stats().counts.steps == sum(p.stats().counts.steps for p in llm.pipeline.pipelines)
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == want


def test_processes_merge_to_the_single_process_outputs(ckpts: dict[str, Path], tmp_path: Path) -> None:
    cases = [{"target": str(ckpts["target"]), "methods": _methods(ckpts)}]
    sampling = {"temperature": 0.8, "top_k": 20}  # no seed: drawn in prompt order, as one engine draws them
    ranks = run_worker(tmp_path, "dp", {"cases": cases, "prompts": PROMPTS, "max_new_tokens": NEW,
                                        "runtime": RUNTIME, "sampling": sampling})
    assert [r["ctx"]["dp"] for r in ranks] == [2, 2]
    sp = SamplingParams(max_new_tokens=NEW, **sampling)
    for name, m in _methods(ckpts).items():
        want = [o.token_ids for o in LLM(ckpts["target"], method=m, **RUNTIME).generate(PROMPTS, sp)]
        for r in ranks:  # every rank returns every prompt's output, in prompt order
            assert r[f"0/{name}"] == want, name


def _records(run_dir: Path) -> dict[str, dict]:
    """results.jsonl without what differs between any two runs (times, timestamps)."""
    timing = {"time_s", "time_share_s", "tokens_per_s", "draft_time_s", "target_time_s", "completed_at", "phase_s", "decode_s"}

    def clean(x: object) -> object:
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k not in timing}
        return x

    recs = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    return {r["id"]: clean(r) for r in recs}


ARGS = ["experiment=quick", "plots=false", "warmup=0", "data.limit=4", "sampling.max_new_tokens=8",
        "runtime.dtype=float64", "runtime.max_seq_len=256", "batch_size=1", "method=[draft_model,ngram]"]


@pytest.mark.slow
def test_experiment_across_processes_equals_one_process(tmp_path: Path) -> None:
    """torchrun -m specdec.run runtime.data_parallel_degree=2: one results.jsonl and summary, rank 0's,
    with the same records as a single-process run."""
    import subprocess
    import sys

    args = [*ARGS, *tiny_pair(tmp_path)]
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run([sys.executable, "-m", "specdec.run", *args, f"hydra.run.dir={one}"], cwd=REPO, check=True,
                   capture_output=True, env={**__import__("os").environ, "WANDB_MODE": "disabled"})
    torchrun(["-m", "specdec.run", *args, "runtime.data_parallel_degree=2", f"hydra.run.dir={two}"])
    a, b = _records(one), _records(two)
    assert list(a) == list(b) and a == b  # same requests, in the same order, with the same outputs and counts
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    for key in ("num_requests", "complete", "outputs_equal", "errors"):
        assert sa[key] == sb[key]
    for m in sa["methods"]:
        for key in ("tau", "alpha", "per_position_acceptance", "accepted_hist"):
            assert sa["methods"][m][key] == sb["methods"][m][key], (m, key)


def _pid_of_rank(tag: str, rank: int) -> int | None:
    """The pid of the process with ``SPECDEC_TEST_TAG=tag`` and ``RANK=rank`` in its environment."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SPECDEC_TEST_TAG={tag}".encode() in env and f"RANK={rank}".encode() in env:
            return int(d.name)
    return None


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_run_naming_it_and_the_run_resumes(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time
    import uuid

    from tests.dist.helpers import free_port

    args = [*ARGS[:-1], "method=[ngram]", "data.limit=12", "sampling.max_new_tokens=24", *tiny_pair(tmp_path)]
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "specdec.run", *args, "runtime.data_parallel_degree=2",
           f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "SPECDEC_DIST_TIMEOUT": "60",
           "SPECDEC_TEST_TAG": tag, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results = run_dir / "results.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (results.is_file() and results.read_text().count("\n") >= 2):
        time.sleep(0.2)
    pid = _pid_of_rank(tag, 1)
    assert pid is not None and proc.poll() is None, "the run ended before the test could stop rank 1"
    os.kill(pid, signal.SIGKILL)
    log, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0
    assert "rank: 1" in log  # torchrun names the rank that died
    saved = _records(run_dir)
    assert 2 <= len(saved) < 12 and all(not r["plain"]["error"] for r in saved.values())
    # The same command with resume_dir continues the run and completes it.
    torchrun(["-m", "specdec.run", *args, "runtime.data_parallel_degree=2", f"resume_dir={run_dir}"])
    done = _records(run_dir)
    assert len(done) == 12 and {k: done[k] for k in saved} == saved
    assert json.loads((run_dir / "summary.json").read_text())["complete"] is True
