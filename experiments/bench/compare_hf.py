"""Us against Hugging Face transformers on the same checkpoints, greedy.

    python experiments/bench/compare_hf.py quick=true
    python experiments/bench/compare_hf.py pairs=[builtin,random] batch_sizes=[1,4,16,64]

Batch 1, side by side in one run (passes of ours timed at once, by turns of
``turn_ms``; transformers' whole, before them; rotated; medians):
transformers ``generate`` plain, assisted generation (``assistant_model``;
its default schedule and a fixed γ), prompt lookup
(``prompt_lookup_num_tokens``), and ours (plain, draft model, n-gram). Every
output is checked equal to plain greedy decoding. Then a batch sweep: our
speculation against our plain decoding (transformers' assisted generation
runs at batch 1 only, so its plain batched ``generate`` is the reference
there).

Ours runs with ``runtime.compile`` (``compile=true``, the default) and, at
batch 1, eager beside it: the headline figures are the compiled ones, and
``compile_gain_*`` (per-pass eager over compiled time, paired; ``compile_graphs``
counts the graphs compiled, 0 when compiling changed no code; ``compile_gain_aa``,
a second eager plain runner over the first, is the noise of such a ratio) /
``*_eager`` give the eager side. ``quick=true`` stays
about a minute: 4 prompts x 64 tokens, three passes of ours and one of HF's, no
eager batch-1 rows, and an eager sweep (``sweep_compile``) of three passes per
point (two at batch 64) without HF's batched reference.

Speedups over our plain decoding are medians of per-pass ratios. The
sweep's ``aa_vs_plain`` times our plain decoding against itself (an A/A
control, ``sweep_aa``): its distance from 1 is the machine's noise at that
point, which a ``*_vs_plain`` figure must clear to say anything (on a 2-core
AMD EPYC VM, with whole passes one after another (``turn_ms=0``), two
identical runs' per-pass ratios spread ±7-10% and the sweep's A/A read
0.92-1.07; timed by turns, 0.99-1.02). Efficiency is the decode-phase
speedup / analytic limit (both defined in :mod:`specdec.spec.metrics`: the
limit = τ · plain decoding's measured decode step / the speculative step's bare
cost), the bare forward times of the draft-model run's own models timed by
turns in the same passes (:func:`specdec.measure.limit_runs`): ``efficiency_batch1``
(≤ 1 up to noise: every speculative step costs at least its bare forwards) and
``analytic_limit_batch1``. ``efficiency_batch1_e2e`` divides the end-to-end speedup
(whole requests, prefill included) by the same limit, and
``efficiency_batch1_e2e_cap`` is what a speculative step with no host work would
score on it (the prefill takes the same time with and without speculation). A
figure that was not measured is null.

A second batch-1 table splits each of our speculative runs' steps into phases
(:func:`specdec.measure.step_breakdown`), the draft model's beside the bare
costs its analytic limit charges; ``accounted_min`` is the smallest share of a
pass's wall time the phases account for. Its ``after_draft`` column is the bare
verification forward timed right after the drafter drafted (no framework code
between): on a CPU the drafter's reads evict some of the target's weights from
the caches, so the loop's target forward costs more than the bare, back-to-back
one although nothing of ours runs in it. ``drafting_after_target`` is the same
the other way round: a step's bare drafting, timed right after a bare
verification forward. ``efficiency_batch1_after_other`` divides by the limit
with both in it (``draft_forward_ms`` and ``target_forward_ms`` in the JSON).

Writes a table, ``compare_hf.json`` and ``compare_hf.png`` (into ``out=``,
default ``outputs/bench``), and ends with one JSON line: ``draft_vs_hf_assisted``,
``ngram_vs_hf_prompt_lookup``, ``efficiency_batch1``, ``min_spec_vs_plain``,
``outputs_equal`` (and the end-to-end efficiency, the compile figures and the
``machine``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig, GenerationOutput
from specdec.measure import (
    Run,
    Timing,
    breakdown_row,
    builtin_pair,
    builtin_prompts,
    decode_rate,
    efficiency,
    emit_json,
    hf_model,
    interleave,
    limit_context,
    limit_from,
    limit_runs,
    lockstep,
    load_config,
    judge_outputs,
    pass_limit,
    plain_step_s,
    print_table,
    random_checkpoint,
    step_breakdown,
    with_room_for_bare,
)
from specdec.spec.proposers import ProposerConfig, config_class

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class CompareConfig:
    quick: bool = False
    pairs: list[str] = field(default_factory=lambda: ["builtin", "random"])
    gamma: int = 4  # our γ and HF's fixed assisted γ / prompt-lookup tokens
    ngram_gamma: int = 4
    num_prompts: int = 8
    new_tokens: int = 64
    repeats: int = 3
    hf_repeats: int | None = None  # timed passes of the HF runners (None: repeats)
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    sweep_new_tokens: int = 32
    sweep_min_requests: int = 32  # per point, so small batches time more than one short request
    sweep_compile: bool | None = None  # None: as `compile` (quick: false, compiling its batch shapes takes ~25 s)
    # Timed passes per sweep point. The headline is the *lowest* of 8 ratios,
    # so each must be steady: a 2-3% wobble per ratio would pull it down. (16 requests x 5
    # passes gave per-point ratios that moved by 5% between runs. 32 x 7 passes still left a
    # pass's ratio 2.5% from its mean (A/A, batch 16: 0.969-1.023), so a point's median within
    # about 1.2% and the least of 8 such about 1.7% below the truth: 32 x 11 now, about 1.3%.)
    sweep_repeats: int = 11
    # If set, a point whose passes already time this many tokens in fewer
    # passes runs only those (at least 2): quick spends its time on the small,
    # noisy points, not on batch 64.
    sweep_pass_tokens: int = 0
    sweep_hf: bool = True  # time transformers' batched plain generate beside (a reference column only)
    # An A/A control: our plain decoding again, a contestant of its own (a second runner). Its
    # ratio to plain is 1 but for the machine's noise, so it shows how far from 1 a
    # *_vs_plain figure must be to mean anything (aa_vs_plain_min / _max in the JSON).
    sweep_aa: bool = True
    # Side by side: the contestants of a pass run at once, by turns of about this many ms
    # (specdec.measure.lockstep); 0: each pass whole, one contestant after another (interleave).
    turn_ms: float = 50.0
    out: str = "outputs/bench"
    threads: int = 2
    compile: bool = True  # ours with runtime.compile (its eager runs are measured alongside at batch 1)
    batch1_eager: bool = True  # with compile: time ours eager too at batch 1 (the compile_gain_* figures)
    device: str = "cpu"  # cuda: see gpu.sh (transformers runs there too)
    # Ours' CPU projections (RuntimeConfig.cpu_linear): "onednn" or "aten" leave the native
    # forward (it needs our kernel), so there compile=true compiles the decoders.
    cpu_linear: str = "specdec"


def load_pair(name: str) -> tuple[str, Path, Path, list[list[int]]]:
    """(label, target, draft, 64 prompts): the shipped pair when asked for and present, else random ones."""
    pair = builtin_pair()
    if name == "builtin" and pair is not None:
        t, d = pair
        return "builtin", t, d, builtin_prompts(t, 64) or []
    t = random_checkpoint(layers=6, seed=0)
    d = random_checkpoint(layers=1, seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4000, (24,), generator=g).tolist() * 3 for _ in range(64)]
    return "random", t, d, prompts


def methods(cfg: CompareConfig, draft: Path, *, adaptive: bool = False) -> dict[str, ProposerConfig | None]:
    """Ours: plain (None) and the two proposers, by name."""
    return {
        "plain": None,
        "draft_model": config_class("draft_model")(path=str(draft), num_speculative_tokens=cfg.gamma,
                                                   adaptive_gamma=adaptive),
        "ngram": config_class("ngram")(num_speculative_tokens=cfg.ngram_gamma, adaptive_gamma=adaptive),
    }


def hf_generate(model: Any, prompt: list[int], new_tokens: int, **kw: Any) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


AA_BATCH1 = "ours plain again"  # batch 1's A/A runner (eager plain, as "ours plain")


def _ours(method: str, compiled: bool) -> str:
    return f"ours {method}" + (" (compiled)" if compiled else "")


def _token_ids(out: list[Any]) -> list[list[int]]:
    return [o.token_ids if isinstance(o, GenerationOutput) else o for o in out]


def _first_steps(outs: list[GenerationOutput]) -> float:
    """Seconds of the requests' first steps in one batch-1 pass (all queued at once):
    request i's first step runs from the end of request i-1 (its ttft + decode_s) to its own first tokens."""
    ends = [0.0] + [x.ttft_s + x.decode_s for x in outs[:-1]]
    return sum(x.ttft_s - e for x, e in zip(outs, ends))


