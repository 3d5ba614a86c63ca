"""Faults and bad input in experiment runs: nothing silent, nothing leaked.

Requests that fail (too few KV blocks), a bad ``resume_dir``, SIGTERM and a
full disk, each on the tiny checkpoints of :mod:`test_experiment`: what the
summary says, what the command line prints, what the run dir holds after,
and that a resume finishes the run.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
from test_experiment import PROMPTS, _compose, _lines, _overrides, tiny_pair  # noqa: F401 (a fixture)

from specdec.experiment import ExperimentError, RunDirError, run_experiment, summarize
from specdec.experiment.rundir import ResultsStore, write_text
from specdec.logging import summary_table

FAST = ("logger=none", "plots=false", "warmup=0")


def _disk_full(fd: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _cli(*args: str, cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    return subprocess.Popen([sys.executable, "-m", "specdec.run", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _record(rid: str, *, plain_error: str | None = None, error: str | None = None, equal: bool = True) -> dict:
    """A results.jsonl record of plain decoding and one method ``m`` (γ 2, one step of 2 tokens)."""
    ok = error is None and plain_error is None
    return {
        "id": rid, "prompt_len": 3,
        "plain": {"output_len": 0 if plain_error else 2, "time_share_s": 0.1, "error": plain_error},
        "methods": {"m": {"output_len": 0 if error else 2, "time_share_s": 0.05, "error": error,
                          "steps": 0 if error else 1, "proposed": 0 if error else 2, "accepted": 0 if error else 1,
                          "bonus": 0 if error else 1, "equal_to_plain": (equal if ok else None)}},
    }


def test_summary_counts_errors_and_never_calls_a_run_with_failures_equal():
    ok = [_record("a"), _record("b")]
    s = summarize(ok, gammas={"m": 2}, greedy=True)
    assert s["outputs_equal"] is True and s["methods"]["m"]["outputs_equal"] is True and s["errors"] == 0

    recs = [*ok, _record("c", error="failed mid-run"), _record("d", plain_error="rejected at admission")]
    s = summarize(recs, gammas={"m": 2}, greedy=True)
    m = s["methods"]["m"]
    assert (s["errors"], s["plain"]["errors"], m["errors"]) == (2, 1, 1)
    assert m["requests"] == 2 and m["num_equal"] == 2  # only requests both sides finished are compared
    assert m["outputs_equal"] is None and s["outputs_equal"] is None  # not known equal: two were never compared
    table = summary_table(s).splitlines()
    assert table[0].split()[-1] == "errors"
    assert [line.split()[-1] for line in table[2:]] == ["1", "1"]  # plain, m

    mismatch = summarize([*recs, _record("e", equal=False)], gammas={"m": 2}, greedy=True)
    assert mismatch["methods"]["m"]["outputs_equal"] is False and mismatch["outputs_equal"] is False

    failed = summarize([_record("x", error="e"), _record("y", plain_error="e")], gammas={"m": 2}, greedy=True)
    assert failed["outputs_equal"] is None and failed["methods"]["m"]["tau"] is None  # nothing measured


def test_too_few_kv_blocks_fails_requests_loudly_and_resume_runs_them_again(tiny_pair, tmp_path, caplog):
    """runtime.num_blocks=2 (32 slots) cannot hold one prompt: every request is rejected, the run
    ends without the forward timer's traceback, and nothing says complete or equal."""
    run_dir = tmp_path / "run"
    over = _overrides(tiny_pair, run_dir, *FAST, "runtime.num_blocks=2", "data.limit=2")
    with caplog.at_level("WARNING"):
        s = run_experiment(_compose(over))
    log = caplog.text
    assert "no analytic limit" in log and "runtime.num_blocks" in log
    assert "2 of 2 requests failed (first: p0 in plain: " in log
    assert not (run_dir / "forward_times.json").exists()
    assert s["complete"] is False and s["outputs_equal"] is None and s["errors"] == 2
    assert s["plain"]["errors"] == 2
    assert all(m["errors"] == 2 and m["outputs_equal"] is None for m in s["methods"].values())
    assert json.loads((run_dir / "summary.json").read_text())["complete"] is False
    assert (run_dir / "summary.txt").read_text().splitlines()[0].split()[-1] == "errors"
    first = _lines(run_dir / "results.jsonl")
    for r in first:
        assert r["plain"]["finish_reason"] == "error" and "runtime.num_blocks" in r["plain"]["error"]
        assert all(e["equal_to_plain"] is None and e["error"] for e in r["methods"].values())

    caplog.clear()
    with caplog.at_level("WARNING"):
        resumed = run_experiment(_compose([*over, f"resume_dir={run_dir}"]))
    assert "running again 2 request(s) that failed before: p0, p1" in caplog.text
    assert resumed["complete"] is False and resumed["outputs_equal"] is None and resumed["errors"] == 2
    again = _lines(run_dir / "results.jsonl")
    assert [r["id"] for r in again] == ["p0", "p1"]  # redone, one line each
    assert all(a["completed_at"] > b["completed_at"] for a, b in zip(again, first))


