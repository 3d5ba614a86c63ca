"""The Hydra callback of multiruns (``conf/run.yaml`` names ``specdec.experiment.SweepPlots``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


class SweepPlots(Callback):
    """Hydra callback: records a multirun's jobs when it starts; after it, tables and plots τ /
    speedup against the swept keys (:func:`sweep_table`, :func:`specdec.plots.plot_sweep`) and says
    which jobs finished (:func:`write_sweep_summary`)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
            from hydra.core.override_parser.overrides_parser import OverridesParser

            parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
            jobs = [o for batch in BasicSweeper.split_arguments(parsed, None) for o in batch]
            sweep_dir = Path(str(config.hydra.sweep.dir))
            sweep_dir.mkdir(parents=True, exist_ok=True)
            record_jobs(sweep_dir, [list(o) for o in jobs])
        except Exception as e:  # noqa: BLE001 - bookkeeping must not stop the sweep
            log.warning("could not record the sweep's jobs: %s: %s", type(e).__name__, e)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            from specdec.plots import plot_sweep

            sweep_dir = Path(str(config.hydra.sweep.dir))
            status = write_sweep_summary(sweep_dir)  # every job: finished, incomplete or missing
            made = plot_sweep([sweep_dir], sweep_dir)
            table = sweep_table(sweep_dir)
            text = f"{table}\n\n{status}" if table else status
            (sweep_dir / "sweep_summary.txt").write_text(text + "\n", encoding="utf-8")
            plots = f"\n\nsweep plots: {', '.join(str(p) for p in made.values())}" if made else ""
            print(f"\n{text}{plots}", flush=True)
        except Exception as e:  # noqa: BLE001 - plotting must not fail the sweep
            log.warning("sweep plots failed: %s: %s", type(e).__name__, e)


def sweep_table(sweep_dir: str | Path) -> str:
    """The sweep's figures, one row per job and method, labelled by the keys the sweep varied
    (whatever they are: γ, ``method.ngram.max_n``, a head path …); "" when no job has a summary."""
    from specdec.logging import format_table
    from specdec.plots import short_key, sweep_rows

    keys, rows = sweep_rows([sweep_dir])
    if not rows:
        return ""
    swept = [(k, short_key(k) if list(map(short_key, keys)).count(short_key(k)) == 1 else k, "") for k in keys]
    shown = {"sampling.temperature", "method.num_speculative_tokens"}  # have their own columns
    return format_table(rows, [*(c for c in swept if c[0] not in shown), ("method", "method", ""),
                               ("temperature", "T", "g"), ("gamma", "γ", "d"), ("tau", "τ", ".2f"),
                               ("alpha", "α", ".3f"), ("speedup", "speedup", ".2f")])


# --------------------------------------------------------------------------------------
# which jobs of a sweep finished (the submitit launchers write this when the sweep ends)
# --------------------------------------------------------------------------------------
JOBS_FILE = "sweep_jobs.json"  # the sweep's jobs: number and overrides (written at launch)
STATUS_FILE = "sweep_status.json"  # each job's state, τ and tokens/s per method
STATUS_TEXT = "sweep_status.txt"


def record_jobs(sweep_dir: Path, job_overrides: list[list[str]], first_job: int = 0) -> None:
    """Saves the sweep's job list (so a summary can say which jobs never started)."""
    import json

    jobs = [{"num": first_job + i, "overrides": list(o)} for i, o in enumerate(job_overrides)]
    f = Path(sweep_dir) / JOBS_FILE
    old = json.loads(f.read_text()) if f.is_file() else []
    known = {j["num"] for j in jobs}
    f.write_text(json.dumps([j for j in old if j["num"] not in known] + jobs, indent=1) + "\n", encoding="utf-8")


def _job_dirs(sweep_dir: Path) -> dict[int, Path]:
    return {int(p.name): p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()}


def sweep_status(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per job of the sweep: ``state`` is ``finished`` (summary complete),
    ``incomplete`` (some requests saved: resume with ``resume``), ``no results``
    (started, nothing saved) or ``missing`` (never started); figures of finished jobs."""
    import json

    from specdec.experiment.rundir import SUMMARY_FILE, resume_command

    sweep_dir = Path(sweep_dir)
    jobs_file = sweep_dir / JOBS_FILE
    dirs = _job_dirs(sweep_dir)
    if jobs_file.is_file():
        jobs = json.loads(jobs_file.read_text())
    else:  # basic launcher: the jobs that made a dir
        jobs = []
        for num, d in sorted(dirs.items()):
            ov = d / ".hydra" / "overrides.yaml"
            jobs.append({"num": num, "overrides": list(OmegaConf.load(ov)) if ov.is_file() else []})
    rows = []
    for j in sorted(jobs, key=lambda j: j["num"]):
        row: dict[str, Any] = {"job": j["num"], "overrides": " ".join(j["overrides"]), "state": "missing",
                               "requests": None, "dir": None, "resume": None, "methods": {}}
        d = dirs.get(j["num"])
        if d is not None:
            row["dir"] = str(d)
            f = d / SUMMARY_FILE
            s = json.loads(f.read_text()) if f.is_file() else None
            if s is None:
                row["state"] = "no results"
            else:
                row["requests"] = f"{s.get('num_requests', 0)}/{s.get('num_prompts', '?')}"
                row["state"] = "finished" if s.get("complete") else "incomplete"
                row["methods"] = {m: {"tau": v.get("tau"), "speedup": v.get("speedup")}
                                  for m, v in (s.get("methods") or {}).items()}
            if row["state"] != "finished":
                row["resume"] = resume_command(d)
        rows.append(row)
    return rows


def write_sweep_summary(sweep_dir: str | Path, job_overrides: list[list[str]] | None = None,
                        first_job: int = 0) -> str:
    """Writes ``sweep_status.json`` / ``.txt`` (every job's state) and returns the text."""
    import json

    from specdec.logging import format_table

    sweep_dir = Path(sweep_dir)
    if job_overrides is not None:
        record_jobs(sweep_dir, job_overrides, first_job)
    rows = sweep_status(sweep_dir)
    (sweep_dir / STATUS_FILE).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    table = format_table([{**r, "requests": r["requests"] or "-"} for r in rows],
                         [("job", "job", "d"), ("overrides", "overrides", ""), ("state", "state", ""),
                          ("requests", "requests", "")])
    done = sum(r["state"] == "finished" for r in rows)
    lines = [table, f"{done} of {len(rows)} jobs finished"]
    lines += [f"job {r['job']} {r['state']}: continue with: {r['resume']}" if r["resume"] else
              f"job {r['job']} missing: rerun with its overrides: {r['overrides']}"
              for r in rows if r["state"] != "finished"]
    text = "\n".join(lines)
    (sweep_dir / STATUS_TEXT).write_text(text + "\n", encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> None:
    """``python -m specdec.experiment.sweep <sweep dir>``: the figures per swept setting, and which jobs
    finished, which did not."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m specdec.experiment.sweep <sweep dir>", file=sys.stderr)
        raise SystemExit(2)
    table = sweep_table(args[0])
    print(f"{table}\n\n" if table else "", write_sweep_summary(args[0]), sep="")


if __name__ == "__main__":
    main()
