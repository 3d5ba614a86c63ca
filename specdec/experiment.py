"""One experiment: every prompt generated with plain target decoding (the
baseline) and with each selected speculative method, in the same run.

:func:`run_experiment` takes the composed Hydra config (``conf/run.yaml``)
and returns the run summary. Per batch of ``batch_size`` requests it runs the
plain pipeline and every method (in rotating order), timing each, then writes
one line per request to ``results.jsonl`` (append + flush + fsync) and
rewrites ``summary.json``, so an interrupted run loses at most the batch in
flight. Files in the run directory:

- ``results.jsonl``: per request: id, prompt length, and for ``plain`` and each
  method: output length, finish reason, latency, share of the batch's wall
  time, tokens/s; for methods also γ, steps, proposed / accepted / bonus
  counts, per-request τ and α, per-position counts, the accepted-length
  histogram, and whether the output equals plain decoding's;
- ``summary.json``: per method tokens/s, speedup, τ, α, per-position
  acceptance, accepted-length histogram, ``outputs_equal``; recomputed over
  every record (also after a resume);
- ``summary.txt``: the console table; ``plots/*.png``; ``run_config.json``;
- ``wandb/``: the offline W&B run (``logger=wandb``, ``logger.mode=offline``).

Figures (τ, α, per-position acceptance, speedup) are defined once, in
:mod:`specdec.spec.metrics`. Speedup = tokens/s with speculation ÷ tokens/s of
plain decoding over the same requests, batches and run; tokens/s of a
pipeline = its output tokens ÷ the summed wall time of its batches.

Resuming: ``resume_dir=<run dir>`` (or ``resume=true`` with an explicit
``run_dir=`` / ``hydra.run.dir=``) continues a run in place: completed request
ids are read back from ``results.jsonl`` and skipped (a line cut short by the
interruption is dropped and its request redone), the config must match the
saved ``run_config.json`` in everything that changes results (``data.limit``,
logging, progress and plotting may differ), and the summary is recomputed over
all requests.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from specdec.conf_schema import Components, LoggerSchema, RunConfig, build_components, to_plain_dict, to_run_config
from specdec.core.context import SamplingParams
from specdec.data.prompts import Prompt, load_prompts
from specdec.logging import LOGGERS, RunLogger, WandbConfig, summary_table

log = logging.getLogger(__name__)

RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "run_config.json"
TABLE_FILE = "summary.txt"
COMMAND_FILE = "command.txt"  # the overrides the run was started with (to resume it)
PLOTS_DIR = "plots"
PLAIN = "plain"

# Keys that may differ between a run and its resumption (they do not change results).
RESUME_FREE_KEYS = ("name", "logger", "run_dir", "resume", "resume_dir", "progress", "plots", "data.limit",
                    "warmup", "warmup_tokens", "runtime.threads")


class ExperimentError(ValueError):
    """A run that cannot start or resume (names the key or file at fault)."""


# --------------------------------------------------------------------------------------
# results on disk
# --------------------------------------------------------------------------------------
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
                log.warning("%s: dropped %d incomplete or duplicate line(s); those requests are redone", self.path, dropped)
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
            os.replace(tmp, self.path)

    def append(self, rec: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.records[str(rec["id"])] = rec


def _write_json(path: Path, data: Any) -> None:
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


def _check_or_save_config(run_dir: Path, cfg: dict[str, Any], resuming: bool) -> None:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        _write_json(path, cfg)
        return
    if not resuming:
        return  # ResultsStore refuses a dir with results; a bare config file is overwritten below
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


def _task_overrides() -> list[str] | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except (ValueError, AttributeError):
        return None


def resume_command(run_dir: Path) -> str:
    """The command line that continues the run in ``run_dir``."""
    import shlex

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


def _hydra_job() -> tuple[str | None, str | None]:
    """(override string of this job, sweep dir name) when running under Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        sweep = Path(str(hc.sweep.dir)).name if hc.mode == RunMode.MULTIRUN else None
        return (hc.job.override_dirname or None), sweep
    except (ValueError, AttributeError):
        return None, None