def test_resume_dir_must_be_a_run_dir(tiny_pair, tmp_path, capsys, monkeypatch):
    target = tiny_pair[0]
    before = sorted(p.name for p in target.iterdir())
    missing = tmp_path / "no_such_run"
    for bad, why in ((missing, "does not exist"), (target, "has no run_config.json")):
        with pytest.raises(ExperimentError, match=f"resume_dir .*{why}"):
            run_experiment(_compose(_overrides(tiny_pair, tmp_path / "unused", *FAST, f"resume_dir={bad}")))

    from specdec.run import main

    def cli_exit(*args: str) -> tuple[int, str]:  # the console script in this process
        monkeypatch.setattr(sys, "argv", ["specdec", *args])
        with pytest.raises(SystemExit) as exit_:
            main()
        return exit_.value.code, capsys.readouterr().err

    code, err = cli_exit("-m", "method=ngram", f"resume_dir={missing}")  # a multirun too: refused before Hydra
    assert code == 2 and err.startswith(f"specdec: error: resume_dir '{missing}' does not exist")
    code, err = cli_exit("resume_dir=null", "no_such_key=1")  # not resuming: nothing to check (Hydra ends it)
    assert code == 2 and "no_such_key" in err and "resume_dir" not in err

    # the command line: Hydra would make resume_dir its run dir and write .hydra/ there
    cli = _cli(f"target.path={target}", "logger=none", f"resume_dir={target}", cwd=tmp_path)
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 2, err
    assert "specdec: error: resume_dir" in err and "run_config.json" in err and "Traceback" not in err
    assert sorted(p.name for p in target.iterdir()) == before and not missing.exists()


def test_sigterm_saves_says_how_to_resume_and_the_resume_finishes(tiny_pair, tmp_path):
    target, draft, _ = tiny_pair
    prompts = tmp_path / "prompts.jsonl"  # enough requests that the run is still going when the signal comes
    n = 40
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": PROMPTS[i % len(PROMPTS)]}) + "\n"
                               for i in range(n)))
    run_dir = tmp_path / "run"
    over = _overrides((target, draft, prompts), run_dir, *FAST, "method=ngram")
    cli = _cli(*over, cwd=tmp_path)
    results = run_dir / "results.jsonl"
    deadline = time.monotonic() + 60
    while not (results.is_file() and results.read_text().strip()):
        assert cli.poll() is None and time.monotonic() < deadline, cli.communicate()[1][-3000:]
        time.sleep(0.01)
    cli.send_signal(signal.SIGTERM)
    _, err = cli.communicate(timeout=60)

    assert cli.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "specdec: interrupted: signal SIGTERM" in err and "Traceback" not in err
    assert f"resume_dir={run_dir}" in err  # the resume hint
    text = results.read_text()
    assert text.endswith("\n")
    done = {r["id"]: r["completed_at"] for r in _lines(results)}  # every line whole JSON
    assert 0 < len(done) < n
    assert 0 < json.loads((run_dir / "summary.json").read_text())["num_requests"] <= len(done)
    assert not list(run_dir.glob("*.tmp"))

    s = run_experiment(_compose([*over, f"resume_dir={run_dir}"]))
    recs = _lines(results)
    assert sorted(r["id"] for r in recs) == sorted(f"q{i}" for i in range(n))  # each once
    assert {r["id"]: r["completed_at"] for r in recs if r["id"] in done} == done  # not redone
    assert s["complete"] is True and s["errors"] == 0 and s["outputs_equal"] is True


def test_a_failed_write_names_the_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    path.write_text("old\n")
    monkeypatch.setattr(os, "fsync", _disk_full)
    with pytest.raises(RunDirError, match=f"cannot write {path}: No space left on device"):
        write_text(path, "new\n")
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    store = ResultsStore(tmp_path, resume=False)
    with pytest.raises(RunDirError, match="results.jsonl: No space left on device"):
        store.append({"id": "a"})
    assert not store.records