def batch1(cfg: CompareConfig, name: str, target: Path, draft: Path, prompts: list[list[int]]) -> dict[str, Any]:
    prompts = prompts[: cfg.num_prompts]
    hf_t, hf_d, hf_d_fixed = (hf_model(p, cfg.device) for p in (target, draft, draft))
    hf_d_fixed.generation_config.num_assistant_tokens_schedule = "constant"
    hf_d_fixed.generation_config.num_assistant_tokens = cfg.gamma
    max_len = max(len(p) for p in prompts) + cfg.new_tokens + 16
    ec = EngineConfig(max_batch_size=1)
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    ours: dict[str, LLM] = {}
    for compiled in ([False, True] if cfg.compile and cfg.batch1_eager else [cfg.compile]):
        rt = with_room_for_bare(RuntimeConfig(max_batch_size=1, max_seq_len=max_len, compile=compiled,
                                              device=cfg.device, threads=cfg.threads, cpu_linear=cfg.cpu_linear))
        for m, mc in methods(cfg, draft).items():
            ours[_ours(m, compiled)] = LLM(target, method=mc, runtime=rt, engine_config=ec)
        if not compiled and cfg.compile and cfg.sweep_aa:
            # A/A for the compile gains: a second eager plain runner (its own weights and
            # cache), so one paired per-pass ratio's noise sits beside them.
            ours[AA_BATCH1] = LLM(target, runtime=rt, engine_config=ec)
    c = cfg.compile  # the headline figures are for this mode
    n = cfg.new_tokens
    sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
    hf_passes = cfg.repeats if cfg.hf_repeats is None else cfg.hf_repeats
    hf_kw = {
        "hf plain": {},
        "hf assisted (default)": {"assistant_model": hf_d},
        f"hf assisted (γ={cfg.gamma})": {"assistant_model": hf_d_fixed},
        f"hf prompt lookup ({cfg.ngram_gamma})": {"prompt_lookup_num_tokens": cfg.ngram_gamma},
    }
    runs: dict[str, Run[list[Any]]] = {
        k: Run(lambda kw=kw: [hf_generate(hf_t, p, n, **kw) for p in prompts],
               warmup=lambda kw=kw: hf_generate(hf_t, prompts[0], 4, **kw), passes=hf_passes)
        for k, kw in hf_kw.items()
    }
    # Ours warm up with a whole untimed pass (compiled: every shape kind the
    # timed passes meet compiles there, not inside a timed pass).
    runs |= {k: Run(lambda llm=llm: llm.generate(prompts, sp), before=llm.pipeline.reset_stats,
                    steps=lambda clock, llm=llm: llm.generate_steps(prompts, sp, clock=clock))
             for k, llm in ours.items()}
    dm, plain = _ours("draft_model", c), _ours("plain", c)
    # Efficiency of our draft-model run against its analytic limit, whose bare forwards
    # are timed by turns in the same passes (measure.limit_runs).
    ctx_len = limit_context([len(p) for p in prompts], n)
    contestants = runs | limit_runs({dm: ours[dm]}, ctx_len, after_other=True)
    timing = timed_side_by_side(cfg, contestants, baseline=plain, repeats=cfg.repeats)
    bare = limit_from(timing, {dm: ours[dm]})[dm]
    tokens = len(prompts) * n
    tps = {k: tokens / timing.median(k) for k in runs}
    ref = _token_ids(timing.last("hf plain"))
    plain_target = ours[plain].pipeline.target  # type: ignore[attr-defined]  # weighs a difference's margin
    judged = {k: judge_outputs(_token_ids(timing.last(k)), ref, prompts, plain_target) for k in runs}
    equal = {k: j["equal"] for k, j in judged.items()}
    stats = ours[dm].pipeline.stats()  # the last timed pass's
    counts = stats.counts
    limit = pass_limit(timing, dm, bare, counts)
    speedup = timing.speedup(dm)
    # The limit is a per-step model of decoding; this speedup leaves out each
    # request's first step (its prefill, the same work with or without speculation).
    decode_speedup = timing.decode_speedup(dm)
    # The most a speculative step with no host work could score end to end: both sides'
    # first steps as measured, plain decoding's later steps as measured, speculation's at
    # their bare cost (the limit's C_spec).
    first = {k: statistics.median(_first_steps(o) for o in timing.outputs[k]) for k in ours}
    s_plain = [plain_step_s(o) for o in timing.outputs[plain]]
    c_spec = bare.step_s(counts.tree_size)
    ideal_plain = (first[plain] + len(prompts) * (n - 1) * statistics.median(s_plain)
                   if None not in s_plain else None)
    ideal_spec = first[dm] + (counts.steps - len(prompts)) * c_spec if c_spec is not None else None
    rows = [{"pair": name, "method": k, "tok_s": v, "vs_hf_plain": v / tps["hf plain"], "equal": equal[k]}
            for k, v in tps.items()]
    print_table(rows, f"batch 1, greedy, {len(prompts)} prompts x {n} tokens, medians of {cfg.repeats} "
                      f"passes side by side ({name} pair)")
    # Where each speculative step's time goes (the last timed pass of each of ours).
    steps = {k: step_breakdown(llm.pipeline.stats(), timing.times[k][-1], bare if k == dm else None)
             for k, llm in ours.items() if llm.method is not None}
    print_table([breakdown_row(k, b) for k, b in steps.items()],
                "step time, ms per speculative step (bare: the step's bare cost, the limit's C_spec; draft model only)")
    hf_assisted = max(tps["hf assisted (default)"], tps[f"hf assisted (γ={cfg.gamma})"])
    hf_lookup = tps[f"hf prompt lookup ({cfg.ngram_gamma})"]
    out = {
        "pair": name,
        "compile": c,
        "tok_s": tps,
        "equal": all(equal.values()),
        # outputs that differ from HF's plain decoding only at a near tie of the target's logits
        # (on CPU strict, so none: specdec/spec/exactness.py)
        "near_ties": sum(j["near_ties"] for j in judged.values()),
        "draft_vs_hf_assisted": tps[dm] / hf_assisted,
        "ngram_vs_hf_prompt_lookup": tps[_ours("ngram", c)] / hf_lookup,
        "efficiency_batch1": efficiency(decode_speedup, limit),
        "efficiency_batch1_e2e": efficiency(speedup, limit),
        # Against a limit whose verification forward is timed right after the drafter drafted,
        # and its drafting right after a verification forward (the breakdown's after_draft and
        # drafting_after_target): what is left once the caches' share is out.
        "efficiency_batch1_after_other": efficiency(
            decode_speedup, pass_limit(timing, dm, bare, counts, after_other=True)),
        "analytic_limit": limit,
        "efficiency_batch1_e2e_cap": (efficiency(ideal_plain / ideal_spec, limit)
                                      if ideal_plain is not None and ideal_spec else None),
        "first_steps_s": first,
        "bare_ms": {k: v * 1e3 if v is not None and k.startswith("t_") else v
                    for k, v in dataclasses.asdict(bare).items()},
        "decode_tok_s": {k: statistics.median(decode_rate(o) for o in timing.outputs[k]) for k in ours},
        "tau_draft_model": counts.tau,
        "speedup_draft_model": speedup,
        "decode_speedup_draft_model": decode_speedup,
        "speedup_ngram": timing.speedup(_ours("ngram", c)),
        "step_breakdown": steps,
        "accounted_min": min(b["accounted"] for b in steps.values()),
    }
    if c and cfg.batch1_eager:  # the gain of compile=true, and the eager figures beside it
        # Paired: each pass's eager time over its compiled time (the passes run side by side),
        # the median over passes; ``compile_graphs``: graphs Dynamo compiled for the whole
        # batch-1 run. 0 means compile=true ran the very code eager ran (a target whose
        # layers are one C++ call is not compiled: its backend is native), so both gains
        # are 1 up to the noise and which one is larger says nothing.
        for m in ("plain", "draft_model"):
            eager, compiled = timing.times[_ours(m, False)], timing.times[_ours(m, True)]
            out[f"compile_gain_{m}"] = statistics.median(e / t for e, t in zip(eager, compiled))
        out["compile_graphs"] = counters["stats"]["unique_graphs"] - graphs_before
        if AA_BATCH1 in ours:
            again, eager = timing.times[AA_BATCH1], timing.times[_ours("plain", False)]
            out["compile_gain_aa"] = statistics.median(a / e for a, e in zip(again, eager))
        # The same over the decode phase (each request's first step, its prefill, left out): the
        # prefill is the same work either way, gains less from compiling (a long forward is
        # compute, not calls) and weighs more in the faster speculative pass; these two tell
        # that apart from what the decode steps themselves gain.
        dec = out["decode_tok_s"]
        for m in ("plain", "draft_model"):
            out[f"compile_gain_decode_{m}"] = dec[_ours(m, True)] / dec[_ours(m, False)]
        out["draft_vs_hf_assisted_eager"] = tps[_ours("draft_model", False)] / hf_assisted
        out["ngram_vs_hf_prompt_lookup_eager"] = tps[_ours("ngram", False)] / hf_lookup
    return out


