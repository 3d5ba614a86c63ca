"""One experiment: every prompt generated with plain target decoding (the
baseline) and with each selected speculative method, in the same run.

:func:`run_experiment` takes the composed Hydra config (``conf/run.yaml``)
and returns the run summary. Per batch of ``batch_size`` requests it runs the
plain pipeline and every method (side by side, by turns of a few steps, in
rotating order: :func:`specdec.measure.lockstep`), then writes one line per request to
``results.jsonl`` (append + flush + fsync) and rewrites ``summary.json``, so
an interrupted run loses at most the batch in flight. Files in the run
directory:

- ``results.jsonl``: per request: id, prompt length, and for ``plain`` and each
  method: output length, finish reason, latency, share of the batch's wall
  time, tokens/s; for methods also γ, steps, proposed / accepted / bonus
  counts, per-request τ and α, per-position counts, the accepted-length
  histogram, and whether the output equals plain decoding's;
- ``summary.json``: per method tokens/s, speedup, τ, α, per-position
  acceptance, accepted-length histogram, ``outputs_equal``, analytic limit and
  efficiency; recomputed over every record (also after a resume);
- ``summary.txt``: the console table; ``plots/*.png``; ``run_config.json``;
  ``forward_times.json`` (bare forward times of the analytic limit);
- ``wandb/``: the offline W&B run (``logger=wandb``, ``logger.mode=offline``): run-level
  figures in its summary, per-request ones under ``request/`` in its history, tables,
  charts, plots, and the files above as an artifact (layout: :mod:`specdec.logging.wandb_logger`).

Progress (``progress=true``): a bar on a terminal, else a line on stderr every
few seconds; loading, warm-up and forward timing each say when they start and
end (:mod:`.progress`).

The jobs, one module each: :mod:`.rundir` (the run directory, resuming, the
results store), :mod:`.runner` (generation), :mod:`.summary` (figures),
:mod:`.sweep` (the multirun callback); here, the orchestration and logging.

Resuming: ``resume_dir=<run dir>`` (or ``resume=true`` with an explicit
``run_dir=`` / ``hydra.run.dir=``) continues a run in place: completed request
ids are read back from ``results.jsonl`` and skipped (a line cut short by the
interruption is dropped and its request redone), the config must match the
saved ``run_config.json`` in everything that changes results (``data.limit``,
logging, progress and plotting may differ), requests that failed are run
again, and the summary is recomputed over all requests.

Faults: a request that fails (rejected at admission, or failed by a pipeline
mid-run) is recorded with its ``error`` and the others go on; the summary then
counts it in ``errors`` and never reports the run ``complete`` or its outputs
equal. Ctrl-C, SIGTERM, a full or read-only disk and any other exception end
the run with what is saved left valid, and the exception carries (as a note)
the command that continues the run. A run holds its dir's lock while it writes
it (:class:`~.rundir.RunDirLock`): a second run there fails at once
(:class:`RunDirBusy`). Greedy outputs of a method that differ from plain
decoding's are judged by the run's exactness policy (``exactness``,
:mod:`specdec.spec.exactness`; strict on CPU: any difference): a difference at a
near tie of the target's logits is counted in ``near_ties`` and logged, a
mismatch ends the run, once everything is saved, with :class:`OutputsDiffer`
unless ``allow_mismatch=true``.

``summary.json`` also records the ``machine`` (:mod:`.machine`): CPU, OS,
Python, torch build, GPU, git commit.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from specdec.conf_schema import Components, RunConfig, build_components, to_plain_dict, to_run_config
from specdec.data.prompts import load_prompts
from specdec.experiment.rundir import (
    CONFIG_FILE,
    FORWARD_TIMES_FILE,
    PLAIN,
    PLOTS_DIR,
    RESULTS_FILE,
    SUMMARY_FILE,
    TABLE_FILE,
    ExperimentError,
    ResultsStore,
    RunDirBusy,
    RunDirError,
    RunDirLock,
    check_checkpoints,
    check_resume_config,
    check_resume_dir,
    failed,
    hold_run_dir,
    hydra_job,
    lock_run_dir,
    make_run_dir,
    resolve_run_dir,
    resume_command,
    save_command,
    write_json,
    write_text,
)
from specdec.experiment.dashboard import (
    CATEGORY_COLUMNS,
    METHOD_COLUMNS,
    POSITION_COLUMNS,
    category_rows,
    method_rows,
    position_rows,
    run_labels,
)
from specdec.experiment.machine import machine_record
from specdec.logging.progress import Progress
from specdec.experiment.runner import Request, Runner, request_seed
from specdec.experiment.summary import TABLE_COLUMNS, request_metrics, summarize, table_rows
from specdec.experiment.sweep import SweepPlots
from specdec.logging import RunLogger, build_logger, summary_table
from specdec.spec.exactness import ExactnessPolicy
from specdec.zoo_fetch import resolve_target

__all__ = [
    "ExperimentError",
    "OutputsDiffer",
    "ResultsStore",
    "RunDirBusy",
    "RunDirError",
    "RunDirLock",
    "Runner",
    "SweepPlots",
    "Terminated",
    "build_logger",
    "check_resume_dir",
    "hold_run_dir",
    "machine_record",
    "request_seed",
    "resume_command",
    "run_experiment",
    "summarize",
]

if TYPE_CHECKING:
    from specdec.dist.group import DistContext

log = logging.getLogger(__name__)


class OutputsDiffer(Exception):
    """Greedy outputs of some method differ from plain decoding's (raised after the run's
    results and summary are saved; ``allow_mismatch=true`` makes it a log line).
    ``summary``: the run's summary."""

    def __init__(self, summary: dict[str, Any], results: Path) -> None:
        bad = [f"{n} ({_where(m['first_mismatch'])})" if m.get("first_mismatch") else n
               for n, m in summary["methods"].items() if m["outputs_equal"] is False]
        super().__init__(f"outputs differ from plain decoding: {', '.join(bad)}; every request's "
                         f"equal_to_plain and first_mismatch are in {results} (allow_mismatch=true accepts this)")
        self.summary = summary


