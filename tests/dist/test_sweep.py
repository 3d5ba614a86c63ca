"""Sweeps through Hydra's submitit launcher (local processes: the SLURM path without a cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.experiment.sweep import sweep_status, write_sweep_summary
from tests.dist.helpers import REPO
from tests.dist.test_data_parallel import tiny_pair

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")


def test_submitit_local_sweep_lists_its_jobs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "specdec.run", "-m", "hydra/launcher=submitit_local", "experiment=quick",
           "method=[draft_model,ngram]", "method.num_speculative_tokens=1,2", "plots=false", "warmup=0", "data.limit=2",
           "sampling.max_new_tokens=8", "runtime.threads=1", "runtime.max_seq_len=256", *tiny_pair(tmp_path),
           f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = sweep_status(sweep)
    assert [(r["job"], r["state"], r["requests"]) for r in rows] == [(0, "finished", "2/2"), (1, "finished", "2/2")]
    assert ["method.num_speculative_tokens=1" in rows[0]["overrides"],
            "method.num_speculative_tokens=2" in rows[1]["overrides"]] == [True, True]
    text = (sweep / "sweep_summary.txt").read_text()
    assert "2 of 2 jobs finished" in text
    for job in (0, 1):  # each job: its own run dir, resumable as any run
        assert json.loads((sweep / str(job) / "summary.json").read_text())["complete"] is True


def test_sweep_summary_names_missing_and_incomplete_jobs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "summary.json").write_text(json.dumps({"complete": True, "num_requests": 4, "num_prompts": 4}))
    (sweep / "1").mkdir()
    (sweep / "1" / "summary.json").write_text(json.dumps({"complete": False, "num_requests": 1, "num_prompts": 4}))
    text = write_sweep_summary(sweep, [["a=1"], ["a=2"], ["a=3"]])
    states = [(r["job"], r["state"]) for r in sweep_status(sweep)]
    assert states == [(0, "finished"), (1, "incomplete"), (2, "missing")]
    assert "1 of 3 jobs finished" in text
    assert f"resume_dir={sweep / '1'}" in text and "job 2 missing: rerun with its overrides: a=3" in text