def timed_side_by_side(cfg: CompareConfig, runs: dict[str, Run[Any]], *, baseline: str, repeats: int) -> Timing[Any]:
    """The runs' passes timed by turns (``turn_ms``), or whole, one after another (``turn_ms=0``)."""
    if cfg.turn_ms > 0:
        return lockstep(runs, baseline=baseline, repeats=repeats, turn_s=cfg.turn_ms / 1e3)
    return interleave(runs, baseline=baseline, repeats=repeats)


def hf_batched(model: Any, prompts: list[list[int]], batch: int, new_tokens: int) -> None:
    """transformers ``generate`` over ``prompts`` in batches, left-padded (its batching)."""
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        with torch.inference_mode():  # (.tolist(): wait for the device)
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, eos_token_id=None, pad_token_id=0).tolist()


def until_no_new_graph(one_pass: Callable[[], object], max_passes: int = 3) -> None:
    """Runs ``one_pass`` until a pass compiles no new graph (at most ``max_passes``).
    Speculation's batches vary from pass to pass (adaptive γ, requests out of
    step), so one warm-up pass can miss a kind of batch that a timed pass then meets: on the
    built-in pair at batch 4, three of seven timed n-gram passes compiled graphs of 2-3 s."""
    from torch._dynamo.utils import counters

    for _ in range(max_passes):
        before = counters["stats"]["unique_graphs"]
        one_pass()
        if counters["stats"]["unique_graphs"] == before:
            return


