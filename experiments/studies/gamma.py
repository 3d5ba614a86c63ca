"""τ against γ beside the i.i.d. acceptance model, and the per-position acceptance that explains the gap.

    python experiments/studies/gamma.py quick=true
    python experiments/studies/gamma.py method=ngram 'gammas=[1,2,4,8]' temperature=0.7
    python experiments/studies/gamma.py target=/ckpt/target draft=/ckpt/draft logger=none

The i.i.d. model (Leviathan et al. 2023): each draft token is accepted with
the same probability α, independently, so E[τ] = (1 − α^(γ+1)) / (1 − α).
Its α is a per-token probability, estimated here as accepted / reached
(``alpha_token``: of the draft tokens the target verified with every earlier
one accepted, the share it kept). The framework's α = accepted / proposed
(``alpha``) also counts tokens never reached after a rejection; put into the
formula it would undershoot τ even where acceptance really is i.i.d.

Two things pull the measured τ off the model, and the figures separate them:

- position: p_i = P(token i accepted | tokens < i accepted) is not flat.
  ``tau_per_position`` = 1 + Σ_k Π_{i≤k} p_i is τ with the measured p_i and
  γ drafts every step; ``iid_tau − tau_per_position`` is what assuming a flat
  p_i = α gets wrong.
- short steps: some steps draft fewer than γ tokens (a request's last ones,
  with fewer tokens left to make; an n-gram lookup that finds less), while
  both models assume γ every step; ``drafts_per_step`` < γ shows it, and
  ``tau_per_position − tau`` is what it costs.

Writes ``gamma.json`` (rows, per γ: tau, alpha, alpha_token, iid_tau,
tau_per_position, drafts_per_step, per_position, reached, accepted_at),
``gamma.png`` (τ vs γ three ways; p_i vs i per γ) into ``out=`` (default
``outputs/studies/gamma/<time>_<id>``) and a W&B run (``logger=none``: none).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.api import LLM
from specdec.studies import (
    StudyConfig,
    finish,
    iid_tau,
    inputs,
    main,
    make_llm,
    method_config,
    out_dir,
    quick,
    sampling,
    save_figure,
    start,
)


@dataclass
class GammaStudyConfig(StudyConfig):
    method: str = "draft_model"  # any registered method, by name
    gammas: list[int] = field(default_factory=lambda: list(range(1, 9)))
    temperature: float = 0.0
    batch_size: int = 8  # no timing here: batching only makes it faster (seeded outputs do not change)


def point(llm: LLM, gamma: int) -> dict[str, Any]:
    """One γ's figures from ``llm``'s counters."""
    c = llm.pipeline.stats().counts
    pp = c.per_position
    alpha_token = sum(c.accepted_at) / sum(c.reached) if sum(c.reached) else 0.0
    return {"gamma": gamma, "tau": c.tau, "alpha": c.alpha, "alpha_token": alpha_token,
            "iid_tau": iid_tau(alpha_token, gamma),
            "tau_per_position": 1 + sum(math.prod(pp[:k]) for k in range(1, len(pp) + 1)),
            "drafts_per_step": c.proposed / c.steps if c.steps else 0.0,
            "steps": c.steps, "proposed": c.proposed, "accepted": c.accepted,
            "per_position": pp, "reached": c.reached, "accepted_at": c.accepted_at}


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = [r["gamma"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    a1.plot(g, [x + 1 for x in g], color="0.8", lw=1, label="γ + 1 (every draft accepted)")
    a1.plot(g, [r["tau"] for r in rows], "o-", label="measured τ")
    a1.plot(g, [r["iid_tau"] for r in rows], "s--", label="i.i.d. model (1 − α^(γ+1)) / (1 − α)")
    a1.plot(g, [r["tau_per_position"] for r in rows], "x:", label="1 + Σ_k Π_{i≤k} p_i")
    a1.set(xlabel="γ (draft tokens per step)", ylabel="τ (tokens per target forward)",
           title=f"τ against γ: {title}")
    colors = plt.get_cmap("viridis")
    for j, r in enumerate(rows):
        c = colors(j / max(1, len(rows) - 1))
        pp = r["per_position"]
        a2.plot(range(1, len(pp) + 1), pp, "o-", ms=3, color=c, label=f"γ={r['gamma']}")
        a2.axhline(r["alpha_token"], color=c, lw=0.6, ls="--")
    a2.set(xlabel="draft position i", ylabel="p_i = P(accepted | earlier accepted)", ylim=(0, 1.05),
           title="per-position acceptance (dashed: the i.i.d. model's flat α)")
    for ax in (a1, a2):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def run(cfg: GammaStudyConfig) -> dict[str, Any]:
    cfg = quick(cfg, num_prompts=4, new_tokens=48)
    start(cfg)
    data = inputs(cfg)
    params = sampling(cfg, len(data.prompts), cfg.temperature)
    rows = []
    for g in cfg.gammas:
        llm = make_llm(cfg, data.target, method_config(cfg.method, g, data.draft), data.prompts, cfg.batch_size)
        llm.generate(data.prompts, params)
        rows.append(point(llm, g))
    out = out_dir(cfg, "gamma")
    fig = plot(rows, f"{cfg.method}, T={cfg.temperature:g}", out / "gamma.png")
    return finish(cfg, "gamma", out, data, rows, fig, method=cfg.method, temperature=cfg.temperature)


if __name__ == "__main__":
    main(run, GammaStudyConfig, sys.argv[1:])
