"""Acceptance (α, τ) and speedup over plain decoding against the sampling temperature, per method.

    python experiments/studies/temperature.py quick=true
    python experiments/studies/temperature.py 'temperatures=[0,0.5,1.0,1.5]' gamma=8 'methods=[draft_model]'
    python experiments/studies/temperature.py target=/ckpt/target draft=/ckpt/draft logger=none

At each temperature every method and plain decoding of the target run the
same prompts, seeded (prompt i: ``seed + i``), in passes timed by turns
(:func:`specdec.measure.lockstep`); speedup is the median over passes of
plain's time ÷ the method's in the same pass. Sampling lowers acceptance
where the draft's distribution differs from the target's (a token is kept
with probability min(1, p/q)); at temperature 0 every speculative output
must equal plain greedy decoding (``equal``; null where sampling).

Writes ``temperature.json`` (rows, per temperature and method: tau, alpha,
speedup, tok_s, equal and the counters), ``temperature.png`` (α, τ, speedup
against temperature) into ``out=`` (default
``outputs/studies/temperature/<time>_<id>``) and a W&B run (``logger=none``: none).
"""

from __future__ import annotations

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


@dataclass
class TemperatureStudyConfig(StudyConfig):
    methods: list[str] = field(default_factory=lambda: ["draft_model", "ngram"])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.3, 0.7, 1.0])
    gamma: int = 4
    batch_size: int = 1  # requests at once (1: the cleanest timing)


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = [r for r in rows if r["method"] == m]
        for ax, key in zip(axes, ("alpha", "tau", "speedup")):
            ax.plot([r["temperature"] for r in pts], [r[key] for r in pts], "o-", label=m)
    for ax, name in zip(axes, ("α (accepted / proposed)", "τ (tokens per target forward)", "speedup vs plain")):
        ax.set(xlabel="temperature", title=name)
        ax.grid(alpha=0.3)
    axes[2].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[0].set_ylim(0, 1.05)
    axes[2].legend()
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def run(cfg: TemperatureStudyConfig) -> dict[str, Any]:
    cfg = quick(cfg, num_prompts=3, new_tokens=32)
    start(cfg)
    data = inputs(cfg)
    llms = {"plain": make_llm(cfg, data.target, None, data.prompts, cfg.batch_size)}
    llms |= {m: make_llm(cfg, data.target, method_config(m, cfg.gamma, data.draft), data.prompts, cfg.batch_size)
             for m in cfg.methods}
    rows = []
    for i, temp in enumerate(cfg.temperatures):
        timing = time_against_plain(llms, data.prompts, sampling(cfg, len(data.prompts), temp), cfg.repeats, i)
        plain = [o.token_ids for o in timing.last("plain")]
        tokens = sum(len(ids) for ids in plain)
        for m in cfg.methods:
            equal = outputs_equal([o.token_ids for o in timing.last(m)], plain) if temp == 0 else None
            rows.append({"temperature": temp, "method": m, **counts_row(llms[m]), "speedup": timing.speedup(m),
                         "tok_s": tokens / timing.median(m), "plain_tok_s": tokens / timing.median("plain"),
                         "equal": equal})
    out = out_dir(cfg, "temperature")
    title = (f"γ={cfg.gamma}, batch {cfg.batch_size}, {len(data.prompts)} prompts × {cfg.new_tokens} tokens, "
             f"{cfg.repeats} interleaved passes")
    fig = plot(rows, title, out / "temperature.png")
    return finish(cfg, "temperature", out, data, rows, fig, gamma=cfg.gamma,
                  outputs_equal=all(r["equal"] for r in rows if r["equal"] is not None))


if __name__ == "__main__":
    main(run, TemperatureStudyConfig, sys.argv[1:])
