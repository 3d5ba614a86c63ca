"""experiments/bench/gpu_summary.py: the one JSON of a gpu.sh run, from the logs its steps
left. A failed, timed-out, skipped or unfinished step is recorded as such, with its log's
tail, and does not stop the summary of the others."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "bench" / "gpu_summary.py"


def _step(out: Path, name: str, log: str, rc: str | None) -> None:
    (out / f"{name}.log").write_text(log)
    if rc is not None:
        (out / f"{name}.rc").write_text(rc)


def _summary(out: Path, *steps: str) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), *steps], capture_output=True, text=True,
                          timeout=60)
    return done.returncode, (json.loads(done.stdout) if done.returncode == 0 else {"stderr": done.stderr})


def test_summary_records_each_steps_status_json_and_the_device(tmp_path: Path) -> None:
    device = {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.9.0"}
    _step(tmp_path, "device", json.dumps(device) + "\n", "0 3")
    _step(tmp_path, "spec_b1", "table\n" + json.dumps({"efficiency_batch1": 0.8, "outputs_equal": True}) + "\n",
          "0 61.5")
    _step(tmp_path, "tests", "FAILED tests/spec/test_cuda.py::test_x - AssertionError\n1 failed, 30 passed\n", "1 40")
    _step(tmp_path, "compare_hf", "{\"partial\": 1}\nstill running\n", "124 200")  # killed by timeout
    _step(tmp_path, "smollm2", "skipped: no cached GGUF\n", "skip 0")
    _step(tmp_path, "spec_b8", "started\n", None)  # the script died inside this step
    rc, s = _summary(tmp_path, "device", "tests", "spec_b1", "spec_b8", "compare_hf", "smollm2")
    assert rc == 0, s
    assert s["device"] == device
    steps = s["steps"]
    assert list(steps) == ["compare_hf", "device", "smollm2", "spec_b1", "spec_b8", "tests"]  # sorted keys
    assert steps["spec_b1"]["status"] == "ok" and steps["spec_b1"]["json"]["efficiency_batch1"] == 0.8
    assert steps["spec_b1"]["seconds"] == 61.5 and "tail" not in steps["spec_b1"]
    assert steps["tests"]["status"] == "failed" and steps["tests"]["rc"] == 1
    assert steps["tests"]["json"] is None and steps["tests"]["tail"][-1] == "1 failed, 30 passed"
    assert steps["tests"]["last_line"] == "1 failed, 30 passed"  # pytest's count
    assert steps["compare_hf"]["status"] == "timeout" and steps["compare_hf"]["json"] == {"partial": 1}
    assert steps["smollm2"]["status"] == "skipped"
    assert steps["spec_b8"]["status"] == "missing"
    assert s["ok"] is False
    assert s["failed"] == ["tests", "spec_b8", "compare_hf"]  # in the order the steps ran
    assert s["skipped"] == ["smollm2"]


def test_summary_of_a_clean_run_is_ok_and_finds_the_steps_itself(tmp_path: Path) -> None:
    _step(tmp_path, "device", "{\"device\": \"cpu\"}\n", "0 1")
    _step(tmp_path, "ar", "skipped: ar.py takes no device=\n", "skip 0")
    rc, s = _summary(tmp_path)
    assert rc == 0, s
    assert s["ok"] is True and s["failed"] == [] and s["skipped"] == ["ar"]
    assert s["device"] == {"device": "cpu"}


def test_summary_of_a_missing_directory_says_so(tmp_path: Path) -> None:
    rc, s = _summary(tmp_path / "nowhere")
    assert rc == 2 and "nowhere is not a directory of step logs" in s["stderr"]