def sweep_point(cfg: CompareConfig, llms: dict[str, LLM], hf_t: Any, ps: list[list[int]], b: int,
                sp: SamplingParams, repeats: int) -> Timing[Any]:
    """Ours (and HF's batched plain ``generate``, when loaded) over ``ps`` at batch ``b``, interleaved."""
    for llm in llms.values():
        llm.engine_config = EngineConfig(max_batch_size=b)
    # Warm-up: compiled, whole untimed passes until one compiles nothing new; eager, a short one.
    short = replace(sp, max_new_tokens=4)
    runs: dict[str, Run[Any]] = {
        k: Run(lambda llm=llm: llm.generate(ps, sp),
               warmup=((lambda llm=llm: until_no_new_graph(lambda: llm.generate(ps, sp))) if cfg.sweep_compile
                       else (lambda llm=llm: llm.generate(ps[:b], short))),
               steps=lambda clock, llm=llm: llm.generate_steps(ps, sp, clock=clock))
        for k, llm in llms.items()
    }
    if hf_t is not None:  # a reference only
        runs["hf plain"] = Run(lambda: hf_batched(hf_t, ps, b, sp.max_new_tokens),
                               warmup=lambda: hf_batched(hf_t, ps[:b], b, 4), passes=max(1, cfg.repeats - 1))
    return timed_side_by_side(cfg, runs, baseline="plain", repeats=repeats)


