"""The run directory: where it is, what it holds, and whether a run may resume in it.

Files (names below): ``results.jsonl`` (one line per completed request,
:class:`ResultsStore`), ``summary.json`` / ``summary.txt``, ``run_config.json``
(checked on resume), ``command.txt`` (the overrides, for :func:`resume_command`),
``forward_times.json`` (the bare forward times of the analytic limit), ``plots/``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shlex
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from specdec.conf_schema import ZOO_DIR, Components, RunConfig

log = logging.getLogger(__name__)

RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "run_config.json"
TABLE_FILE = "summary.txt"
COMMAND_FILE = "command.txt"  # the overrides the run was started with (to resume it)
FORWARD_TIMES_FILE = "forward_times.json"
PLOTS_DIR = "plots"
PLAIN = "plain"  # the baseline's key in every record

# Keys that may differ between a run and its resumption (they do not change results).
RESUME_FREE_KEYS = ("name", "logger", "run_dir", "resume", "resume_dir", "progress", "plots", "data.limit",
                    "warmup", "warmup_tokens", "runtime.threads")


class ExperimentError(ValueError):
    """A run that cannot start or resume (names the key or file at fault)."""


class ResultsStore:
    """``results.jsonl``: one line per completed request, keyed by request id."""

    def __init__(self, run_dir: Path, *, resume: bool) -> None:
        self.path = Path(run_dir) / RESULTS_FILE
        self.records: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            if not resume:
                raise ExperimentError(
                    f"{self.path} already holds results: pass resume=true (or resume_dir=...) to continue "
                    "that run, or choose another run_dir"
                )
            self._load()

    def _load(self) -> None:
        text = self.path.read_text(encoding="utf-8")
        keep: list[str] = []
        dropped = 0
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                rid = str(rec["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                dropped += 1  # cut short by an interruption: redone
                continue
            if rid in self.records:
                dropped += 1
                continue
            self.records[rid] = rec
            keep.append(line)
        if dropped or (text and not text.endswith("\n")):
            if dropped:
                log.warning("%s: dropped %d incomplete or duplicate line(s); those requests are redone",
                            self.path, dropped)
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
            os.replace(tmp, self.path)

    def append(self, rec: dict[str, Any]) -> None:
        """Appends one request's record (flushed and fsynced: an interruption loses at most the batch in flight)."""
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.records[str(rec["id"])] = rec


def write_json(path: Path, data: Any) -> None:
    """Writes ``data`` atomically (a temporary file, then a rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, Mapping) and v:
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out


def check_resume_config(run_dir: Path, cfg: dict[str, Any]) -> None:
    """Resuming: ``cfg`` must match the saved ``run_config.json`` (if any) in every key that changes results."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return
    saved = _flat(json.loads(path.read_text()))
    now = _flat(cfg)

    def free(k: str) -> bool:
        return any(k == f or k.startswith(f + ".") for f in RESUME_FREE_KEYS)

    diff = sorted(k for k in set(saved) | set(now) if not free(k) and saved.get(k) != now.get(k))
    if diff:
        lines = "; ".join(f"{k}: {saved.get(k)!r} (saved) vs {now.get(k)!r} (now)" for k in diff[:8])
        raise ExperimentError(
            f"cannot resume the run in {run_dir}: its config differs in {lines}. "
            f"Resume with the original overrides: {resume_command(run_dir)}"
        )


def save_command(run_dir: Path, has_results: bool) -> None:
    """Writes ``command.txt`` (this job's Hydra overrides) unless a run with results already wrote it."""
    f = run_dir / COMMAND_FILE
    if not f.is_file() or not has_results:
        f.write_text(shlex.join(_task_overrides() or []) + "\n", encoding="utf-8")


def _task_overrides() -> list[str] | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except (ValueError, AttributeError):
        return None


def resume_command(run_dir: Path) -> str:
    """The command line that continues the run in ``run_dir``."""
    f = Path(run_dir) / COMMAND_FILE
    drop = ("resume=", "resume_dir=", "run_dir=", "hydra.run.dir=")
    args = [a for a in (shlex.split(f.read_text()) if f.is_file() else []) if not a.startswith(drop)]
    return shlex.join(["specdec", *args, f"resume_dir={run_dir}"])


def resolve_run_dir(rc: RunConfig, run_dir: str | Path | None = None) -> Path:
    """Explicit argument > ``resume_dir`` > ``run_dir`` > Hydra's run dir > ``outputs/<name>/<stamp>_<uid>``."""
    if run_dir is not None:
        return Path(run_dir)
    if rc.resume_dir:
        p = Path(rc.resume_dir)
        if not p.is_dir():
            raise ExperimentError(f"resume_dir {str(p)!r} does not exist")
        return p
    if rc.run_dir:
        return Path(rc.run_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except (ValueError, AttributeError):
        stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        return Path("outputs") / rc.name / f"{stamp}_{secrets.token_hex(3)}"


def hydra_job() -> tuple[str | None, str | None]:
    """(override string of this job, sweep dir name) when running under Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        sweep = Path(str(hc.sweep.dir)).name if hc.mode == RunMode.MULTIRUN else None
        return (hc.job.override_dirname or None), sweep
    except (ValueError, AttributeError):
        return None, None


def check_checkpoints(comps: Components) -> None:
    """Every checkpoint directory the run loads exists (else the error names its key)."""
    paths = {"target.path": comps.target}
    for name, m in comps.methods.items():
        if getattr(m, "path", None):
            paths[f"method.{name}.path"] = m.path
    for key, p in paths.items():
        if not Path(p).is_dir():
            hint = (" (the built-in pair is made by `python experiments/train_zoo.py --out specdec/zoo`)"
                    if Path(p).parent == ZOO_DIR else "")
            raise ExperimentError(f"{key}: checkpoint directory {str(p)!r} does not exist{hint}")
