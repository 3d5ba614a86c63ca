"""The W&B run an experiment writes, read back from its offline ``.wandb`` file.

W&B copies the last history value of every key into the run summary unless a
key is defined with ``summary="none"``; an offline run holds no computed
summary (that happens on sync), so these tests read the records the sync will
replay (run, metric definitions, history, summary updates, artifacts) and
work out the summary from them as W&B does.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specdec.experiment import run_experiment
from specdec.experiment.dashboard import category_rows, method_rows, position_rows, run_labels
from specdec.logging import RunLogger, flatten

from test_experiment import _compose, _overrides, tiny_pair  # noqa: F401  (a fixture)

wandb = pytest.importorskip("wandb")

INTERNAL = ("_",)  # W&B's own keys: _step, _runtime, _timestamp, _wandb
RUN_LEVEL_PREFIXES = ("tables/", "charts/", "plots/")  # logged once, at the end of the run


# --------------------------------------------------------------------------------------
# reading an offline run (the LevelDB-log layout of ``run-<id>.wandb``)
# --------------------------------------------------------------------------------------
def _chunks(data: bytes) -> Iterator[bytes]:
    """Records of a W&B transaction log: a 7-byte header, then 32 KiB blocks of
    [crc32, length, type] chunks (full, or first / middle / last of a record)."""
    assert data[:4] == b":W&B", "not a W&B transaction log"
    block, pos, buf = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:  # block padding
            pos += left
            continue
        if pos + 7 + n > len(data):  # a chunk still being written
            return
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk
            buf = b""
        else:
            raise AssertionError(f"unknown chunk type {kind}")


def read_offline_run(wandb_dir: Path) -> dict[str, Any]:
    """run / metric / history / summary / artifact records of the one offline run under ``wandb_dir``."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = list(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline run under {wandb_dir}, found {files}"
    # run.finish() can return before W&B's service has written the log's tail (CI once
    # read a file without the last history rows): wait for the closing exit record.
    deadline = time.monotonic() + 60
    while True:
        records = []
        for raw in _chunks(files[0].read_bytes()):
            rec = pb.Record()
            rec.ParseFromString(raw)
            records.append(rec)
        if (records and records[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out: dict[str, Any] = {"run": None, "metrics": [], "history": [], "summary": {}, "artifacts": []}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["run"] = rec.run
        elif kind == "metric":
            out["metrics"].append(rec.metric)
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in rec.history.item:
                key = item.key or item.nested_key[0]
                if len(item.nested_key) > 1:
                    row.setdefault(key, {})[item.nested_key[-1]] = json.loads(item.value_json)
                else:
                    row[key] = json.loads(item.value_json)
            out["history"].append(row)
        elif kind == "summary":
            for item in rec.summary.update:
                key = item.key or item.nested_key[0]
                if len(item.nested_key) > 1:
                    out["summary"].setdefault(key, {})[item.nested_key[-1]] = json.loads(item.value_json)
                else:
                    out["summary"][key] = json.loads(item.value_json)
        elif kind == "artifact":
            out["artifacts"].append(rec.artifact)
    return out


def effective_summary(run: dict[str, Any]) -> dict[str, Any]:
    """The summary W&B makes of these records: each history key's last value, unless the key
    is defined with summary "none", then the explicit summary updates on top."""
    no_summary = {m.name for m in run["metrics"] if m.name and m.summary.none}
    out: dict[str, Any] = {}
    for row in run["history"]:
        out.update({k: v for k, v in row.items() if k not in no_summary})
    out.update(run["summary"])
    return {k: v for k, v in out.items() if not k.startswith(INTERNAL)}


# --------------------------------------------------------------------------------------
# an experiment=quick run, offline
# --------------------------------------------------------------------------------------
def test_quick_run_offline_wandb_summary_history_tables_artifacts(tiny_pair, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.delenv("WANDB_MODE", raising=False)  # logger.mode alone decides
    monkeypatch.delenv("WANDB_DIR", raising=False)  # the run dir holds wandb/
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))  # artifact staging, not ~/.local
    run_dir = tmp_path / "run"
    summary = run_experiment(_compose(_overrides(tiny_pair, run_dir, "experiment=quick", "logger=wandb",
                                                 "logger.mode=offline")))
    assert summary["complete"] and summary["num_requests"] == 4
    run = read_offline_run(run_dir)
    methods = ("draft_model", "ngram")

    # --- per-request values: history under request/, against request/index, never summarised
    req_rows = [r for r in run["history"] if "request/index" in r]
    assert [r["request/index"] for r in req_rows] == [1, 2, 3, 4]
    recs = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    for rec, row in zip(recs, req_rows):
        for m in methods:
            assert row[f"request/{m}/tau"] == pytest.approx(rec["methods"][m]["tau"])
    history_keys = {k for r in run["history"] for k in r if not k.startswith(INTERNAL)}
    per_request = {k for k in history_keys if not k.startswith(RUN_LEVEL_PREFIXES)}
    assert per_request and all(k.startswith("request/") for k in per_request), per_request
    defined = {m.name: m for m in run["metrics"] if m.name}
    for k in per_request:
        assert k in defined and defined[k].summary.none, f"{k} would be copied into the run summary"
        if k != "request/index":
            assert defined[k].step_metric == "request/index"
    assert any(m.glob_name == "request/*" and m.summary.none for m in run["metrics"])

    # --- the run summary: the run's figures, and no single request's value under any key
    eff = effective_summary(run)
    assert not [k for k in eff if k.startswith("request/")]
    for m in methods:
        assert f"{m}/tau" not in eff  # the old ambiguous column
        assert eff[f"methods/{m}/tau"] == pytest.approx(summary["methods"][m]["tau"])
        assert eff[f"methods/{m}/speedup"] == pytest.approx(summary["methods"][m]["speedup"])
    explicit = {k for k in flatten({k: v for k, v in summary.items() if k != "methods_config"})}
    extra = {k for k in eff if k not in explicit and not k.startswith(RUN_LEVEL_PREFIXES)}
    assert not extra, f"summary keys that are not run figures: {sorted(extra)}"

    # --- tables, native charts, histograms, plots
    for key in ("tables/requests", "tables/methods", "tables/per_position", "charts/tau", "charts/speedup",
                "charts/per_position", "charts/draft_model/accepted_hist", "plots/tau_speedup",
                "plots/acceptance_per_position"):
        assert any(k == key or k.startswith(key + "_") for k in history_keys), (key, sorted(history_keys))

    # --- the files as an artifact
    arts = [a for a in run["artifacts"] if a.type == "run-results"]
    assert len(arts) == 1 and arts[0].name == f"run-{run['run'].run_id}-results"
    paths = {c.path: c.size for c in arts[0].manifest.contents}
    for f in ("results.jsonl", "summary.json", "summary.txt", "run_config.json", "forward_times.json",
              "plots/acceptance_per_position.png", "plots/tau_speedup.png", "plots/accepted_hist.png"):
        assert f in paths, (f, sorted(paths))
        assert paths[f] == (run_dir / f).stat().st_size

    # --- labels to compare runs by
    r = run["run"]
    assert r.job_type == "quick" and not r.run_group  # one run, not a sweep
    assert {"method:draft_model", "method:ngram", "gamma:3", "T:0", "greedy", "batch:1", "target:target",
            "exp:quick"} <= set(r.tags)
    assert "draft_model+ngram" in r.display_name and "γ=3" in r.display_name


def test_labels_name_tags_group_for_sweeps():
    lab = run_labels(experiment="gamma_sweep", target="/ckpt/llama-8b", gammas={"ngram": 4}, temperature=0.7,
                     batch_size=8, adaptive=["ngram"], overrides="method.num_speculative_tokens=4", sweep="2026_x")
    assert lab.group == "gamma_sweep-2026_x" and lab.job_type == "gamma_sweep"
    assert lab.name == "gamma_sweep · ngram · γ=4 · T=0.7 · bs=8 · llama-8b"
    assert {"method:ngram", "gamma:4", "T:0.7", "sampled", "batch:8", "target:llama-8b", "adaptive-gamma",
            "sweep"} <= set(lab.tags)
    assert "method.num_speculative_tokens=4" in lab.notes
    plain = run_labels(experiment="x", target="t", gammas={}, temperature=0.0, batch_size=1)
    assert plain.group is None and "method:plain" in plain.tags and "γ" not in plain.name


# --------------------------------------------------------------------------------------
# run-level tables from a hand-made summary
# --------------------------------------------------------------------------------------
SUMMARY = {
    "name": "exp", "target": "/ckpt/tgt", "sampling": {"temperature": 0.0}, "batch_size": 2, "num_prompts": 6,
    "plain": {"requests": 6, "tokens": 60, "tokens_per_s": 100.0, "errors": 0,
              "by_category": {"code": {"requests": 3, "tokens": 30, "tokens_per_s": 100.0, "errors": 0},
                              "math": {"requests": 3, "tokens": 30, "tokens_per_s": 100.0, "errors": 0}}},
    "methods": {
        "draft_model": {
            "gamma": 3, "requests": 6, "tokens": 60, "tokens_per_s": 150.0, "plain_tokens_per_s": 100.0,
            "speedup": 1.5, "tau": 2.5, "alpha": 0.6, "analytic_limit": 1.8, "efficiency": 0.83,
            "outputs_equal": True, "errors": 0, "per_position_acceptance": [0.8, 0.5, 0.0],
            "reached": [20, 16, 0], "accepted_at": [16, 8, 0],
            "by_category": {
                "code": {"requests": 3, "tokens_per_s": 160.0, "plain_tokens_per_s": 100.0, "speedup": 1.6,
                         "tau": 2.7, "alpha": 0.65, "outputs_equal": True, "errors": 0},
                "math": {"requests": 3, "tokens_per_s": 140.0, "plain_tokens_per_s": 100.0, "speedup": 1.4,
                         "tau": 2.3, "alpha": 0.55, "outputs_equal": True, "errors": 0},
            },
        },
    },
}


def test_run_level_rows():
    rows = method_rows(SUMMARY)
    assert [r[0] for r in rows] == ["plain", "draft_model"]
    assert rows[0][1:4] == [0, "tgt", 0.0] and rows[1][:4] == ["draft_model", 3, "tgt", 0.0]
    pos = position_rows(SUMMARY)
    assert [r[2] for r in pos] == [1, 2]  # position 3 was never reached: no row, not a 0.0
    assert pos[1][3:6] == [16, 8, 0.5] and pos[1][6] < 0.5 < pos[1][7]
    cats = category_rows(SUMMARY)
    assert [(r[0], r[1], r[5], r[6]) for r in cats] == [
        ("plain", "code", 1.0, 1.0), ("plain", "math", 1.0, 1.0),
        ("draft_model", "code", 1.6, 2.7), ("draft_model", "math", 1.4, 2.3)]


class _Recorder(RunLogger):
    """Records what the experiment logs at the end of a run."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any]] = []

    @property
    def active(self) -> bool:
        return True

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("log_"):
            return lambda *a, **k: self.calls.append((name, a[0] if a else k))
        return super().__getattribute__(name)


def test_log_run_logs_category_table_and_artifact(tmp_path):
    from specdec.experiment import _log_run

    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    logger = _Recorder()
    _log_run(logger, SUMMARY, [], {}, tmp_path)
    calls = [(n, a) for n, a in logger.calls]
    assert ("log_table", "by_category") in calls and ("log_table", "methods") in calls
    assert ("log_table", "per_position") in calls and ("log_artifact", "results") in calls
    assert not any(n == "log_request" for n, _ in calls)


def test_a_failing_artifact_upload_is_one_warning_and_the_rest_is_skipped(tmp_path, monkeypatch, caplog):
    """W&B breaking late (the artifact) never reaches the run: one warning, later calls do nothing."""
    import logging
    import sys
    import types

    from specdec.logging import LoggerConfig, build_logger

    calls: list[str] = []

    class Run:
        id = "abc"
        summary: dict[str, Any] = {}

        def define_metric(self, name: str, **k: Any) -> None:
            calls.append(f"define:{name}:{k.get('summary')}")

        def log(self, data: dict[str, Any], **k: Any) -> None:
            calls.append("log:" + ",".join(sorted(data)))

        def log_artifact(self, art: Any) -> None:
            raise OSError("disk full")

        def finish(self, *a: Any, **k: Any) -> None:
            calls.append("finish")

    fake = types.ModuleType("wandb")
    fake.Settings = lambda **k: k
    fake.init = lambda **k: Run()
    fake.Artifact = lambda *a, **k: types.SimpleNamespace(add_file=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    (tmp_path / "summary.json").write_text("{}")
    logger = build_logger(LoggerConfig(name="wandb", mode="offline"))
    with caplog.at_level(logging.WARNING):
        logger.start(name="r", run_dir=tmp_path, config={})
        logger.log_request({"ngram/tau": 2.0, "request/prompt_len": 5}, step=1)
        logger.log_artifact("results", "run-results", {"summary.json": tmp_path / "summary.json"})
        logger.log_summary({"tau": 2.0})
        logger.finish()
    assert "define:request/ngram/tau:none" in calls and "define:request/prompt_len:none" in calls
    assert "log:request/index,request/ngram/tau,request/prompt_len" in calls
    warnings = [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()]
    assert len(warnings) == 1 and "artifact" in warnings[0] and "disk full" in warnings[0]
    assert not logger.active and calls[-1] == "finish"