# --------------------------------------------------------------------------------------
# generation
# --------------------------------------------------------------------------------------
@dataclass
class Request:
    prompt: Prompt
    ids: list[int]
    sampling: SamplingParams


def request_seed(engine_seed: int, request_id: str) -> int:
    """A request's RNG seed from the run seed and its id (the same in a resumed run)."""
    h = hashlib.sha256(f"{engine_seed}:{request_id}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def _counts_dict(c: Any) -> dict[str, Any]:
    hist = getattr(c, "accepted_hist", None)
    return {
        "steps": c.steps, "proposed": c.proposed, "accepted": c.accepted, "bonus": c.bonus,
        "tau": c.tau, "alpha": c.alpha, "reached": list(c.reached), "accepted_at": list(c.accepted_at),
        "accepted_hist": list(hist) if hist is not None else None,
    }


class Runner:
    """The plain pipeline and one per method, over the same target and runtime."""

    def __init__(self, comps: Components, *, save_outputs: bool) -> None:
        from specdec.api import LLM

        self.comps = comps
        self.save_outputs = save_outputs
        self.llms: dict[str, Any] = {}
        for name, mcfg in {PLAIN: None, **comps.methods}.items():
            try:
                self.llms[name] = LLM(comps.target, mcfg, comps.runtime, comps.engine)
            except (ValueError, KeyError, OSError) as e:
                what = "plain decoding of the target" if mcfg is None else f"method {name!r}"
                raise ExperimentError(f"cannot build {what}: {e}") from e
        self.gammas = {name: int(m.num_speculative_tokens) for name, m in comps.methods.items()}

    @property
    def plain(self) -> Any:
        return self.llms[PLAIN]

    def encode(self, prompts: Sequence[Prompt], max_prompt_tokens: int | None) -> list[Request]:
        out = []
        for p in prompts:
            if p.token_ids is not None:
                ids = list(p.token_ids)
            else:
                if self.plain.tokenizer is None:
                    raise ExperimentError(
                        f"target.path {str(self.comps.target)!r} has no tokenizer.json: prompt {p.id!r} is text; "
                        "give token ids in the prompt file instead"
                    )
                ids = self.plain.encode(p.text)
            if max_prompt_tokens is not None:
                ids = ids[-max_prompt_tokens:]
            sp = self.comps.sampling
            seed = sp.seed if sp.seed is not None else request_seed(self.comps.engine.seed, p.id)
            out.append(Request(p, ids, replace(sp, seed=seed)))
        return out

    def _generate(self, name: str, items: Sequence[tuple[str, list[int], SamplingParams]]) -> tuple[dict[str, Any], float]:
        llm = self.llms[name]
        engine = llm.new_engine()
        ctxs = [engine.add_request(ids, sp, request_id=rid) for rid, ids, sp in items]
        module = getattr(llm.pipeline, "module", None)
        d0 = getattr(module, "draft_time", 0.0)
        t0_ = getattr(module, "target_time", 0.0)
        done_at: dict[str, float] = {}
        t0 = time.perf_counter()
        while engine.has_work():
            for ctx in engine.step():
                done_at[ctx.request_id] = time.perf_counter() - t0
        wall = time.perf_counter() - t0
        n = len(items)
        d_time = (getattr(module, "draft_time", 0.0) - d0) / n
        t_time = (getattr(module, "target_time", 0.0) - t0_) / n
        counts = getattr(llm.pipeline, "counts", None)
        out: dict[str, Any] = {}
        for ctx in ctxs:
            rid = ctx.request_id
            gen = list(ctx.generated) if ctx.error is None else []
            lat = done_at.get(rid)
            e: dict[str, Any] = {
                "output_len": len(gen),
                "finish_reason": ctx.finish_reason,
                "error": ctx.error,
                "time_s": lat,
                "time_share_s": wall / n,
                "tokens_per_s": len(gen) / lat if lat else None,
            }
            if name != PLAIN:
                e["gamma"] = self.gammas[name]
                c = counts.pop(rid, None) if counts is not None else None
                if c is not None:
                    e.update(_counts_dict(c))
                e["draft_time_s"] = d_time
                e["target_time_s"] = t_time
            e["_ids"] = gen
            out[rid] = e
        return out, wall

    def forward_times(self, ctx_len: int) -> dict[str, dict[str, float]]:
        """Bare forward times per method, for the analytic limit (seconds, medians)."""
        from specdec.spec.forward_time import forward_times

        runs = {"t1": (self.plain.pipeline.target, 1)}
        for name, g in self.gammas.items():
            pipe = self.llms[name].pipeline
            runs[f"{name}/tg"] = (pipe.target, g + 1)
            draft_pm = getattr(pipe.proposer, "pipeline", None)
            if draft_pm is not None:
                runs[f"{name}/td"] = (draft_pm, 1)
        t = forward_times(runs, ctx_len)  # interleaved: their ratios are what the limit uses
        return {
            name: {"t_target_1": t["t1"], "t_target_g1": t[f"{name}/tg"], "t_draft_1": t.get(f"{name}/td", 0.0)}
            for name in self.gammas
        }

    def warmup(self, reqs: Sequence[Request], n: int, tokens: int) -> None:
        if not n or not reqs:
            return
        for name in self.llms:
            items = [(f"warmup-{i}", reqs[i % len(reqs)].ids, replace(reqs[i % len(reqs)].sampling,
                      max_new_tokens=tokens)) for i in range(n)]
            self._generate(name, items)

    def run_batch(self, reqs: Sequence[Request], batch_index: int) -> list[dict[str, Any]]:
        items = [(r.prompt.id, r.ids, r.sampling) for r in reqs]
        names = list(self.llms)
        k = batch_index % len(names)
        order = names[k:] + names[:k]  # rotate who runs first, batch to batch
        results = {name: self._generate(name, items)[0] for name in order}
        now = time.time()
        recs = []
        for r in reqs:
            rid = r.prompt.id
            plain = results[PLAIN][rid]
            plain_ids = plain.pop("_ids")
            rec: dict[str, Any] = {
                "id": rid, "source": r.prompt.source, "prompt_len": len(r.ids), "seed": r.sampling.seed,
                "batch": batch_index, "batch_size": len(reqs), "completed_at": now,
                PLAIN: plain, "methods": {},
            }
            if self.save_outputs:
                plain["output_ids"] = plain_ids
                plain["text"] = self.plain.decode(plain_ids)
            for name in self.comps.methods:
                e = results[name][rid]
                ids = e.pop("_ids")
                e["equal_to_plain"] = ids == plain_ids
                e["first_mismatch"] = next(
                    (i for i, (a, b) in enumerate(zip(ids, plain_ids)) if a != b),
                    None if len(ids) == len(plain_ids) else min(len(ids), len(plain_ids)),
                )
                if self.save_outputs:
                    e["output_ids"] = ids
                rec["methods"][name] = e
            recs.append(rec)
        return recs


# --------------------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------------------
def _counts_from(entries: Sequence[Mapping[str, Any]]) -> Any:
    from specdec.spec.metrics import SpecCounts

    total = SpecCounts()
    has_hist = all(e.get("accepted_hist") is not None for e in entries)
    for e in entries:
        c = SpecCounts(steps=e.get("steps", 0), proposed=e.get("proposed", 0), accepted=e.get("accepted", 0),
                       bonus=e.get("bonus", 0), reached=list(e.get("reached", [])),
                       accepted_at=list(e.get("accepted_at", [])))
        if has_hist and hasattr(c, "accepted_hist"):
            c.accepted_hist = list(e["accepted_hist"])
        total.merge(c)
    return total, has_hist


def _throughput(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    tokens = sum(e["output_len"] for e in entries)
    t = sum(e["time_share_s"] for e in entries)
    return {"requests": len(entries), "tokens": tokens, "time_s": t, "tokens_per_s": tokens / t if t > 0 else None}


def summarize(
    records: Sequence[Mapping[str, Any]],
    *,
    gammas: Mapping[str, int],
    greedy: bool,
    forward_times: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, Any]:
    """Run figures over ``records`` (results.jsonl lines): plain and per method.

    With ``forward_times`` (per method: t_target_1, t_target_g1, t_draft_1)
    each method also gets its analytic limit and efficiency = speedup / limit.
    """
    from specdec.spec.metrics import analytic_limit

    ok = [r for r in records if not r[PLAIN].get("error")]
    out: dict[str, Any] = {"plain": _throughput([r[PLAIN] for r in ok]), "methods": {}}
    for name, gamma in gammas.items():
        both = [r for r in ok if name in r["methods"] and not r["methods"][name].get("error")]
        ents = [r["methods"][name] for r in both]
        thr = _throughput(ents)
        base = _throughput([r[PLAIN] for r in both])
        counts, has_hist = _counts_from(ents)
        n_eq = sum(1 for e in ents if e.get("equal_to_plain"))
        taus = [e["tau"] for e in ents if e.get("tau") is not None]
        out["methods"][name] = {
            "gamma": gamma,
            **thr,
            "plain_tokens_per_s": base["tokens_per_s"],
            "speedup": thr["tokens_per_s"] / base["tokens_per_s"]
            if thr["tokens_per_s"] and base["tokens_per_s"] else None,
            "tau": counts.tau,
            "alpha": counts.alpha,
            "per_position_acceptance": counts.per_position,
            "accepted_hist": list(counts.accepted_hist) if has_hist and hasattr(counts, "accepted_hist") else None,
            "steps": counts.steps,
            "proposed": counts.proposed,
            "accepted": counts.accepted,
            "mean_request_tau": sum(taus) / len(taus) if taus else None,
            "outputs_equal": (n_eq == len(ents)) if greedy else None,
            "num_equal": n_eq,
            "draft_time_s": sum(e.get("draft_time_s") or 0.0 for e in ents),
            "target_time_s": sum(e.get("target_time_s") or 0.0 for e in ents),
            "errors": len(records) - len(both),
        }
        ft = (forward_times or {}).get(name)
        m = out["methods"][name]
        if ft and m["speedup"] and counts.steps:
            m["analytic_limit"] = analytic_limit(tau=counts.tau, gamma=gamma, **ft)
            m["efficiency"] = m["speedup"] / m["analytic_limit"] if m["analytic_limit"] else None
            m["forward_times_s"] = dict(ft)
    eqs = [m["outputs_equal"] for m in out["methods"].values()]
    out["outputs_equal"] = all(eqs) if greedy and eqs else None
    out["errors"] = len(records) - len(ok)
    return out


def request_metrics(rec: Mapping[str, Any]) -> dict[str, Any]:
    """One W&B step per request: flat numbers."""
    m: dict[str, Any] = {"request/prompt_len": rec["prompt_len"], "plain/tokens_per_s": rec[PLAIN].get("tokens_per_s"),
                         "plain/time_s": rec[PLAIN].get("time_s")}
    pt = rec[PLAIN].get("time_s")
    for name, e in rec["methods"].items():
        m[f"{name}/tau"] = e.get("tau")
        m[f"{name}/alpha"] = e.get("alpha")
        m[f"{name}/tokens_per_s"] = e.get("tokens_per_s")
        m[f"{name}/time_s"] = e.get("time_s")
        m[f"{name}/speedup"] = pt / e["time_s"] if pt and e.get("time_s") else None
        m[f"{name}/equal_to_plain"] = int(bool(e.get("equal_to_plain")))
    return {k: v for k, v in m.items() if v is not None}


TABLE_COLUMNS = ("id", "method", "gamma", "prompt_len", "output_len", "steps", "proposed", "accepted", "tau",
                 "alpha", "equal_to_plain", "time_s", "tokens_per_s", "finish_reason")


def table_rows(records: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
    rows = []
    for r in records:
        for name, e in [(PLAIN, r[PLAIN]), *r["methods"].items()]:
            row = {"id": r["id"], "method": name, "prompt_len": r["prompt_len"], "gamma": e.get("gamma", 0), **e}
            if name == PLAIN:
                row.update(steps=e["output_len"], tau=1.0, equal_to_plain=True)
            rows.append([row.get(c) for c in TABLE_COLUMNS])
    return rows


# --------------------------------------------------------------------------------------
# the experiment
# --------------------------------------------------------------------------------------
def build_logger(cfg: LoggerSchema) -> RunLogger:
    cls = LOGGERS[cfg.name]
    if cls is LOGGERS["wandb"]:
        return cls(WandbConfig(mode=cfg.mode.value, project=cfg.project, entity=cfg.entity, group=cfg.group,
                               tags=tuple(cfg.tags), dir=cfg.dir, init_timeout_s=cfg.init_timeout_s,
                               log_requests=cfg.log_requests))
    return cls(None)


def _batches(items: Sequence[Request], size: int) -> Iterator[list[Request]]:
    for i in range(0, len(items), size):
        yield list(items[i : i + size])


def _check_checkpoints(comps: Components) -> None:
    paths = {"target.path": comps.target}
    for name, m in comps.methods.items():
        if getattr(m, "path", None):
            paths[f"method.{name}.path"] = m.path
    for key, p in paths.items():
        if not Path(p).is_dir():
            hint = (" (the built-in pair is made by `python experiments/train_zoo.py --out specdec/zoo`)"
                    if Path(p).parent == Path(__file__).resolve().parent / "zoo" else "")
            raise ExperimentError(f"{key}: checkpoint directory {str(p)!r} does not exist{hint}")


def run_experiment(cfg: DictConfig | RunConfig, *, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Runs the experiment ``cfg`` describes; returns the summary (also in ``summary.json``)."""
    rc = to_run_config(cfg)
    comps = build_components(rc)
    _check_checkpoints(comps)
    resuming = rc.resume or rc.resume_dir is not None
    rdir = resolve_run_dir(rc, run_dir)
    rdir.mkdir(parents=True, exist_ok=True)
    cfg_dict = to_plain_dict(rc)
    _check_or_save_config(rdir, cfg_dict, resuming)
    store = ResultsStore(rdir, resume=resuming)
    if not resuming:
        _write_json(rdir / CONFIG_FILE, cfg_dict)
    if not (rdir / COMMAND_FILE).is_file() or not store.records:
        import shlex

        (rdir / COMMAND_FILE).write_text(shlex.join(_task_overrides() or []) + "\n", encoding="utf-8")
    if rc.runtime.threads:
        import torch

        torch.set_num_threads(rc.runtime.threads)
    if resuming and not store.records:
        log.warning("resume requested but %s holds no results yet: starting from the first request", rdir)
    prompts = load_prompts(comps.data)
    pending = [p for p in prompts if p.id not in store.records]
    log.info("run dir %s: %d prompts, %d done, %d to run; methods: plain + %s", rdir, len(prompts),
             len(prompts) - len(pending), len(pending), ", ".join(comps.methods) or "(none)")

    overrides, sweep = _hydra_job()
    run_name = rc.name + (f"[{overrides}]" if overrides else "")
    logger = build_logger(rc.logger)
    if rc.logger.group is None and sweep and isinstance(logger.config, WandbConfig):
        logger.config = replace(logger.config, group=f"{rc.name}-{sweep}")
    logger.start(name=run_name, run_dir=rdir, config=cfg_dict, resume=bool(store.records))
    gammas = {n: int(m.num_speculative_tokens) for n, m in comps.methods.items()}
    meta = {
        "name": rc.name,
        "run_dir": str(rdir),
        "target": comps.target,
        "methods_config": {n: asdict(m) for n, m in comps.methods.items()},
        "sampling": asdict(comps.sampling),
        "batch_size": rc.batch_size,
        "num_prompts": len(prompts),
    }

    def current_summary() -> dict[str, Any]:
        recs = list(store.records.values())
        done = sum(1 for p in prompts if p.id in store.records)
        return {**meta, "num_requests": len(recs), "complete": done == len(prompts),
                "updated_at": datetime.now().isoformat(timespec="seconds"),
                **summarize(recs, gammas=gammas, greedy=comps.sampling.greedy, forward_times=timings or None)}

    timings_file = rdir / "forward_times.json"
    timings: dict[str, Any] = json.loads(timings_file.read_text()) if timings_file.is_file() else {}

    try:
        if pending:
            from tqdm.auto import tqdm

            runner = Runner(comps, save_outputs=rc.save_outputs)
            reqs = runner.encode(pending, comps.data.max_prompt_tokens)
            runner.warmup(reqs, rc.warmup, rc.warmup_tokens)
            first_batch = max((r.get("batch", -1) for r in store.records.values()), default=-1) + 1
            with tqdm(total=len(prompts), initial=len(prompts) - len(pending), desc="requests", unit="req",
                      disable=None if rc.progress else True, dynamic_ncols=True) as bar:  # None: off when not a TTY
                for b, batch in enumerate(_batches(reqs, rc.batch_size), start=first_batch):
                    for rec in runner.run_batch(batch, b):
                        store.append(rec)
                        logger.log_request(request_metrics(rec), step=len(store.records))
                        bar.update(1)
                    _write_json(rdir / SUMMARY_FILE, current_summary())
            if comps.methods and not timings:  # bare forward times for the analytic limit
                ctx_len = int(sum(len(r.ids) for r in reqs) / len(reqs)) + comps.sampling.max_new_tokens // 2
                timings.update(runner.forward_times(ctx_len))
                _write_json(timings_file, timings)
    except BaseException as e:  # interrupted or failed: what is saved stays valid; say how to go on
        _write_json(rdir / SUMMARY_FILE, current_summary())
        what = "interrupted" if isinstance(e, KeyboardInterrupt) else f"failed ({type(e).__name__})"
        log.warning("%s: %d of %d requests saved in %s; continue with: %s",
                    what, len(store.records), len(prompts), rdir, resume_command(rdir))
        logger.finish()
        raise

    summary = current_summary()
    _write_json(rdir / SUMMARY_FILE, summary)
    table = summary_table(summary)
    (rdir / TABLE_FILE).write_text(table + "\n", encoding="utf-8")
    print(f"\n{table}\n\nresults: {rdir}", flush=True)
    if summary["outputs_equal"] is False:
        bad = [n for n, m in summary["methods"].items() if m["outputs_equal"] is False]
        log.error("greedy outputs differ from plain decoding for %s (see equal_to_plain in %s)",
                  ", ".join(bad), rdir / RESULTS_FILE)

    images = {}
    if rc.plots:
        from specdec.plots import plot_run

        images = plot_run(summary, rdir / PLOTS_DIR)
    recs = list(store.records.values())
    logger.log_summary({k: v for k, v in summary.items() if k not in ("methods_config",)})
    logger.log_table("requests", TABLE_COLUMNS, table_rows(recs))
    for name, m in summary["methods"].items():
        if m.get("accepted_hist"):
            logger.log_histogram(f"{name}/accepted_hist", m["accepted_hist"])
    logger.log_images({f"plots/{k}": v for k, v in images.items()})
    logger.finish()
    return summary


# --------------------------------------------------------------------------------------
# sweeps
# --------------------------------------------------------------------------------------
class SweepPlots(Callback):
    """Hydra callback: after a multirun, plots τ / speedup against γ over its runs."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            from specdec.logging import format_table
            from specdec.plots import load_summaries, plot_sweep, sweep_points

            sweep_dir = Path(str(config.hydra.sweep.dir))
            made = plot_sweep([sweep_dir], sweep_dir)
            rows = [{"method": m, "temperature": t, **p} for (m, t), pts in sorted(
                sweep_points(load_summaries([sweep_dir])).items()) for p in pts]
            if rows:
                table = format_table(rows, [("method", "method", ""), ("temperature", "T", "g"), ("gamma", "γ", "d"),
                                            ("tau", "τ", ".2f"), ("alpha", "α", ".3f"), ("speedup", "speedup", ".2f")])
                (sweep_dir / "sweep_summary.txt").write_text(table + "\n", encoding="utf-8")
                print(f"\n{table}\n\nsweep plots: {', '.join(str(p) for p in made.values())}", flush=True)
        except Exception as e:  # noqa: BLE001 - plotting must not fail the sweep
            log.warning("sweep plots failed: %s: %s", type(e).__name__, e)