def _where(d: dict[str, Any]) -> str:
    """``request <id>, position <i>`` of a summary's first difference, and the target's margin there."""
    margin = "" if d.get("margin") is None else f", logit margin {d['margin']:.3g}"
    bound = "" if d.get("bound") is None else f" (tie bound {d['bound']:.3g})"
    return f"request {d['id']}, position {d['position']}{margin}{bound if margin else ''}"


class Terminated(KeyboardInterrupt):
    """SIGTERM during a run (a job scheduler stopping it): ends the run as Ctrl-C does."""


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While the run goes, SIGTERM raises :class:`Terminated` (Python's default would exit at
    once, without saving the summary or saying how to resume). Handlers live in the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Terminated(f"signal {signal.Signals(signum).name}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _first_error(recs: Sequence[dict[str, Any]]) -> str:
    """``<request id> in <pipeline>: <error>`` of the first failed request."""
    return next(f"{r['id']} in {name}: {e['error']}" for r in recs
                for name, e in [(PLAIN, r[PLAIN]), *r["methods"].items()] if e.get("error"))


def run_experiment(cfg: DictConfig | RunConfig, *, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Runs the experiment ``cfg`` describes; returns the summary (also in ``summary.json``).

    Raises :class:`RunDirBusy` when another process runs in the dir, and :class:`OutputsDiffer`
    (after saving everything) when greedy outputs differ from plain decoding's and
    ``allow_mismatch`` is false."""
    with _sigterm_interrupts():
        return _run(cfg, run_dir)


def _run(cfg: DictConfig | RunConfig, run_dir: str | Path | None) -> dict[str, Any]:
    rc = to_run_config(cfg)
    comps = build_components(rc)
    comps.target = resolve_target(comps.target)  # a fetchable name (target=smollm2): its cached file
    check_checkpoints(comps)
    from specdec.dist import data_parallel as dp

    dctx, _ = dp.localize(rc.runtime)  # under torchrun: join the launch; rank 0 alone writes
    if not dctx.is_writer:
        return dp.follow(rc, comps, Runner)
    rdir = resolve_run_dir(rc, run_dir)
    make_run_dir(rdir)
    with lock_run_dir(rdir):  # a second run in this dir fails here, having written nothing
        summary = _run_in(rc, comps, rdir, dctx)
    if summary["outputs_equal"] is False and not rc.allow_mismatch:
        raise OutputsDiffer(summary, rdir / RESULTS_FILE)
    return summary


def _run_in(rc: RunConfig, comps: Components, rdir: Path, dctx: DistContext) -> dict[str, Any]:
    """The run, in the locked run dir ``rdir`` (rank 0's, under torchrun)."""
    from specdec.dist import data_parallel as dp

    resuming = rc.resume or rc.resume_dir is not None
    cfg_dict = to_plain_dict(rc)
    policy = ExactnessPolicy.resolve(rc.exactness, comps.runtime.device, rc.exactness_tie_margin)
    if resuming:
        check_resume_config(rdir, cfg_dict)
    store = ResultsStore(rdir, resume=resuming)  # refuses a dir with results unless resuming
    if not resuming or not (rdir / CONFIG_FILE).is_file():
        write_json(rdir / CONFIG_FILE, cfg_dict)
    save_command(rdir, has_results=bool(store.records))
    if rc.runtime.threads:
        import torch

        torch.set_num_threads(rc.runtime.threads)
    if resuming and not store.records:
        log.warning("resume requested but %s holds no results yet: starting from the first request", rdir)
    retried = store.discard_failed()
    if retried:
        log.warning("running again %d request(s) that failed before: %s", len(retried), ", ".join(retried))
    prompts = load_prompts(comps.data)
    pending = [p for p in prompts if p.id not in store.records]
    log.info("run dir %s: %d prompts, %d done, %d to run; methods: plain + %s", rdir, len(prompts),
             len(prompts) - len(pending), len(pending), ", ".join(comps.methods) or "(none)")

    overrides, sweep = hydra_job()
    gammas = {n: int(m.num_speculative_tokens) for n, m in comps.methods.items()}
    labels = run_labels(experiment=rc.name, target=comps.target, gammas=gammas,
                        temperature=float(comps.sampling.temperature), batch_size=rc.batch_size,
                        adaptive=[n for n, m in comps.methods.items() if getattr(m, "adaptive_gamma", False)],
                        overrides=overrides, sweep=sweep)
    progress = Progress(len(prompts), len(prompts) - len(pending), enabled=rc.progress)
    logger = build_logger(rc.logger)
    with progress.phase(f"starting the {rc.logger.name} logger") if rc.logger.name != "none" else nullcontext():
        logger.start(name=labels.name, run_dir=rdir, config={**cfg_dict, "hydra_overrides": overrides},
                     resume=bool(store.records), tags=labels.tags, group=labels.group, job_type=labels.job_type,
                     notes=labels.notes)
    meta = {
        "name": rc.name,
        "run_dir": str(rdir),
        "target": comps.target,
        "methods_config": {n: asdict(m) for n, m in comps.methods.items()},
        "sampling": asdict(comps.sampling),
        "batch_size": rc.batch_size,
        "num_prompts": len(prompts),
        "machine": machine_record(comps.runtime.device),
        "exactness": {"mode": policy.mode, "tie_margin": policy.tie_margin},  # tie_margin None: TIE_ULPS ulps
    }
    timings_file = rdir / FORWARD_TIMES_FILE
    timings: dict[str, Any] = json.loads(timings_file.read_text()) if timings_file.is_file() else {}

    def current_summary() -> dict[str, Any]:
        recs = list(store.records.values())
        done = sum(1 for p in prompts if p.id in store.records and not failed(store.records[p.id]))
        return {**meta, "num_requests": len(recs), "complete": done == len(prompts),
                "updated_at": datetime.now().isoformat(timespec="seconds"),
                **summarize(recs, gammas=gammas, greedy=comps.sampling.greedy, forward_times=timings or None)}

    pipelines = "plain" + "".join(f" + {n}" for n in comps.methods)
    first_batch = max((r.get("batch", -1) for r in store.records.values()), default=-1) + 1
    try:
        dp.lead(dctx, pending, first_batch)  # the other ranks run the same requests (their share)
        if pending:
            with progress.phase(f"loading models ({pipelines})"):
                runner = Runner(comps, save_outputs=rc.save_outputs)
            reqs = runner.encode(pending, comps.data.max_prompt_tokens)
            if rc.warmup and reqs:
                with progress.phase(f"warm-up ({rc.warmup} request(s) of {rc.warmup_tokens} tokens per pipeline)"):
                    runner.warmup(reqs, rc.warmup, rc.warmup_tokens)
            with progress:
                progress.start_requests(f"{pipelines}; batch {rc.batch_size}")
                # One process: batch after batch. torchrun: each replica its share, records merged here.
                for done in dp.run_batches(runner, reqs, rc.batch_size, first_batch, dctx):
                    for rec in done:
                        store.append(policy.judge_record(rec))
                        logger.log_request(request_metrics(rec), step=len(store.records))
                    so_far = current_summary()
                    write_json(rdir / SUMMARY_FILE, so_far)
                    progress.update(len(done), so_far)
            if comps.methods and not timings:  # the analytic limit's bare forwards, timed within the batches
                times = runner.forward_times()
                if times:
                    timings.update({n: asdict(t) for n, t in times.items()})
                    write_json(timings_file, timings)
        summary = current_summary()
        write_json(rdir / SUMMARY_FILE, summary)
        table = summary_table(summary)
        write_text(rdir / TABLE_FILE, table + "\n")
    except BaseException as e:  # interrupted or failed: what is saved stays valid; say how to go on
        try:
            write_json(rdir / SUMMARY_FILE, current_summary())
        except RunDirError as w:  # e.g. the disk is still full: a resume recomputes the summary
            log.warning("%s", w)
        stop = str(e) or "Ctrl-C"
        what = f"interrupted ({stop})" if isinstance(e, KeyboardInterrupt) else f"failed ({type(e).__name__})"
        hint = f"{len(store.records)} of {len(prompts)} requests saved in {rdir}; continue with: {resume_command(rdir)}"
        log.warning("%s: %s", what, hint)
        e.add_note(hint)
        logger.finish()
        raise

    print(f"\n{table}\n\nresults: {rdir}", flush=True)
    recs = list(store.records.values())
    if summary["errors"]:
        log.error("%d of %d requests failed (first: %s); each one's error is in %s",
                  summary["errors"], len(recs), _first_error(recs), rdir / RESULTS_FILE)
    if summary["outputs_equal"] is False and rc.allow_mismatch:  # else OutputsDiffer, once all is saved
        log.error("%s", OutputsDiffer(summary, rdir / RESULTS_FILE))
    if summary["near_ties"]:
        log.warning("outputs differ from plain decoding at near ties of the target's logits (%s exactness, not an "
                    "error): %s", policy.mode, ", ".join(f"{n} {m['near_ties']}x, first {_where(m['first_near_tie'])}"
                                                         for n, m in summary["methods"].items() if m["near_ties"]))

    images = {}
    if rc.plots:
        from specdec.plots import plot_run

        images = plot_run(summary, rdir / PLOTS_DIR)
    if logger.active:
        with progress.phase("W&B: logging the run"):
            _log_run(logger, summary, recs, images, rdir)
            logger.finish()  # offline: writes the run out; online: waits for the upload
    logger.finish()
    return summary


def _log_run(logger: RunLogger, summary: dict[str, Any], recs: Sequence[dict[str, Any]], images: dict[str, Path],
             rdir: Path) -> None:
    """The run-level part of the W&B run: summary, tables, native charts, histograms, plots, files.

    Everything here is a figure of the whole run (per-request values went to
    history as they completed); each call is best-effort (see the logger)."""
    logger.log_summary({k: v for k, v in summary.items() if k not in ("methods_config",)})
    logger.log_table("requests", TABLE_COLUMNS, table_rows(recs))
    logger.log_table("methods", METHOD_COLUMNS, method_rows(summary))
    logger.log_bar_chart("tau", "methods", "method", "tau", title="τ (tokens per target forward) per method")
    logger.log_bar_chart("speedup", "methods", "method", "speedup", title="speedup vs plain decoding per method")
    pos = position_rows(summary)
    if pos:
        logger.log_table("per_position", POSITION_COLUMNS, pos)
        logger.log_line_chart("per_position", "per_position", "position", "acceptance", series="method",
                              title="per-position acceptance")
    cats = category_rows(summary)
    if cats:
        logger.log_table("by_category", CATEGORY_COLUMNS, cats)
    for name, m in summary["methods"].items():
        if m.get("accepted_hist"):
            logger.log_histogram(f"{name}/accepted_hist", m["accepted_hist"])
    logger.log_images({f"plots/{k}": v for k, v in images.items()})
    files = {f: rdir / f for f in (RESULTS_FILE, SUMMARY_FILE, TABLE_FILE, CONFIG_FILE, FORWARD_TIMES_FILE)}
    files.update({f"{PLOTS_DIR}/{p.name}": p for p in images.values()})
    logger.log_artifact("results", "run-results", files, metadata={
        k: summary.get(k) for k in ("name", "target", "batch_size", "num_prompts", "num_requests", "complete",
                                    "outputs_equal", "errors")})