def sweep(
    cfg: CompareConfig, target: Path, draft: Path, prompts: list[list[int]]
) -> tuple[list[dict[str, Any]], bool]:
    hf_t = hf_model(target, cfg.device) if cfg.sweep_hf else None
    n = cfg.sweep_new_tokens
    sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
    # One set of runners for every point, sized for the largest batch; the
    # engine caps each point's batch. (Compiled, each shape kind then compiles
    # once, and adaptive γ calibrates once.)
    pool = [prompts[i % len(prompts)] for i in range(max(*cfg.batch_sizes, cfg.sweep_min_requests))]
    rt = RuntimeConfig(max_batch_size=max(cfg.batch_sizes), max_seq_len=max(len(p) for p in pool) + n + 16,
                       compile=bool(cfg.sweep_compile), device=cfg.device, threads=cfg.threads,
                       cpu_linear=cfg.cpu_linear)
    # Adaptive γ: speculation turns itself down (to plain decoding) where it cannot pay.
    llms = {k: LLM(target, method=mc, runtime=rt) for k, mc in methods(cfg, draft, adaptive=True).items()}
    if cfg.sweep_aa:  # a second plain runner of its own (its own weights and cache, as each contestant has)
        llms["plain again"] = LLM(target, runtime=rt)
    rows, equal = [], True
    for b in cfg.batch_sizes:
        ps = pool[: max(b, cfg.sweep_min_requests)]
        reps = cfg.sweep_repeats
        if cfg.sweep_pass_tokens:
            reps = max(2, min(reps, -(-cfg.sweep_pass_tokens // (len(ps) * n))))
        timing = sweep_point(cfg, llms, hf_t, ps, b, sp, reps)
        ref = _token_ids(timing.last("plain"))
        plain_target = llms["plain"].pipeline.target  # type: ignore[attr-defined]
        eq = all(judge_outputs(_token_ids(timing.last(k)), ref, ps, plain_target)["equal"]
                 for k in ("draft_model", "ngram"))
        equal &= eq
        tps = {k: len(ps) * n / timing.median(k) for k in timing.times}
        rows.append({"batch": b, "plain_tok_s": tps["plain"], "draft_tok_s": tps["draft_model"],
                     "ngram_tok_s": tps["ngram"], "hf_plain_tok_s": tps.get("hf plain"),
                     "draft_vs_plain": timing.speedup("draft_model"), "ngram_vs_plain": timing.speedup("ngram"),
                     **({"aa_vs_plain": timing.speedup("plain again")} if cfg.sweep_aa else {}), "equal": eq})
    mode = "compiled" if cfg.sweep_compile else "eager"
    print_table(rows, f"batch sweep, greedy, {n} new tokens, adaptive γ <= {cfg.gamma}, ours {mode}; "
                      f"*_vs_plain: median over up to {cfg.sweep_repeats} passes of each pass's ratio")
    return rows, equal


def bar_chart(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        names = list(r["tok_s"])
        ax.barh(names, [r["tok_s"][k] for k in names], color=["#999" if k.startswith("hf") else "#2a7" for k in names])
        ax.set_xlabel("tokens/s (batch 1, greedy)")
        ax.set_title(f"{r['pair']} pair")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> None:
    cfg = load_config(CompareConfig, argv)
    torch.set_num_threads(cfg.threads)
    if cfg.quick:
        # Three passes of ours, one of HF's (its figures have wide margins); eager's
        # batch-1 rows (compile_gain_*) are left out.
        cfg.pairs, cfg.repeats, cfg.num_prompts, cfg.new_tokens, cfg.batch1_eager = ["builtin"], 3, 4, 64, False
        cfg.hf_repeats = 1
        cfg.batch_sizes, cfg.sweep_new_tokens, cfg.sweep_min_requests, cfg.sweep_repeats = [1, 4, 16, 64], 24, 4, 3
        cfg.sweep_pass_tokens = 2 * 64 * 24  # batch 64: two passes
        cfg.sweep_hf = False
        if cfg.sweep_compile is None:
            cfg.sweep_compile = False
    if cfg.sweep_compile is None:
        cfg.sweep_compile = cfg.compile
    results = []
    pairs = {}
    for name in cfg.pairs:
        label, t, d, prompts = load_pair(name)
        pairs[label] = (t, d, prompts)
        results.append(batch1(cfg, label, t, d, prompts))
    head = results[0]
    t, d, prompts = next(iter(pairs.values()))
    rows, sweep_equal = sweep(cfg, t, d, prompts)
    min_ratio = min(min(r["draft_vs_plain"], r["ngram_vs_plain"]) for r in rows)
    out = ROOT / cfg.out if not Path(cfg.out).is_absolute() else Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "draft_vs_hf_assisted": round(head["draft_vs_hf_assisted"], 3),
        "ngram_vs_hf_prompt_lookup": round(head["ngram_vs_hf_prompt_lookup"], 3),
        "efficiency_batch1": _round(head["efficiency_batch1"]),
        "efficiency_batch1_e2e": _round(head["efficiency_batch1_e2e"]),
        "efficiency_batch1_after_other": _round(head["efficiency_batch1_after_other"]),
        "analytic_limit_batch1": _round(head["analytic_limit"]),
        "target_forward_ms": {k: _round(head["bare_ms"][f]) for k, f in
                              (("bare", "t_target_g1"), ("after_draft", "t_target_g1_after_draft"))},
        "draft_forward_ms": {k: _round(head["bare_ms"][f]) for k, f in
                             (("bare", "t_draft_1"), ("after_target", "t_draft_1_after_target"))},
        "min_spec_vs_plain": round(min_ratio, 3),
        **({"aa_vs_plain_min": round(min(r["aa_vs_plain"] for r in rows), 3),
            "aa_vs_plain_max": round(max(r["aa_vs_plain"] for r in rows), 3)} if cfg.sweep_aa else {}),
        "accounted_min": round(head["accounted_min"], 4),
        "outputs_equal": all(r["equal"] for r in results) and sweep_equal,
        "pair": head["pair"],
        "compile": cfg.compile,
        "sweep_compile": cfg.sweep_compile,
        "cpu_linear": cfg.cpu_linear,
    }
    for k in ("compile_gain_plain", "compile_gain_draft_model", "compile_gain_aa", "compile_gain_decode_plain",
              "compile_gain_decode_draft_model", "draft_vs_hf_assisted_eager", "ngram_vs_hf_prompt_lookup_eager"):
        if k in head:
            figures[k] = round(head[k], 3)
    if "compile_graphs" in head:
        figures["compile_graphs"] = head["compile_graphs"]
    (out / "compare_hf.json").write_text(json.dumps({"figures": figures, "batch1": results, "sweep": rows}, indent=2))
    bar_chart(results, out / "compare_hf.png")
    print(f"\nwrote {out / 'compare_hf.json'} and {out / 'compare_hf.png'}")
    emit_json(figures)


def _round(x: float | None, digits: int = 3) -> float | None:
    """``x`` rounded; None (a figure not measured) stays None."""
    return None if x is None else round(x, digits)


if __name__ == "__main__":
    main(sys.argv[1:])
