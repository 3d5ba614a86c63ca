"""The one measuring core: the experiment runner and every benchmark time with it.

The figures (defined in :mod:`specdec.spec.metrics` and the README; here
only how they are measured):

- **speedup** of a run over the baseline = the baseline's seconds ÷ the run's
  seconds for the same work (so the ratio of their tokens/s), taken pass by
  pass, both timed in the same pass, and the median over passes
  (:meth:`Timing.speedup`). Timed side by side, by turns of a few steps
  (:func:`lockstep`), a slow spell of a busy machine falls on both sides of
  a ratio;
- **analytic limit** = τ · S_plain / C_spec and **efficiency** = decode-phase speedup ÷
  limit (defined in :mod:`specdec.spec.metrics`, the step's bare cost C_spec in
  :func:`specdec.spec.cost.step_cost`), one way in every tool (the run summary, spec.py,
  compare_hf.py): :func:`spec_limit` takes τ from the run's counts and outputs, S_plain
  from its plain passes (:func:`plain_step_s`), C_spec from the bare forward times of the
  method's own models (:class:`ForwardTimes`) timed by turns within those same passes
  (:func:`limit_runs`, :func:`limit_from`) at :func:`limit_context` and at the passes'
  batch size: every bare forward (the target's T(1) and T(γ+1), the drafter's catch-up
  and drafting) feeds B throwaway requests at once, as a step of B requests does, so
  that C_spec and S_plain (a step of B) compare like with like; :func:`efficiency`
  divides;
- **step-time breakdown** (:func:`step_breakdown`): a run's milliseconds per
  speculative step in each phase of the step (:class:`specdec.spec.metrics.PhaseTimes`)
  beside what the step's bare cost charges for it, and the share of the run's
  wall time the phases account for.

And the small things every benchmark needs: :func:`load_config` (``key=value``
overrides through Hydra), :func:`print_table`, :func:`emit_json` (the closing
JSON line, with the :func:`machine` it ran on), the shipped model pair
(:func:`builtin_pair`, :func:`builtin_prompts`), :func:`checkpoint` options and
:func:`random_checkpoint`, and transformers' model of a checkpoint (:func:`hf_model`).
``transformers`` is imported only inside the functions that need it.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import gc
import inspect
import json
import os
import platform
import re
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Collection, Generator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from specdec.conf_schema import ZOO_DIR
from specdec.core.kernels import cpu_kernels_available
from specdec.core.kv_cache import OutOfBlocks
from specdec.core.pipeline_model import DecoderPipelineModel, RuntimeConfig
from specdec.spec.forward_time import forward_time
from specdec.spec.cost import step_cost, target_line
from specdec.spec.metrics import PHASES, RunStats, SpecCounts, analytic_limit, decode_tau

if TYPE_CHECKING:
    from specdec.api import LLM
    from specdec.engine import GenerationOutput

T = TypeVar("T")
C = TypeVar("C")


# --------------------------------------------------------------------------------------
# interleaved timing
# --------------------------------------------------------------------------------------
def timed(fn: Callable[[], T], timer: Callable[[], float] = time.perf_counter) -> tuple[float, T]:
    """Seconds ``fn()`` takes (on ``timer``), and its result.

    First it collects the garbage there is and moves every object alive now
    (models, compiled graphs, the libraries' own) out of the garbage
    collector's view (``gc.freeze``, as serving engines do after start-up).
    Otherwise a full collection over a benchmark process's ~600k objects
    (200-350 ms each, several per run) lands inside whichever pass it happens
    to, ours or transformers', at random.
    """
    gc.collect()
    gc.freeze()
    t = timer()
    out = fn()
    return timer() - t, out


@dataclass(frozen=True)
class Run(Generic[T]):
    """One contestant of :func:`interleave` or :func:`lockstep`."""

    fn: Callable[[], T]  # one timed pass
    warmup: Callable[[], object] | None = None  # untimed, before any timing; None: a pass of fn
    before: Callable[[], object] | None = None  # untimed, before each timed pass (e.g. reset_stats)
    passes: int | None = None  # timed passes, the first ones (None: every repeat)
    # lockstep only: the same pass as a generator of steps that returns fn's result,
    # timestamping with the clock given (``LLM.generate_steps``); None: fn, whole, in one turn.
    steps: Callable[[Callable[[], float]], Generator[None, None, T]] | None = None


@dataclass
class Timing(Generic[T]):
    """What :func:`interleave` measured, per run name."""

    baseline: str
    times: dict[str, list[float]]  # [passes] seconds of each timed pass
    outputs: dict[str, list[T]]  # [passes] what each timed pass returned
    ratios: dict[str, list[float]]  # [passes] the baseline's seconds ÷ this run's, same pass

    def median(self, name: str) -> float:
        """Median seconds of a pass."""
        return statistics.median(self.times[name])

    def speedup(self, name: str) -> float:
        """Median over passes of the baseline's time ÷ this run's (side by side)."""
        return statistics.median(self.ratios[name])

    def last(self, name: str) -> T:
        """The last timed pass's result."""
        return self.outputs[name][-1]

    def decode_speedup(self, name: str) -> float:
        """Median over passes of this run's decode-phase tokens/s ÷ the baseline's, same pass
        (:func:`decode_rate`; the passes must return ``GenerationOutput`` lists)."""
        return statistics.median(decode_rate(s) / decode_rate(p)  # type: ignore[arg-type]
                                 for s, p in zip(self.outputs[name], self.outputs[self.baseline]))


def decode_rate(outs: Sequence[GenerationOutput]) -> float:
    """Decode-phase tokens/s of one pass: the tokens after each request's first step, over
    their time. The analytic limit is a per-step model of decoding, so efficiency divides this
    phase's speedup by it: the first step (the prefill, the same work with or without
    speculation) is left out on both sides."""
    return sum(x.decode_tokens for x in outs) / sum(x.decode_s for x in outs)


def warm_up(runs: Mapping[str, Run[Any]], rounds: int = 1) -> None:
    """Untimed: each run's ``warmup`` (or one pass), ``rounds`` times."""
    for _ in range(rounds):
        for run in runs.values():
            (run.warmup or run.fn)()


def interleave(
    runs: Mapping[str, Run[T] | Callable[[], T]],
    *,
    baseline: str,
    repeats: int,
    warmup: int = 1,
    offset: int = 0,
) -> Timing[T]:
    """Times every run ``repeats`` times, interleaved, after ``warmup`` untimed rounds.

    Pass ``p`` times each run once, starting from run ``(offset + p) mod n``
    of ``runs`` (rotated: no run always goes first). ``baseline`` runs in
    every pass; each run's ratio in a pass is the baseline's time in that
    pass ÷ its own.
    """
    rs: dict[str, Run[T]] = {k: v if isinstance(v, Run) else Run(v) for k, v in runs.items()}
    if baseline not in rs or rs[baseline].passes is not None:
        raise ValueError(f"the baseline {baseline!r} must be one of the runs and time every pass")
    warm_up(rs, warmup)
    names = list(rs)
    timing: Timing[T] = Timing(baseline, {k: [] for k in rs}, {k: [] for k in rs}, {k: [] for k in rs})
    for p in range(repeats):
        first = (offset + p) % len(names)
        this_pass: dict[str, float] = {}
        for name in names[first:] + names[:first]:
            run = rs[name]
            if run.passes is not None and p >= run.passes:
                continue
            if run.before is not None:
                run.before()
            t, out = timed(run.fn)
            this_pass[name] = t
            timing.times[name].append(t)
            timing.outputs[name].append(out)
        for name, t in this_pass.items():
            timing.ratios[name].append(this_pass[baseline] / t)
    return timing


class TurnClock:
    """Seconds of its owner's turns so far (:func:`lockstep`): it runs only between
    ``start()`` and ``stop()``, so the requests of a run timed by turns get their
    ``ttft_s`` / ``decode_s`` without the other runs' turns in them."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter) -> None:
        self.timer = timer
        self.elapsed = 0.0
        self.since: float | None = None  # the timer at the start of the turn running now

    def start(self) -> float:
        self.since = self.timer()
        return self.since

    def stop(self) -> None:
        assert self.since is not None
        self.elapsed += self.timer() - self.since
        self.since = None

    def __call__(self) -> float:
        return self.elapsed + (self.timer() - self.since if self.since is not None else 0.0)


def lockstep(
    runs: Mapping[str, Run[T]],
    *,
    baseline: str,
    repeats: int,
    turn_s: float = 0.05,
    warmup: int = 1,
    offset: int = 0,
    timer: Callable[[], float] = time.perf_counter,
    decide: Callable[[bool], bool] = bool,
) -> Timing[T]:
    """:func:`interleave`, with the runs of a pass timed *at once*, by turns.

    A pass starts every run's :attr:`Run.steps` generator, then gives each, in
    turn (rotated by pass, as :func:`interleave` rotates), the steps that fit in
    ``turn_s`` (at least one). A run's time in the pass is the sum of its turns.
    So every run of a pass samples the same seconds of the machine: a slow
    spell lands on all of them, not on whichever ran while it lasted. (On a
    2-core VM whose speed drifts ±5-10% over seconds, two identical runners
    timed pass after pass gave per-pass ratios spread ±8%.) Runs without
    ``steps`` (another library's ``generate``) are timed whole, one after
    another, before the turns begin: turns of ours right after a turn of
    transformers ran about 25% slower, for as long as they alternated.

    After the first pass each run's turn is ``turn_s`` × its last time ÷ the
    baseline's, so that all finish together and none runs its tail alone.
    Caches: each turn starts on what the previous run's turn left in them, the
    same for every run (a step's own models still evict one another as in any
    run). ``ttft_s`` / ``decode_s`` of the requests count only their run's own
    turns (:class:`TurnClock`). ``timer``: the clock of the turns and the times
    (tests give their own). ``decide``: whether a turn ends after a step, given
    this process's answer (tensor-parallel ranks take their first rank's:
    :meth:`specdec.dist.group.DistContext.decide`).

    Example, ``turn_s`` = 50 ms, plain decoding (the baseline) at 3 ms and one
    token a step against speculation at 4.5 ms and 3 tokens a step, twice as
    fast: in pass 1 both get 50 ms turns (about 17 plain steps, 11 speculative
    ones), so speculation is done halfway and plain runs its second half
    alone; from pass 2 speculation gets 25 ms turns (its last time was half
    the baseline's) and the two finish together.
    """
    rs = dict(runs)
    if baseline not in rs or rs[baseline].passes is not None:
        raise ValueError(f"the baseline {baseline!r} must be one of the runs and time every pass")
    if turn_s <= 0:
        raise ValueError(f"turn_s must be > 0, got {turn_s}")
    warm_up(rs, warmup)
    names = list(rs)
    timing: Timing[T] = Timing(baseline, {k: [] for k in rs}, {k: [] for k in rs}, {k: [] for k in rs})
    share = dict.fromkeys(names, 1.0)  # each run's turn ÷ turn_s
    for p in range(repeats):
        first = (offset + p) % len(names)
        order = [k for k in names[first:] + names[:first] if rs[k].passes is None or p < rs[k].passes]
        clocks = {k: TurnClock(timer) for k in order}
        for k in order:
            if rs[k].before is not None:
                rs[k].before()  # type: ignore[misc]
        this_pass: dict[str, float] = {}
        for k in order:
            if rs[k].steps is None:
                this_pass[k], out = timed(rs[k].fn, timer)
                timing.outputs[k].append(out)
        gc.collect()
        gc.freeze()
        live = {k: steps(clocks[k]) for k in order if (steps := rs[k].steps) is not None}
        while live:
            for k in [k for k in order if k in live]:
                clock = clocks[k]
                end = clock.start() + turn_s * share[k]
                try:
                    while True:
                        next(live[k])
                        if decide(timer() >= end):
                            break
                except StopIteration as done:
                    timing.outputs[k].append(done.value)
                    del live[k]
                finally:
                    clock.stop()
        this_pass |= {k: clocks[k].elapsed for k in order if rs[k].steps is not None}
        for k, t in this_pass.items():
            timing.times[k].append(t)
            timing.ratios[k].append(this_pass[baseline] / t)
            share[k] = min(max(t / this_pass[baseline], 0.25), 4.0)
    return timing


# --------------------------------------------------------------------------------------
# greedy equality
# --------------------------------------------------------------------------------------
def first_mismatch(out: Sequence[int], ref: Sequence[int]) -> int | None:
    """Index of the first token where ``out`` differs from ``ref``; None when equal.

    A prefix of the other mismatches where the shorter one ends.
    """
    i = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
    if i is None and len(out) != len(ref):
        return min(len(out), len(ref))
    return i


def outputs_equal(outs: Sequence[Sequence[int]], refs: Sequence[Sequence[int]]) -> bool:
    """Every output equal to its reference (greedy speculation must reproduce plain decoding)."""
    return len(outs) == len(refs) and all(first_mismatch(o, r) is None for o, r in zip(outs, refs))


def judge_outputs(outs: Sequence[Sequence[int]], refs: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]],
                  target: DecoderPipelineModel, mode: str = "auto",
                  tie_margin: float | None = None) -> dict[str, Any]:
    """:func:`outputs_equal` under an exactness policy (:mod:`specdec.spec.exactness`; ``mode``
    auto: strict on CPU, tolerant on a GPU): ``{"equal", "near_ties", "first_mismatch"}``.
    ``equal``: no output differs beyond a near tie; ``near_ties``: outputs that differ only at a
    near tie of ``target``'s logits (one forward over prompt and reference prefix for each
    differing output); ``first_mismatch``: the first one's ``{index, position, margin, bound}``."""
    from specdec.spec.exactness import NEAR_TIE, ExactnessPolicy, difference, target_eps, target_logits

    if len(outs) != len(refs):
        return {"equal": False, "near_ties": 0, "first_mismatch": None}
    policy = ExactnessPolicy.resolve(mode, target.runtime.device, tie_margin)
    eps = target_eps(target)
    verdicts = [policy.judge(difference(o, r, lambda i, p=p, r=r: target_logits(target, [*p, *r[:i]]), eps))
                for o, r, p in zip(outs, refs, prompts)]
    wrong = [(k, v) for k, v in enumerate(verdicts) if v is not None and v["class"] != NEAR_TIE]
    return {"equal": not wrong, "near_ties": sum(1 for v in verdicts if v is not None and v["class"] == NEAR_TIE),
            "first_mismatch": {"index": wrong[0][0], **{k: wrong[0][1][k] for k in ("position", "margin", "bound")}}
            if wrong else None}


# --------------------------------------------------------------------------------------
# bare forward times, the analytic limit, efficiency
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForwardTimes:
    """Bare forward times of one speculative method (seconds, medians; each forward feeds
    the run's batch of requests at once: :func:`limit_timers`), and the shape of its step
    at full γ: what :meth:`step_s` charges (specdec.spec.cost).
    A field left None was not measured: what needs it is reported missing (None)."""

    t_target_1: float | None  # the target's forward of one token (a plain decode step)
    t_target_g1: float | None  # the target's forward of max_rows tokens (a full verification)
    t_draft_1: float | None = 0.0  # one drafter forward as the step runs it (0: model-free); see step_shape
    max_rows: int | None = None  # tokens per request of t_target_g1: the method's γ + 1
    draft_forwards: float | None = None  # drafter forwards (t_draft_1 each) of a step at full γ
    max_drafts: int | None = None  # drafts per request of a step at full γ
    # The same verification step timed right after the drafter drafted, and T_draft(1)
    # timed with the target's verification forward right before the drafting, as a
    # speculative step runs them (None: not measured). Each model's reads evict some of
    # the other's weights from the CPU's caches, a cost of the machine, not of the framework.
    t_target_g1_after_draft: float | None = None
    t_draft_1_after_target: float | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ForwardTimes:
        """From a saved ``asdict`` (``forward_times.json``); keys of other versions are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def step_s(self, drafts: float, *, after_other: bool = False) -> float | None:
        """Bare seconds of a step whose requests verify ``drafts`` drafts each (mean over
        steps): the target over ``1 + drafts`` rows, the drafter's forwards in the share
        ``drafts / max_drafts`` of a full step's (:func:`specdec.spec.cost.step_cost`).
        ``after_other``: with each model's forward timed right after the other's. None
        where a figure it needs is missing."""
        parts = self._step(drafts, after_other)
        return None if parts is None else step_cost(*parts[:2], draft_forwards=parts[2], t_draft=parts[3])

    def _step(self, drafts: float, after_other: bool = False
              ) -> tuple[float, Callable[[float], float], float, float] | None:
        """:func:`~specdec.spec.cost.step_cost`'s arguments for :meth:`step_s`."""
        if None in (self.t_target_1, self.t_target_g1, self.t_draft_1, self.max_rows, self.draft_forwards,
                    self.max_drafts):
            return None
        tg, td = self.t_target_g1, self.t_draft_1
        if after_other:
            if self.t_target_g1_after_draft is None or (td and self.t_draft_1_after_target is None):
                return None
            tg, td = self.t_target_g1_after_draft, self.t_draft_1_after_target or 0.0
        share = min(drafts / self.max_drafts, 1.0) if self.max_drafts else 0.0
        return 1 + drafts, target_line(self.t_target_1, tg, self.max_rows), share * self.draft_forwards, td


def spec_limit(bare: ForwardTimes | None, counts: SpecCounts, outs: Sequence[Any],
               plain_passes: Sequence[Sequence[Any]], *, after_other: bool = False) -> float | None:
    """The analytic limit τ_decode · S_plain / C_spec (:mod:`specdec.spec.metrics`), the one
    place every tool (the run summary, spec.py, compare_hf.py) computes it:

    - τ_decode: ``outs`` (the method's requests: ``GenerationOutput`` or a run record's
      entries) give the decode tokens and the first steps (one per request, per turn of a
      conversation), ``counts`` (theirs, merged) the steps (:func:`decode_tau`);
    - S_plain: :func:`plain_step_s` of each of ``plain_passes`` (plain decoding's timed
      passes, the baseline of the decode speedup), the median over passes;
    - C_spec: ``bare.step_s`` at the run's mean drafts per step.

    None where a figure is missing (no bare times, a request without decode timing, a
    plain pass without it), never replaced by another."""
    if bare is None or not counts.steps or not outs or not plain_passes:
        return None
    if any(_field(x, "decode_s") is None for x in outs):
        return None
    plain = [plain_step_s(p) for p in plain_passes]
    if None in plain:
        return None
    first_steps = sum(len(_field(x, "turns") or [0]) for x in outs)
    tau = decode_tau(sum(_field(x, "decode_tokens") for x in outs), counts.steps, first_steps)
    return analytic_limit(tau=tau, plain_step_s=statistics.median(plain),  # type: ignore[type-var]
                          spec_step_s=bare.step_s(counts.tree_size, after_other=after_other))


def _field(x: Any, key: str) -> Any:
    """``x.key`` of a ``GenerationOutput``, ``x[key]`` of a run record's entry (None: absent)."""
    return x.get(key) if isinstance(x, Mapping) else getattr(x, key, None)


def plain_step_s(outs: Sequence[Any]) -> float | None:
    """Plain decoding's decode-phase seconds per step of one pass (each request gains one
    token a step): its decode seconds ÷ decode tokens (``GenerationOutput`` or a run
    record's entries). None without decode timing."""
    tokens = sum(_field(x, "decode_tokens") or 0 for x in outs)
    secs = [_field(x, "decode_s") for x in outs]
    return sum(secs) / tokens if tokens and None not in secs else None  # type: ignore[arg-type]


def pass_limit(timing: Timing[Any], name: str, bare: ForwardTimes | None, counts: SpecCounts, *,
               after_other: bool = False) -> float | None:
    """:func:`spec_limit` of run ``name`` of a benchmark's timing: its last timed pass's
    outputs and ``counts`` (the pipeline's stats, reset before each pass), against every
    pass of the baseline (plain decoding)."""
    return spec_limit(bare, counts, timing.last(name), timing.outputs[timing.baseline], after_other=after_other)


def limit_context(prompt_lens: Sequence[int], new_tokens: int) -> int:
    """The context length the limit's bare forwards are timed at: the mean context of a
    decode step, the prompts' mean length plus half the new tokens (every tool)."""
    return int(sum(prompt_lens) / max(len(prompt_lens), 1)) + new_tokens // 2


def step_breakdown(stats: RunStats, wall_s: float, bare: ForwardTimes | None) -> dict[str, Any]:
    """Milliseconds per speculative step, phase by phase, beside the step's bare cost.

    ``stats``: the pipeline's figures of one timed pass (reset before it), ``wall_s``
    that pass's wall time. ``phases[p] = [in-loop ms, bare ms]`` per step. Bare: what
    :meth:`ForwardTimes.step_s` charges (the analytic limit's C_spec) at the pass's mean
    drafts per step: the target's forward, the drafter's forwards (the first of them
    charged to ``draft_catch_up`` when the drafter has one); nothing for host work
    (packing, verification, sync, commit). ``outside``: the wall time per step outside
    every phase (the engine's scheduling and stop checks, the API); ``accounted`` = the
    phases' share of the wall time; ``step_ms`` / ``bare_step_ms``: the whole step in the
    loop and bare (None where a bare figure is missing).
    """
    n = max(stats.spec_steps, 1)
    ms = {p: stats.phase_s.get(p, 0.0) * 1e3 / n for p in PHASES}
    bare_ms = dict.fromkeys(PHASES, 0.0)
    parts = bare._step(stats.counts.tree_size) if bare is not None else None
    full = None
    if parts is not None:
        rows, t_target, forwards, td = parts
        full = step_cost(rows, t_target, draft_forwards=forwards, t_draft=td)
        draft_ms = forwards * td * 1e3
        catch = min(td * 1e3, draft_ms) if ms["draft_catch_up"] > 0 else 0.0
        bare_ms.update(target_forward=t_target(rows) * 1e3, draft_catch_up=catch, draft_steps=draft_ms - catch)
    total = sum(ms.values())
    wall = wall_s * 1e3 / n
    out = {"steps": stats.spec_steps, "step_ms": wall, "bare_step_ms": full * 1e3 if full is not None else None,
           "phases": {p: [round(ms[p], 4), round(bare_ms[p], 4)] for p in PHASES},
           "outside_ms": wall - total, "accounted": total / wall if wall > 0 else 0.0}
    if bare is not None and bare.t_target_g1_after_draft is not None:
        out["target_forward_after_draft_ms"] = round(bare.t_target_g1_after_draft * 1e3, 4)
    if bare is not None and bare.t_draft_1_after_target and bare.draft_forwards:  # a full step's drafting
        out["drafting_after_target_ms"] = round(bare.draft_forwards * bare.t_draft_1_after_target * 1e3, 4)
    return out


def breakdown_row(name: str, b: Mapping[str, Any]) -> dict[str, Any]:
    """One table row of a :func:`step_breakdown`: ms per step, in loop (bare where the step's cost charges it)."""
    ph = b["phases"]

    def cell(*ps: str) -> str:
        got, bare = sum(ph[p][0] for p in ps), sum(ph[p][1] for p in ps)
        return f"{got:.2f}" + (f" ({bare:.2f})" if bare else "")

    bare_step = f" ({b['bare_step_ms']:.2f})" if b["bare_step_ms"] is not None else ""
    return {"run": name, "step_ms": f"{b['step_ms']:.2f}{bare_step}",
            "draft_prep": cell("draft_prepare"), "target_prep": cell("target_prepare"),
            "catch_up": cell("draft_catch_up"), "draft_steps": cell("draft_steps"),
            "target_fwd": cell("target_forward"),
            "after_draft": f"{b['target_forward_after_draft_ms']:.2f}" if "target_forward_after_draft_ms" in b else "",
            "drafting_after_target": (f"{b['drafting_after_target_ms']:.2f}" if "drafting_after_target_ms" in b
                                      else ""),
            "verify": cell("verify"),
            "sync+commit": cell("sync", "commit"), "prefill": cell("prefill"),
            "outside": f"{b['outside_ms']:.2f}", "accounted": f"{b['accounted']:.3f}"}


def efficiency(speedup: float | None, limit: float | None) -> float | None:
    """speedup ÷ analytic limit (None when either is missing or the limit is 0)."""
    return speedup / limit if speedup is not None and limit else None


def _bare_time(timer: Timer, ctx_len: int, repeats: int) -> float | None:
    """Seconds of one bare forward of ``timer`` (:func:`limit_timers`') at ``ctx_len``."""
    try:
        return timer(ctx_len, repeats)
    except OutOfBlocks as e:
        raise OutOfBlocks(f"a bare forward at context {ctx_len} does not fit in the KV cache ({e}); "
                          "raise runtime.num_blocks") from None


Timer = Callable[[int, int], float]  # (context length, timed calls) -> seconds of one call


def limit_timers(methods: Mapping[str, LLM], *, requests: int = 1, after_other: bool | Collection[str] = False
                 ) -> dict[tuple[str, str], Timer]:
    """The bare forwards of each method's analytic limit, keyed ``(method, what)``, each
    timing ``requests`` throwaway requests at once (the run's batch: a step of B requests
    is charged a forward of B, as plain decoding's S_plain is a step of B): ``"t1"`` (the
    target's T(1)), ``"tg"`` (its T(γ+1); γ: ``num_speculative_tokens``, the most it
    drafts, a tree's node budget), ``"td"`` (the drafter's T_draft(1), its catch-up and
    drafting forwards as :meth:`~specdec.spec.proposers.Proposer.draft_forward_time`
    times them, where it has any). With ``after_other`` (True: every method with a
    drafter; or those named) also ``"tg_after"``, T(γ+1) with the drafter's bare drafting
    run once (its timer's one call, no warm-up) before each timed forward, and
    ``"td_after"``, T_draft(1) with one bare verification forward before each timed
    drafting (:class:`ForwardTimes`' ``t_target_g1_after_draft`` /
    ``t_draft_1_after_target``)."""
    if requests < 1:
        raise ValueError(f"limit_timers: requests must be >= 1 (the run's batch size), got {requests}")
    runs: dict[tuple[str, str], Timer] = {}

    def target(pm: DecoderPipelineModel, n: int) -> Timer:  # forward_time looked up per call (tests spy on it)
        return lambda ctx, reps, **k: forward_time(pm, n, ctx, repeats=reps, requests=requests, **k)

    for name, llm in methods.items():
        pipe = llm.pipeline
        g1 = int(llm.method.num_speculative_tokens) + 1
        runs[name, "t1"] = target(pipe.target, 1)
        runs[name, "tg"] = tg = target(pipe.target, g1)
        draft = _draft_timer(name, pipe.proposer.draft_forward_time, requests)
        if pipe.proposer.has_draft_cost() and draft is not None:  # None: "td" missing, so is the limit
            runs[name, "td"] = draft
            if after_other is True or (after_other and name in after_other):
                runs[name, "tg_after"] = (lambda ctx, reps, tg=tg, draft=draft:
                                          tg(ctx, reps, between=lambda: draft(ctx, 1, warmup=0)))
                runs[name, "td_after"] = (lambda ctx, reps, tg=tg, draft=draft:
                                          draft(ctx, reps, between=lambda: tg(ctx, 1, warmup=0)))
    return runs


def _draft_timer(name: str, timer: Callable[..., float], requests: int) -> Callable[..., float] | None:
    """A drafter's ``draft_forward_time`` for ``requests`` requests at once. At one request
    it is called as before (a drafter of another package need not know ``requests``); at
    more, one that cannot take them gives None, with a warning naming the method: timed
    for one request, its drafting would be charged a batch's step at a single request's
    cost, so its limit is left missing and the run's own results stand."""
    if requests == 1:
        return timer
    params = inspect.signature(timer).parameters.values()
    if not any(p.name == "requests" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        warnings.warn(f"method {name!r}: its drafter's draft_forward_time takes no `requests`, so its drafting "
                      f"cannot be timed for a batch of {requests}; its analytic limit is left missing", stacklevel=2)
        return None
    return functools.partial(timer, requests=requests)


def step_shape(llm: LLM) -> tuple[int, float, int]:
    """What a step of ``llm``'s method runs at its full γ: ``(max_rows, draft_forwards,
    max_drafts)`` of :class:`ForwardTimes`, from the drafter's spec (``DrafterSpec.drafts``,
    ``draft_forwards``; per request: at batch B each forward is timed for B requests at once,
    :func:`limit_timers`). Draft forwards are charged ``T_draft(1)`` each, as the proposer's
    ``draft_forward_time`` measures it: a chain's γ drafts (a compiled chain: its one call
    ÷ γ); a dynamic tree's ``depth`` levels; Medusa's drafts (its one pass of the heads ÷
    its drafts per step, min(γ, heads) for a chain)."""
    g = int(llm.method.num_speculative_tokens)
    spec = llm.pipeline.proposer.spec
    return g + 1, float(spec.draft_forwards(g)), spec.drafts(g)


def _forward_times(methods: Mapping[str, LLM], t: Mapping[tuple[str, str], float | None]) -> dict[str, ForwardTimes]:
    out = {}
    for n, llm in methods.items():
        rows, forwards, drafts = step_shape(llm)
        td = t.get((n, "td")) if llm.pipeline.proposer.has_draft_cost() else 0.0  # None: not timed
        out[n] = ForwardTimes(t.get((n, "t1")), t.get((n, "tg")), td,  # type: ignore[arg-type]
                              rows, forwards, drafts, t.get((n, "tg_after")), t.get((n, "td_after")))
    return out


LIMIT_RUN = "bare "  # the name prefix of limit_runs' contestants


def limit_runs(methods: Mapping[str, LLM], ctx_len: int, *, requests: int = 1, chunks: int = 12, repeats: int = 3,
               after_other: bool | Collection[str] = False) -> dict[str, Run[list[float]]]:
    """The bare forwards of :func:`limit_timers` (each of ``requests`` requests at once: the
    run's batch size) as contestants of :func:`lockstep`, timed in the same passes as the
    runs they are a limit for (:func:`limit_from`).

    Timed at one moment, before or after the passes, the limit's bare forwards catch
    that moment's speed whole, while the passes' ratios, timed by turns, do not move
    with the machine's spells: on a 2-core EPYC VM ``efficiency_batch1`` read 0.915,
    1.105 and 0.776 in three runs of one code, the bare one-token target forward
    0.94-1.33 ms. By turns, each pass times ``chunks`` rounds of every bare forward
    (``repeats`` calls each, after the timer's own untimed warm-up: back to back, as
    the limit defines them) among the passes' own turns, and the limit takes the
    median over every pass. A contestant's pass time and ratio mean nothing here;
    its result is the list of its rounds' times."""
    def run(timer: Timer) -> Run[list[float]]:
        def once(reps: int = repeats) -> float:
            return _bare_time(timer, ctx_len, reps)

        def steps(clock: Callable[[], float]) -> Generator[None, None, list[float]]:
            out = []
            for _ in range(chunks):
                out.append(once())
                yield
            return out

        return Run(lambda: [once() for _ in range(chunks)], warmup=lambda: once(1), steps=steps)

    return {f"{LIMIT_RUN}{name}: {what}": run(timer)
            for (name, what), timer in limit_timers(methods, requests=requests, after_other=after_other).items()}


def with_room_for_bare(rt: RuntimeConfig, extra_tokens: int = 64, requests: int | None = None) -> RuntimeConfig:
    """``rt`` with KV blocks for ``requests`` full sequences more than its batch (default
    ``max_batch_size``; ``extra_tokens`` past ``max_seq_len`` each, for a drafter's rows):
    :func:`limit_runs`' bare forwards hold a batch of throwaway requests beside a pass's
    own. (At batch 1: room for one more.)"""
    more = rt.max_batch_size if requests is None else requests
    return dataclasses.replace(rt, num_blocks=dataclasses.replace(rt, max_batch_size=rt.max_batch_size + more)
                               .blocks(extra_tokens))


def limit_from(rounds: Timing[Any] | Mapping[str, Sequence[Sequence[float]]],
               methods: Mapping[str, LLM]) -> dict[str, ForwardTimes]:
    """Each method's :class:`ForwardTimes` from the :func:`limit_runs` contestants of one
    :func:`lockstep` timing, or of several (the run's batches: their ``outputs`` gathered,
    key -> every pass's rounds): per bare forward, the median over every round of every
    pass. A forward with no round timed is missing (None), and so is what needs it."""
    outputs = rounds.outputs if isinstance(rounds, Timing) else rounds
    t: dict[tuple[str, str], float | None] = {}
    for key, outs in outputs.items():
        if key.startswith(LIMIT_RUN):
            name, what = key[len(LIMIT_RUN):].rsplit(": ", 1)
            xs = [x for out in outs for x in out]
            t[name, what] = statistics.median(xs) if xs else None
    return _forward_times(methods, t)


# --------------------------------------------------------------------------------------
# benchmark scaffolding
# --------------------------------------------------------------------------------------
def load_config(cls: type[C], argv: Sequence[str]) -> C:
    """``key=value`` overrides (Hydra syntax: ``quick=true``, ``gammas=[1,2]``) into dataclass ``cls``.

    Composed by Hydra from ``cls`` in its ConfigStore, as the experiment's
    config is: types are checked, and an unknown key or a bad value exits
    naming it.
    """
    from hydra import compose, initialize
    from hydra.core.config_store import ConfigStore
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    name = f"{cls.__module__}.{cls.__qualname__}"
    keys = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    ConfigStore.instance().store(name=name, node=cls)
    try:
        with initialize(version_base=None):
            cfg = compose(config_name=name, overrides=list(argv))
    except ConfigCompositionException as e:
        what, why = str(e).splitlines()[0], str(e.__cause__ or "").splitlines()[:1]
        raise SystemExit(" ".join([what, *why]) + f"\nkeys: {', '.join(keys)}") from None
    added = [k for k in cfg if k not in keys]  # `+key=value` appends past the schema
    if added:
        raise SystemExit(f"unknown key(s) {', '.join(map(repr, added))}\nkeys: {', '.join(keys)}")
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, cls)
    return obj


def machine() -> dict[str, Any]:
    """What a figure was measured on: CPU model (and its family / model numbers: a VM's "AMD
    EPYC" names Zen 1 and Zen 4 alike), cores, torch threads, torch build, BLAS (torch's:
    attention's matmuls, and projections under ``runtime.cpu_linear=aten``), whether oneDNN
    and specdec's own CPU kernels are there (the projections' kernels on CPU), GPU."""
    cpu, cpu_id = platform.processor() or platform.machine(), ""
    try:
        info = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())  # the first processor's
        cpu = info.get("model name", cpu)
        cpu_id = f"family {info['cpu family']} model {info['model']}" if "cpu family" in info else ""
    except OSError:
        pass
    blas = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    return {
        "cpu": cpu,
        "cpu_id": cpu_id,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "blas": blas.group(1) if blas else ("mkl" if torch.backends.mkl.is_available() else "unknown"),
        "onednn": torch.backends.mkldnn.is_available(),
        "specdec_kernels": cpu_kernels_available(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def print_table(rows: Sequence[Mapping[str, Any]], title: str = "") -> None:
    """Rows (dicts with the same keys) as an aligned table; floats with 3 decimals."""
    from specdec.logging import format_table

    if title:
        print(f"\n{title}")
    if rows:
        cols = [(c, c, ".3f" if any(isinstance(r.get(c), float) for r in rows) else "") for c in rows[0]]
        print(format_table(rows, cols), flush=True)


def emit_json(figures: Mapping[str, Any]) -> None:
    """The last line of every benchmark: its headline figures and the :func:`machine`."""
    print(json.dumps({**figures, "machine": machine()}, sort_keys=True), flush=True)


def builtin_pair() -> tuple[Path, Path] | None:
    """The shipped (target, draft) checkpoints, or None when they are absent."""
    t, d = ZOO_DIR / "code-target", ZOO_DIR / "code-draft"
    return (t, d) if (t / "model.safetensors").is_file() and (d / "model.safetensors").is_file() else None


def builtin_prompts(tokenizer_dir: Path, n: int) -> list[list[int]] | None:
    """The first ``n`` shipped held-out prompts as token ids, or None when absent."""
    from specdec.core.checkpoint import load_tokenizer

    f = ZOO_DIR / "prompts.jsonl"
    if not f.is_file():
        return None
    tok = load_tokenizer(tokenizer_dir)
    rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return [tok.encode(r["prompt"]).ids for r in rows[:n]]


def checkpoint(option: str, builtin: Path | None, **random: Any) -> Path:
    """A benchmark's checkpoint option: ``"builtin"`` (``builtin`` when shipped, else
    random), ``"random"`` (:func:`random_checkpoint` with ``random``) or a directory."""
    if option not in ("builtin", "random"):
        return Path(option)
    return builtin if option == "builtin" and builtin is not None else random_checkpoint(**random)


def scratch_dir(prefix: str) -> Path:
    """A new temporary dir, removed when the process exits (random checkpoints for a bench run)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def random_head(target: Path, kind: str, seed: int = 0) -> Path:
    """A random EAGLE head (``kind`` eagle / eagle3) for ``target``, saved in its published layout."""
    from specdec.core.checkpoint import read_hf_config
    from specdec.models.config import LlamaConfig
    from specdec.models.eagle import EagleHeadConfig, new_head, save_head

    tcfg = LlamaConfig.from_dict(read_hf_config(target))
    head = new_head(EagleHeadConfig.from_target(kind, tcfg), seed)
    return save_head(head, scratch_dir(f"specdec-{kind}-"),
                     num_target_layers=tcfg.num_hidden_layers)[0].parent


def random_checkpoint(*, layers: int, hidden: int = 256, vocab: int = 4096, seed: int = 0,
                      heads: int = 8, kv_heads: int = 4, out: Path | None = None) -> Path:
    """Saves a random Llama checkpoint in HF format (with transformers) and returns its dir
    (``out``, or a :func:`scratch_dir`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        tie_word_embeddings=True, initializer_range=0.3,
    )
    out = out or scratch_dir("specdec-bench-")
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def hf_model(path: Path, device: str = "cpu") -> Any:
    """transformers' own model of checkpoint ``path`` (float32, eval), the peer we compare with."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
