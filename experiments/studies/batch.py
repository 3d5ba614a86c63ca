"""Speedup over plain decoding against batch size, with fixed γ and adaptive γ, per method.

    python experiments/studies/batch.py quick=true
    python experiments/studies/batch.py 'batch_sizes=[1,2,4,8,16,32,64]' gamma=8
    python experiments/studies/batch.py target=/ckpt/target draft=/ckpt/draft logger=none

As the batch grows the target's forward turns compute-bound: verifying γ+1
tokens per request costs nearly γ+1 times one, and fixed-γ speculation falls
below plain decoding. Adaptive γ (``adaptive_gamma=True``,
:mod:`specdec.spec.gamma`) picks each step's γ ≤ ``gamma`` from measured
forward times and running acceptance, down to 0 (plain) where drafting
cannot pay. At each batch size, plain decoding and every method × {fixed,
adaptive} run the same prompts (at least ``min_requests`` of them, so small
batches time more than one request) in passes timed by turns
(:func:`specdec.measure.lockstep`); speedup is the median over passes of
plain's time ÷ the method's in the same pass. Greedy outputs must equal
plain's (``equal``).

Writes ``batch.json`` (rows, per batch size, method and γ mode: speedup,
tok_s, tau, alpha, equal and the counters), ``batch.png`` (speedup and τ
against batch size) into ``out=`` (default ``outputs/studies/batch/<time>_<id>``)
and a W&B run (``logger=none``: none).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.measure import outputs_equal
from specdec.studies import (
    StudyConfig,
    counts_row,
    finish,
    inputs,
    main,
    make_llm,
    method_config,
    out_dir,
    quick,
    sampling,
    save_figure,
    start,
    time_against_plain,
)

MODES = {"fixed": False, "adaptive": True}  # γ mode -> adaptive_gamma


@dataclass
class BatchStudyConfig(StudyConfig):
    methods: list[str] = field(default_factory=lambda: ["draft_model", "ngram"])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    gamma: int = 4  # fixed γ, and adaptive γ's most
    min_requests: int = 8  # prompts per point at least (cycled from num_prompts)
    new_tokens: int = 32
    temperature: float = 0.0


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["batch_size"] for r in rows})
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for j, m in enumerate(dict.fromkeys(r["method"] for r in rows)):
        for mode, ls in (("fixed", "o-"), ("adaptive", "s--")):
            pts = [r for r in rows if r["method"] == m and r["gamma_mode"] == mode]
            b = [r["batch_size"] for r in pts]
            a1.plot(b, [r["speedup"] for r in pts], ls, color=f"C{j}", label=f"{m}, {mode} γ")
            a2.plot(b, [r["tau"] for r in pts], ls, color=f"C{j}", label=f"{m}, {mode} γ")
    a1.axhline(1.0, color="k", lw=0.8, ls="--")
    a1.set(ylabel="speedup vs plain", title="speedup against batch size")
    a2.set(ylabel="τ (tokens per target forward)", title="τ (adaptive: γ = 0 steps count τ = 1)")
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def run(cfg: BatchStudyConfig) -> dict[str, Any]:
    cfg = quick(cfg, num_prompts=4, new_tokens=24, min_requests=4)
    start(cfg)
    data = inputs(cfg)
    pool = [data.prompts[i % len(data.prompts)] for i in range(max(*cfg.batch_sizes, cfg.min_requests))]
    # One LLM per runner, sized for the largest batch; each point caps its batch
    # through the engine (adaptive γ then calibrates its forward times once).
    top = max(cfg.batch_sizes)
    llms = {"plain": make_llm(cfg, data.target, None, pool, top)}
    for m in cfg.methods:
        for mode, adaptive in MODES.items():
            mc = method_config(m, cfg.gamma, data.draft, adaptive_gamma=adaptive)
            llms[f"{m} {mode}"] = make_llm(cfg, data.target, mc, pool, top)
    rows = []
    for i, b in enumerate(cfg.batch_sizes):
        for llm in llms.values():
            llm.engine_config = dataclasses.replace(llm.engine_config, max_batch_size=b)
        ps = pool[: max(b, cfg.min_requests)]
        timing = time_against_plain(llms, ps, sampling(cfg, len(ps), cfg.temperature), cfg.repeats, i)
        plain = [o.token_ids for o in timing.last("plain")]
        tokens = sum(len(ids) for ids in plain)
        for m in cfg.methods:
            for mode in MODES:
                k = f"{m} {mode}"
                equal = outputs_equal([o.token_ids for o in timing.last(k)], plain) if cfg.temperature == 0 else None
                rows.append({"batch_size": b, "method": m, "gamma_mode": mode, "speedup": timing.speedup(k),
                             "tok_s": tokens / timing.median(k), "plain_tok_s": tokens / timing.median("plain"),
                             **counts_row(llms[k]), "equal": equal})
    out = out_dir(cfg, "batch")
    fig = plot(rows, f"γ={cfg.gamma}, T={cfg.temperature:g}, {cfg.new_tokens} new tokens, {cfg.repeats} interleaved "
                     f"passes per point", out / "batch.png")
    return finish(cfg, "batch", out, data, rows, fig, gamma=cfg.gamma,
                  outputs_equal=all(r["equal"] for r in rows if r["equal"] is not None))


if __name__ == "__main__":
    main(run, BatchStudyConfig, sys.argv[1:])
