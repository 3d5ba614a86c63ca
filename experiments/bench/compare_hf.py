"""Us against Hugging Face transformers on the same checkpoints, greedy.

    python experiments/bench/compare_hf.py quick=true
    python experiments/bench/compare_hf.py pairs=[builtin,random] batch_sizes=[1,4,16,64]

Batch 1, side by side in one run (interleaved repeats, medians): transformers
``generate`` plain, assisted generation (``assistant_model``; its default
schedule and a fixed γ), prompt lookup (``prompt_lookup_num_tokens``), and
ours (plain, draft model, n-gram). Every output is checked equal to plain
greedy decoding. Then a batch sweep: our speculation against our plain
decoding (transformers' assisted generation runs at batch 1 only, so its
plain batched ``generate`` is the reference there).

Ours runs with ``runtime.compile`` (``compile=true``, the default) and, at
batch 1, eager beside it: the headline figures are the compiled ones, and
``compile_gain_*`` / ``*_eager`` give the eager side. ``quick=true`` stays
under a minute: 3 prompts x 48 tokens, three passes of ours and one of HF's, no
eager batch-1 rows, and an eager sweep (``sweep_compile``) of three passes per
point (two at batch 64) without HF's batched reference.

Efficiency is speedup / analytic limit, the limit from bare forward times
timed interleaved (``forward_times``). The limit is a per-step model of
decoding, with no prefill in it, so ``efficiency_batch1`` divides the
*decode-phase* speedup by it: tokens/s after each request's first step
(``GenerationOutput.decode_tokens / decode_s``), on both sides.
``efficiency_batch1_e2e`` divides the end-to-end speedup (whole requests,
prefill included) by the same limit. A framework with no overhead at all
would score only about 0.92-0.94 on it at 48-64 new tokens, because the
prefill takes the same time with and without speculation. Either can pass 1:
plain decoding's own host work per token is in the speedup, not in the
limit's bare T(1).

Writes a table, ``compare_hf.json`` and ``compare_hf.png`` (into ``out=``,
default ``outputs/bench``), and ends with one JSON line: ``draft_vs_hf_assisted``,
``ngram_vs_hf_prompt_lookup``, ``efficiency_batch1``, ``min_spec_vs_plain``,
``outputs_equal`` (and the end-to-end efficiency and compile figures).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    ROOT,
    builtin_pair,
    builtin_prompts,
    emit_json,
    median,
    parse_overrides,
    print_table,
    random_checkpoint,
    timed,
)

from specdec.api import LLM  # noqa: E402
from specdec.core.context import SamplingParams  # noqa: E402
from specdec.core.pipeline_model import RuntimeConfig  # noqa: E402
from specdec.engine import EngineConfig  # noqa: E402
from specdec.spec.forward_time import forward_times  # noqa: E402
from specdec.spec.metrics import analytic_limit  # noqa: E402
from specdec.spec.proposers.draft_model import DraftModelConfig  # noqa: E402
from specdec.spec.proposers.ngram import NgramConfig  # noqa: E402


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
    sweep_min_requests: int = 16  # per point, so small batches time more than one short request
    sweep_compile: bool | None = None  # None: as `compile` (quick: false, compiling its batch shapes takes ~25 s)
    # Timed passes per sweep point. The headline is the *lowest* of 8 ratios,
    # so each must be steady: a 2-3% wobble per ratio would pull it down.
    sweep_repeats: int = 5
    # If set, a point whose passes already time this many tokens in fewer
    # passes runs only those (at least 2): quick spends its time on the small,
    # noisy points, not on batch 64.
    sweep_pass_tokens: int = 0
    sweep_hf: bool = True  # time transformers' batched plain generate beside (a reference column only)
    out: str = "outputs/bench"
    threads: int = 2
    compile: bool = True  # ours with runtime.compile (its eager runs are measured alongside at batch 1)
    batch1_eager: bool = True  # with compile: time ours eager too at batch 1 (the compile_gain_* figures)
    device: str = "cpu"  # cuda: see gpu.sh (transformers runs there too)


def load_pair(name: str) -> tuple[str, Path, Path, list[list[int]]]:
    pair = builtin_pair()
    if name == "builtin" and pair is not None:
        t, d = pair
        prompts = builtin_prompts(t, 64)
        return "builtin", t, d, prompts
    t = random_checkpoint(layers=6, seed=0)
    d = random_checkpoint(layers=1, seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4000, (24,), generator=g).tolist() * 3 for _ in range(64)]
    return "random", t, d, prompts


def hf_generate(model, prompt: list[int], new_tokens: int, **kw) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def batch1(cfg: CompareConfig, name: str, target: Path, draft: Path, prompts: list[list[int]]) -> dict:
    from transformers import AutoModelForCausalLM

    prompts = prompts[: cfg.num_prompts]
    hf_t = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval().to(cfg.device)
    hf_d = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval().to(cfg.device)
    hf_d_fixed = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval().to(cfg.device)
    hf_d_fixed.generation_config.num_assistant_tokens_schedule = "constant"
    hf_d_fixed.generation_config.num_assistant_tokens = cfg.gamma
    max_len = max(len(p) for p in prompts) + cfg.new_tokens + 16
    ec = EngineConfig(max_batch_size=1)
    methods = {
        "plain": None,
        "draft_model": DraftModelConfig(path=str(draft), num_speculative_tokens=cfg.gamma),
        "ngram": NgramConfig(num_speculative_tokens=cfg.ngram_gamma),
    }
    ours = {}
    for compiled in ([False, True] if cfg.compile and cfg.batch1_eager else [cfg.compile]):
        rt = RuntimeConfig(max_batch_size=1, max_seq_len=max_len, compile=compiled, device=cfg.device)
        for m, mc in methods.items():
            ours[_ours(m, compiled)] = LLM(target, method=mc, runtime=rt, engine_config=ec)
    c = cfg.compile  # the headline figures are for this mode
    n = cfg.new_tokens
    sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
    runners = {
        "hf plain": lambda: [hf_generate(hf_t, p, n) for p in prompts],
        "hf assisted (default)": lambda: [hf_generate(hf_t, p, n, assistant_model=hf_d) for p in prompts],
        f"hf assisted (γ={cfg.gamma})": lambda: [hf_generate(hf_t, p, n, assistant_model=hf_d_fixed) for p in prompts],
        f"hf prompt lookup ({cfg.ngram_gamma})": lambda: [
            hf_generate(hf_t, p, n, prompt_lookup_num_tokens=cfg.ngram_gamma) for p in prompts],
        **{k: (lambda llm=llm: llm.generate(prompts, sp)) for k, llm in ours.items()},
    }
    # Warm-up: one untimed pass of ours (compiled: every shape kind the timed
    # passes meet compiles here, not inside a timed pass).
    for k, llm in ours.items():
        runners[k]()
    hf_generate(hf_t, prompts[0], 4)
    times: dict[str, list[float]] = {k: [] for k in runners}
    decode_rates: dict[str, list[float]] = {k: [] for k in ours}  # decode phase only (after the first step)
    first_steps: dict[str, list[float]] = {k: [] for k in ours}  # seconds of each pass's first steps, summed
    outs: dict[str, list[list[int]]] = {}
    hf_passes = cfg.repeats if cfg.hf_repeats is None else cfg.hf_repeats
    for r in range(cfg.repeats):
        for k, fn in runners.items():
            if k not in ours and r >= hf_passes:
                continue
            if k in ours and hasattr(ours[k].pipeline, "counts"):
                ours[k].pipeline.counts.clear()
            t, o = timed(fn)
            times[k].append(t)
            if k in ours:
                decode_rates[k].append(sum(x.decode_tokens for x in o) / sum(x.decode_s for x in o))
                # Batch 1, all queued at once: request i's first step runs from the
                # end of request i-1 (its ttft + decode_s) to its own first tokens.
                ends = [0.0] + [x.ttft_s + x.decode_s for x in o[:-1]]
                first_steps[k].append(sum(x.ttft_s - e for x, e in zip(o, ends)))
                o = [x.token_ids for x in o]
            outs[k] = o
    tokens = len(prompts) * n
    tps = {k: tokens / median(v) for k, v in times.items()}
    decode_tps = {k: median(v) for k, v in decode_rates.items()}
    ref = outs["hf plain"]
    equal = {k: o == ref for k, o in outs.items()}
    # Efficiency of our draft-model run against its analytic limit.
    dm = ours[_ours("draft_model", c)].pipeline
    ctx_len = max(len(p) for p in prompts) + n // 2
    bare = forward_times({"t1": (dm.target, 1), "tg": (dm.target, cfg.gamma + 1), "td": (dm.proposer.pipeline, 1)},
                         ctx_len, rounds=3 if cfg.quick else 5)  # interleaved: the limit is their ratio
    counts = dm.run_counts()  # the last timed pass's
    tau = counts.tau
    limit = analytic_limit(tau=tau, gamma=cfg.gamma, t_target_1=bare["t1"], t_target_g1=bare["tg"],
                           t_draft_1=bare["td"])
    speedup = tps[_ours("draft_model", c)] / tps[_ours("plain", c)]
    # The limit is a per-step model of decoding; this speedup leaves out each
    # request's first step (its prefill, the same work with or without speculation).
    decode_speedup = decode_tps[_ours("draft_model", c)] / decode_tps[_ours("plain", c)]
    # The most an overhead-free framework could score end to end: both sides'
    # first steps as measured, every later step at its bare cost.
    first = {k: median(v) for k, v in first_steps.items()}
    later_steps = counts.steps - len(prompts)
    ideal_plain = first[_ours("plain", c)] + len(prompts) * (n - 1) * bare["t1"]
    ideal_spec = first[_ours("draft_model", c)] + later_steps * (bare["tg"] + cfg.gamma * bare["td"])
    e2e_cap = ideal_plain / ideal_spec / limit if limit else 0.0
    rows = [{"pair": name, "method": k, "tok_s": v, "vs_hf_plain": v / tps["hf plain"], "equal": equal[k]}
            for k, v in tps.items()]
    print_table(rows, f"batch 1, greedy, {len(prompts)} prompts x {n} tokens, medians of {cfg.repeats} ({name} pair)")
    hf_assisted = max(tps["hf assisted (default)"], tps[f"hf assisted (γ={cfg.gamma})"])
    hf_lookup = tps[f"hf prompt lookup ({cfg.ngram_gamma})"]
    out = {
        "pair": name,
        "compile": c,
        "tok_s": tps,
        "equal": all(equal.values()),
        "draft_vs_hf_assisted": tps[_ours("draft_model", c)] / hf_assisted,
        "ngram_vs_hf_prompt_lookup": tps[_ours("ngram", c)] / hf_lookup,
        "efficiency_batch1": decode_speedup / limit if limit else 0.0,
        "efficiency_batch1_e2e": speedup / limit if limit else 0.0,
        "analytic_limit": limit,
        "efficiency_batch1_e2e_cap": e2e_cap,
        "first_steps_s": first,
        "bare_ms": {k: v * 1e3 for k, v in bare.items()},
        "decode_tok_s": decode_tps,
        "tau_draft_model": tau,
        "speedup_draft_model": speedup,
        "decode_speedup_draft_model": decode_speedup,
        "speedup_ngram": tps[_ours("ngram", c)] / tps[_ours("plain", c)],
    }
    if c and cfg.batch1_eager:  # the gain of compile=true, and the eager figures beside it
        out["compile_gain_plain"] = tps[_ours("plain", True)] / tps[_ours("plain", False)]
        out["compile_gain_draft_model"] = tps[_ours("draft_model", True)] / tps[_ours("draft_model", False)]
        out["draft_vs_hf_assisted_eager"] = tps[_ours("draft_model", False)] / hf_assisted
        out["ngram_vs_hf_prompt_lookup_eager"] = tps[_ours("ngram", False)] / hf_lookup
    return out


def _ours(method: str, compiled: bool) -> str:
    return f"ours {method}" + (" (compiled)" if compiled else "")


def sweep(cfg: CompareConfig, target: Path, draft: Path, prompts: list[list[int]]) -> tuple[list[dict], bool]:
    from transformers import AutoModelForCausalLM

    hf_t = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval().to(cfg.device)
    n = cfg.sweep_new_tokens
    sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
    # One set of runners for every point, sized for the largest batch; the
    # engine caps each point's batch. (Compiled, each shape kind then compiles
    # once, and adaptive γ calibrates once.)
    pool = [prompts[i % len(prompts)] for i in range(max(*cfg.batch_sizes, cfg.sweep_min_requests))]
    rt = RuntimeConfig(max_batch_size=max(cfg.batch_sizes), max_seq_len=max(len(p) for p in pool) + n + 16,
                       compile=bool(cfg.sweep_compile), device=cfg.device)
    # Adaptive γ: speculation turns itself down (to plain decoding) where it cannot pay.
    llms = {
        "plain": LLM(target, runtime=rt),
        "draft_model": LLM(target, method=DraftModelConfig(path=str(draft), num_speculative_tokens=cfg.gamma,
                                                           adaptive_gamma=True), runtime=rt),
        "ngram": LLM(target, method=NgramConfig(num_speculative_tokens=cfg.ngram_gamma, adaptive_gamma=True),
                     runtime=rt),
    }
    rows, equal = [], True
    for b in cfg.batch_sizes:
        ps = pool[: max(b, cfg.sweep_min_requests)]
        for llm in llms.values():
            llm.engine_config = EngineConfig(max_batch_size=b)
            # Warm-up: compiled, a whole untimed pass (it compiles every shape kind met).
            llm.generate(ps, sp) if cfg.sweep_compile else llm.generate(ps[:b], replace(sp, max_new_tokens=4))
        times: dict[str, list[float]] = {k: [] for k in llms}
        ratios: dict[str, list[float]] = {k: [] for k in llms}  # plain's time / the runner's, per pass
        hf_times: list[float] = []
        outs = {}
        order = list(llms)
        reps = cfg.sweep_repeats
        if cfg.sweep_pass_tokens:
            reps = max(2, min(reps, -(-cfg.sweep_pass_tokens // (len(ps) * n))))
        for r in range(reps):
            for k in order[r % len(order):] + order[: r % len(order)]:  # rotated: no runner always goes first
                t, o = timed(lambda llm=llms[k]: llm.generate(ps, sp))
                times[k].append(t)
                outs[k] = [x.token_ids for x in o]
            for k in llms:  # runners timed side by side in one pass: a slow spell touches them alike
                ratios[k].append(times["plain"][-1] / times[k][-1])
            if cfg.sweep_hf and r < max(1, cfg.repeats - 1):  # HF's batched plain decoding: a reference only
                t, _ = timed(lambda: hf_batched(hf_t, ps, b, n))
                hf_times.append(t)
        tps = {k: len(ps) * n / median(v) for k, v in times.items()}
        eq = outs["draft_model"] == outs["plain"] and outs["ngram"] == outs["plain"]
        equal &= eq
        rows.append({"batch": b, "plain_tok_s": tps["plain"], "draft_tok_s": tps["draft_model"],
                     "ngram_tok_s": tps["ngram"], "hf_plain_tok_s": len(ps) * n / median(hf_times) if hf_times else None,
                     "draft_vs_plain": median(ratios["draft_model"]),
                     "ngram_vs_plain": median(ratios["ngram"]), "equal": eq})
    mode = "compiled" if cfg.sweep_compile else "eager"
    print_table(rows, f"batch sweep, greedy, {n} new tokens, adaptive γ <= {cfg.gamma}, ours {mode}; "
                      f"*_vs_plain: median over up to {cfg.sweep_repeats} passes of each pass's ratio")
    return rows, equal


def hf_batched(model, prompts: list[list[int]], batch: int, new_tokens: int) -> None:
    """transformers ``generate`` over ``prompts`` in batches, left-padded (its batching)."""
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, eos_token_id=None, pad_token_id=0).tolist()  # .tolist(): wait for the device


def bar_chart(results: list[dict], path: Path) -> None:
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
    cfg = parse_overrides(CompareConfig, argv)
    torch.set_num_threads(cfg.threads)
    if cfg.quick:
        # Three passes of ours, one of HF's (its figures have wide margins); eager's
        # batch-1 rows (compile_gain_*) are left out.
        cfg.pairs, cfg.repeats, cfg.num_prompts, cfg.new_tokens, cfg.batch1_eager = ["builtin"], 3, 3, 48, False
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
        "efficiency_batch1": round(head["efficiency_batch1"], 3),
        "efficiency_batch1_e2e": round(head["efficiency_batch1_e2e"], 3),
        "min_spec_vs_plain": round(min_ratio, 3),
        "outputs_equal": all(r["equal"] for r in results) and sweep_equal,
        "pair": head["pair"],
        "compile": cfg.compile,
        "sweep_compile": cfg.sweep_compile,
    }
    for k in ("compile_gain_plain", "compile_gain_draft_model", "draft_vs_hf_assisted_eager",
              "ngram_vs_hf_prompt_lookup_eager"):
        if k in head:
            figures[k] = round(head[k], 3)
    (out / "compare_hf.json").write_text(json.dumps({"figures": figures, "batch1": results, "sweep": rows}, indent=2))
    bar_chart(results, out / "compare_hf.png")
    print(f"\nwrote {out / 'compare_hf.json'} and {out / 'compare_hf.png'}")
    emit_json(figures)


if __name__ == "__main__":
    main(sys.argv[1:])
