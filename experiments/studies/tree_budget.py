"""τ and speedup against the tree budget: draft-model token trees beside chains of the same size.

    python experiments/studies/tree_budget.py quick=true
    python experiments/studies/tree_budget.py 'budgets=[2,4,8,16,32]' top_k=4 depth=6
    python experiments/studies/tree_budget.py target=/ckpt/target draft=/ckpt/draft logger=none

At each budget n (draft nodes a request verifies per step: the target's
forward has n + 1 rows per request either way) the draft model drafts

- a **chain** of γ = n tokens (n one-token draft forwards), and
- an EAGLE-2 **dynamic tree** (:class:`~specdec.spec.tree.TreeConfig`,
  ``kind=dynamic``): ``depth`` levels of the ``top_k`` best frontier nodes'
  ``top_k`` children, the best n nodes by cumulative draft log-probability kept
  (``depth`` draft forwards, each ``top_k`` rows wide).

A tree spends the same verification rows on alternatives instead of depth:
τ per node is higher where the draft's top-1 is often wrong but its top-k
holds the target's choice. Figures per point (greedy outputs must equal
plain's, ``equal``): ``tau`` (tokens per target forward), ``speedup`` over
plain decoding (interleaved passes), ``accepted_length`` (mean accepted
drafts per step), ``tree_size`` (mean nodes per step) and
``per_depth`` (acceptance at each depth, given the path reached it).

Writes ``tree_budget.json``, ``tree_budget.png`` (τ and speedup against the
budget, chain and tree) into ``out=`` (default
``outputs/studies/tree_budget/<time>_<id>``) and a W&B run (``logger=none``: none).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.measure import outputs_equal
from specdec.spec.tree import TreeConfig
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
class TreeBudgetStudyConfig(StudyConfig):
    method: str = "draft_model"  # a registered method whose config has a `tree` field
    budgets: list[int] = field(default_factory=lambda: [2, 4, 8, 16])
    top_k: int = 4
    depth: int = 5
    temperature: float = 0.0


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for j, shape in enumerate(("chain", "tree")):
        pts = [r for r in rows if r["shape"] == shape]
        n = [r["budget"] for r in pts]
        a1.plot(n, [r["tau"] for r in pts], "o-", color=f"C{j}", label=shape)
        a2.plot(n, [r["speedup"] for r in pts], "o-", color=f"C{j}", label=shape)
    a1.set(ylabel="τ (tokens per target forward)", title="τ against the budget")
    a2.axhline(1.0, color="k", lw=0.8, ls="--")
    a2.set(ylabel="speedup vs plain", title="speedup against the budget")
    budgets = sorted({r["budget"] for r in rows})
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("draft nodes per request per step (chain: γ)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def run(cfg: TreeBudgetStudyConfig) -> dict[str, Any]:
    cfg = quick(cfg, num_prompts=4, new_tokens=32, budgets=[2, 4, 8], repeats=2)
    start(cfg)
    data = inputs(cfg)
    ps = data.prompts
    llms = {"plain": make_llm(cfg, data.target, None, ps, len(ps))}
    tree = TreeConfig(kind="dynamic", top_k=cfg.top_k, depth=cfg.depth)
    for n in cfg.budgets:
        llms[f"chain {n}"] = make_llm(cfg, data.target, method_config(cfg.method, n, data.draft), ps, len(ps))
        llms[f"tree {n}"] = make_llm(cfg, data.target, method_config(cfg.method, n, data.draft, tree=tree), ps,
                                     len(ps))
    timing = time_against_plain(llms, ps, sampling(cfg, len(ps), cfg.temperature), cfg.repeats)
    plain = [o.token_ids for o in timing.last("plain")]
    rows = []
    for n in cfg.budgets:
        for shape in ("chain", "tree"):
            k = f"{shape} {n}"
            c = llms[k].pipeline.stats().counts
            equal = outputs_equal([o.token_ids for o in timing.last(k)], plain) if cfg.temperature == 0 else None
            rows.append({"budget": n, "shape": shape, "speedup": timing.speedup(k), **counts_row(llms[k]),
                         "accepted_length": c.accepted_length, "tree_size": c.tree_size,
                         "per_depth": c.per_position, "equal": equal})
    out = out_dir(cfg, "tree_budget")
    fig = plot(rows, f"{cfg.method}: dynamic tree (top_k={cfg.top_k}, depth={cfg.depth}) vs chain, "
                     f"T={cfg.temperature:g}, {cfg.new_tokens} new tokens", out / "tree_budget.png")
    return finish(cfg, "tree_budget", out, data, rows, fig, top_k=cfg.top_k, depth=cfg.depth,
                  outputs_equal=all(r["equal"] for r in rows if r["equal"] is not None))


if __name__ == "__main__":
    main(run, TreeBudgetStudyConfig, sys.argv[1:])