def test_disk_full_mid_run_ends_with_the_file_and_the_resume_hint(tiny_pair, tmp_path, monkeypatch, caplog):
    """The disk fills after the first request: results.jsonl's append fails, and so does the summary
    written on the way out; the error names the file, carries the hint, and no temporary file stays."""
    run_dir = tmp_path / "run"
    over = _overrides(tiny_pair, run_dir, *FAST, "method=ngram")
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        results = run_dir / "results.jsonl"
        (_disk_full if results.is_file() and results.stat().st_size else real_fsync)(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with caplog.at_level("WARNING"), pytest.raises(RunDirError) as err:
        run_experiment(_compose(over))
    assert str(err.value) == f"cannot write {run_dir / 'results.jsonl'}: No space left on device"
    assert "During handling" not in "".join(traceback.format_exception(err.value))  # one error, not a chain
    assert any("continue with: specdec" in n and f"resume_dir={run_dir}" in n for n in err.value.__notes__)
    assert f"cannot write {run_dir / 'summary.json'}" in caplog.text
    assert not list(run_dir.glob("*.tmp"))

    monkeypatch.setattr(os, "fsync", real_fsync)  # space again: the resume finishes the run
    s = run_experiment(_compose([*over, f"resume_dir={run_dir}"]))
    assert [r["id"] for r in _lines(run_dir / "results.jsonl")] == ["p0", "p1", "p2", "p3"]
    assert s["complete"] is True and s["errors"] == 0


def test_a_second_run_in_a_run_dir_fails_at_once_naming_the_holder(tiny_pair, tmp_path):
    """Two runs writing one run dir would interleave their lines: while one holds the dir's lock,
    a resume (in-process or on the command line) fails naming its pid and writes nothing there;
    once released (the lock file stays, with the old pid), the resume finishes the run."""
    from specdec.experiment import RunDirBusy, RunDirLock

    run_dir = tmp_path / "run"
    over = _overrides(tiny_pair, run_dir, *FAST, "method=ngram")
    run_experiment(_compose([*over, "data.limit=2"]))

    def snapshot() -> dict[str, bytes]:
        return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}

    before = snapshot()
    with RunDirLock(run_dir):  # this test process is "the other run"
        with pytest.raises(RunDirBusy, match=re.escape(f"run dir '{run_dir}' is in use by pid {os.getpid()} ")):
            run_experiment(_compose([*over, f"resume_dir={run_dir}"]))
        cli = _cli(*over, f"resume_dir={run_dir}", cwd=tmp_path)
        _, err = cli.communicate(timeout=120)
        assert cli.returncode == 2, err[-3000:]
        assert err.startswith(f"specdec: error: run dir '{run_dir}' is in use by pid {os.getpid()} "), err[-3000:]
        assert "Traceback" not in err
        assert snapshot() == before  # not a byte written (not even Hydra's .hydra/)

    s = run_experiment(_compose([*over, f"resume_dir={run_dir}"]))
    assert [r["id"] for r in _lines(run_dir / "results.jsonl")] == ["p0", "p1", "p2", "p3"]
    assert s["complete"] is True and s["num_requests"] == 4


# A method that gets request p0's third token wrong (after generating it): what a broken verifier does.
_WRONG_METHOD = """
import sys
from specdec.engine import Engine

_steps = Engine.steps

def wrong(self):
    for ended in _steps(self):
        for c in ended:  # a speculative pipeline's requests only (plain decoding's stay right)
            if hasattr(self.pipeline, "proposer") and c.request_id == "p0" and c.num_generated > 2:
                c.tokens[c.prompt_len + 2] = (c.tokens[c.prompt_len + 2] + 1) % 128
        yield ended

Engine.steps = wrong
from specdec.run import main

sys.argv[0] = "specdec"
main()
"""


def test_outputs_that_differ_from_plain_decoding_end_the_run_with_exit_3(tiny_pair, tmp_path, caplog):
    """A method whose greedy output differs from plain decoding's: the run saves everything, then
    exits 3 naming the method, the first request and position and the target's logit margin there (on
    CPU any difference is a mismatch); allow_mismatch=true logs it instead."""
    from specdec.experiment import OutputsDiffer

    run_dir = tmp_path / "run"
    over = _overrides(tiny_pair, run_dir, *FAST, "method=ngram", "data.limit=2")
    script = tmp_path / "wrong_method.py"
    script.write_text(_WRONG_METHOD)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    out = subprocess.run([sys.executable, str(script), *over], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 3, out.stderr[-3000:]
    assert re.search(r"specdec: error: outputs differ from plain decoding: ngram \(request p0, position 2, "
                     r"logit margin [0-9.]+\)", out.stderr), out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    s = json.loads((run_dir / "summary.json").read_text())  # saved before the exit
    assert s["complete"] is True and s["outputs_equal"] is False and s["near_ties"] == 0
    assert s["exactness"] == {"mode": "strict", "tie_margin": None}  # auto, on CPU
    fm = s["methods"]["ngram"]["first_mismatch"]
    assert (fm["id"], fm["position"], fm["bound"]) == ("p0", 2, None) and fm["margin"] > 0
    recs = _lines(run_dir / "results.jsonl")
    assert [r["methods"]["ngram"]["equal_to_plain"] for r in recs] == [False, True]
    assert recs[0]["methods"]["ngram"]["first_mismatch"]["class"] == "mismatch"
    assert (run_dir / "summary.txt").is_file()

    # The finished run, resumed (nothing to generate): the same verdict, unless allowed.
    with pytest.raises(OutputsDiffer, match=r"ngram \(request p0, position 2, logit margin") as err:
        run_experiment(_compose([*over, f"resume_dir={run_dir}"]))
    assert err.value.summary["outputs_equal"] is False
    with caplog.at_level("ERROR"):
        allowed = run_experiment(_compose([*over, f"resume_dir={run_dir}", "allow_mismatch=true"]))
    assert allowed["outputs_equal"] is False
    assert "outputs differ from plain decoding: ngram (request p0, position 2, logit margin" in caplog.text
