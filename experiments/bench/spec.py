"""Speculative decoding against our own plain decoding, per proposer and γ.

    python experiments/bench/spec.py quick=true
    python experiments/bench/spec.py batch_size=4 gammas=[1,2,4,8] 'proposers=[ngram]'
    python experiments/bench/spec.py batch_size=8 gammas=[4] 'trees=[]' adaptive_gamma=true

``adaptive_gamma=true``: every run picks its γ per step, 0 … the row's γ, by the cost
model (:mod:`specdec.spec.gamma`; τ counts its plain steps too).

For each proposer (any registered one, by name) and γ: τ, α, tokens/s,
speedup over our plain decoding of the same target (same prompts, same batch
size, passes timed side by side by turns; ``speedup`` whole requests, ``decode_speedup`` after
each request's first step) and efficiency = decode_speedup / analytic limit
(defined in :mod:`specdec.spec.metrics`, as for every tool: τ · plain decoding's
measured decode step / the speculative step's bare cost), the bare forward times
of the method's own models timed by turns in the same passes
(:func:`specdec.measure.limit_runs`), each for as many requests at once as a pass's
step has (``batch_size``, at most the prompts): the ``T_t(1)``, ``T_t(γ+1)`` and ``T_d(1)``
columns are forwards of that batch. Last line (JSON): ``efficiency_batch1``
(of the fastest proposer/γ at batch 1), ``best``, the best ``speedup`` and its
``tau`` per proposer, ``at_gamma4`` (τ, speedup and efficiency of every
proposer at γ = 4, the issue goals' operating point), ``outputs_equal`` (every
greedy output matched plain decoding, up to near ties on a GPU), ``near_ties``
(outputs that differ only at a near tie of the target's logits:
:func:`specdec.measure.judge_outputs`) and the ``machine``.

Token trees: every proposer in ``trees`` also runs as ``<name>_tree`` with a
node budget (the method's γ for a tree) of each value of ``tree_budgets``: an
EAGLE-2-style dynamic tree (``tree_top_k``, ``tree_depth``) for a config with
a ``tree`` field, the static tree ``static_tree_choices`` (cut to the budget;
by default the heads' own list from their manifest) for those in
``static_trees`` (Medusa), and ``ngram_branches`` branches under
the root for n-gram (a config with ``branches``). Those rows sit
beside the chains (``best``, ``speedup``, ``tau`` name them ``<name>_tree``);
``tree_budget`` in the JSON gives τ, speedup, mean tree size and accepted
length per step against the budget; ``tree_vs_chain`` compares, per drafter,
its best tree with its best chain (best τ of each and their ratio, best
speedup of each: the issue's goal is τ ratio >= 1.15 and a higher speedup). The
analytic limit charges each run what its step runs (:func:`specdec.measure.step_shape`):
a dynamic tree its ``tree_depth`` draft forwards, Medusa its one pass of the heads,
n-gram no forward and only the rows its lookups found; ``efficiency_max`` in the JSON
is the largest efficiency of any run (≤ 1 up to noise; null if any is missing).

Step time: a second table splits each run's speculative step into its phases
(:func:`specdec.measure.step_breakdown`: host packing, the drafter's catch-up
and other forwards, the target's forward, verification, sync and commit), in
ms per step beside the step's bare cost (the limit's C_spec) for each (and, for the
γ = 4 chains, ``after_draft``: the bare verification forward timed right after
the drafter drafted, what the loop's forward costs once the drafter's reads
have evicted some of the target's weights from the CPU's caches, and
``drafting_after_target``: the step's bare drafting timed right after a bare
verification forward, the same the other way round); the JSON gives
them for γ = 4 (``step_breakdown``), ``accounted_min`` (the smallest share of a
pass's wall time the phases account for) and ``plain_step_vs_bare`` (the limit's
S_plain, plain decoding's decode-phase step in its loop, over its bare forward T_target(1)).

Drafters that take a checkpoint get the shipped one for the built-in target
(``specdec/zoo/code-draft``, ``code-eagle``, ``code-eagle3`` …; a proposer
without one is skipped, saying so) or, on a random target, a random one.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional  # noqa: UP035 (OmegaConf reads typing generics)

import torch

from specdec.api import LLM
from specdec.conf_schema import zoo_drafter
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig
from specdec.measure import (
    Run,
    breakdown_row,
    builtin_pair,
    builtin_prompts,
    checkpoint,
    efficiency,
    emit_json,
    limit_from,
    limit_runs,
    limit_context,
    lockstep,
    pass_limit,
    plain_step_s,
    load_config,
    judge_outputs,
    print_table,
    step_breakdown,
    random_head,
    with_room_for_bare,
)
from specdec.spec.proposers import ProposerConfig, config_class


@dataclass
class SpecBenchConfig:
    quick: bool = False
    target: str = "builtin"  # "builtin", "random" or a checkpoint dir
    draft: str = "builtin"  # the `path` of proposers that take one: "builtin", "random" or a checkpoint dir
    proposers: list[str] = field(default_factory=lambda: ["draft_model", "ngram", "eagle", "eagle3", "medusa"])
    gammas: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    num_prompts: int = 8
    new_tokens: int = 64
    batch_size: int = 1
    repeats: int = 3
    threads: int = 2
    device: str = "cpu"  # cuda: see gpu.sh
    compile: bool = False  # runtime.compile for every pipeline
    # Every proposer picks its γ (0 … the row's γ) per step by the cost model (specdec/spec/gamma.py).
    adaptive_gamma: bool = False
    # also run as <name>_tree: eagle_tree, eagle3_tree, draft_model_tree (dynamic), medusa_tree (static), ngram_tree
    trees: list[str] = field(default_factory=lambda: ["draft_model", "eagle", "eagle3", "medusa", "ngram"])
    # Nodes per request per step. 8 verifies as many rows as the longest chain (γ = 8); the
    # larger budgets buy τ with rows, which a CPU does not verify for free.
    tree_budgets: list[int] = field(default_factory=lambda: [8, 16, 32])
    tree_top_k: int = 3
    # As deep as the longest chain (γ = 8), so a tree's τ is not capped below the chain's:
    # on the built-in pair EAGLE-3's chain keeps ~0.9 of its drafts at each position.
    tree_depth: int = 8
    static_trees: list[str] = field(default_factory=lambda: ["medusa"])  # these draft static_tree_choices
    # Medusa-style choices (paths of top-k ranks), parents first, likeliest first: a budget keeps a prefix.
    # None: the drafter's own list (Medusa heads trained here ship one, measured on held-out text).
    static_tree_choices: Optional[list[list[int]]] = None
    ngram_branches: int = 3  # ngram_tree: followers of the matched n-gram drafted as branches


def inputs(cfg: SpecBenchConfig) -> tuple[Path, Path, list[list[int]]]:
    """(target, draft, prompts): the shipped pair and prompts, or random checkpoints and repetitive prompts."""
    pair = builtin_pair() if cfg.target == "builtin" else None
    target = checkpoint(cfg.target, pair and pair[0], layers=6)
    draft = checkpoint(cfg.draft, pair and pair[1], layers=1, seed=1)
    prompts = builtin_prompts(target, cfg.num_prompts) if pair else None
    if prompts is None:
        g = torch.Generator().manual_seed(0)
        # Repetitive prompts give n-gram lookup something to find.
        prompts = [(torch.randint(3, 200, (16,), generator=g).tolist() * 4) for _ in range(cfg.num_prompts)]
    return target, draft, prompts


def drafter_path(name: str, cfg: SpecBenchConfig, target: Path, draft: Path) -> Path | None:
    """The checkpoint proposer ``name`` drafts with (None: it takes none, or none is shipped)."""
    if not any(f.name == "path" for f in dataclasses.fields(config_class(name))):
        return None
    if name == "draft_model":
        return draft
    if cfg.target == "builtin" and builtin_pair() is not None:
        return zoo_drafter(name)
    return random_head(target, name) if name in ("eagle", "eagle3") else None


TREE_SUFFIX = "_tree"


def has_field(name: str, f: str) -> bool:
    return any(x.name == f for x in dataclasses.fields(config_class(name)))


def method(name: str, gamma: int, path: Path | None, cfg: SpecBenchConfig | None = None) -> ProposerConfig:
    """Proposer ``name``'s config at γ (with ``path`` when it takes a checkpoint);
    ``<name>_tree``: ``name`` drafting a tree of γ nodes (module doc)."""
    cfg = cfg or SpecBenchConfig()
    extra: dict[str, Any] = {"path": str(path)} if path else {}
    if name.endswith(TREE_SUFFIX):
        from specdec.spec.tree import TreeConfig

        name = name[: -len(TREE_SUFFIX)]
        if has_field(name, "branches"):
            extra["branches"] = cfg.ngram_branches
        elif name in cfg.static_trees:
            extra["tree"] = TreeConfig(kind="static", choices=cfg.static_tree_choices)
        else:
            extra["tree"] = TreeConfig(kind="dynamic", top_k=cfg.tree_top_k, depth=cfg.tree_depth)
    if cfg.adaptive_gamma:
        extra["adaptive_gamma"] = True
    return config_class(name)(num_speculative_tokens=gamma, **extra)


def main(argv: list[str]) -> None:
    cfg = load_config(SpecBenchConfig, argv)
    torch.set_num_threads(cfg.threads)
    if cfg.quick:
        cfg.repeats, cfg.num_prompts, cfg.new_tokens, cfg.gammas = 1, 8, 64, [1, 2, 4, 8]
    target, draft, prompts = inputs(cfg)
    max_len = max(len(p) for p in prompts) + cfg.new_tokens + 16
    runtime = with_room_for_bare(RuntimeConfig(max_batch_size=cfg.batch_size, max_seq_len=max_len, device=cfg.device,
                                               compile=cfg.compile, threads=cfg.threads))
    engine_cfg = EngineConfig(max_batch_size=cfg.batch_size)
    sp = SamplingParams(max_new_tokens=cfg.new_tokens, ignore_eos=True)
    # Eager: one whole request. Compiled: a whole untimed pass, so that every graph kind the
    # timed passes meet (mask kinds, the full γ's fused steps, shorter last steps) compiles there.
    warm = SamplingParams(max_new_tokens=cfg.new_tokens, ignore_eos=True)
    warm_prompts = prompts if cfg.compile else prompts[:1]

    paths = {n: drafter_path(n, cfg, target, draft) for n in cfg.proposers}
    takes_path = {n for n in cfg.proposers if any(f.name == "path" for f in dataclasses.fields(config_class(n)))}
    for n in sorted(n for n in takes_path if paths[n] is None):
        print(f"skipping {n}: no checkpoint for it here (specdec/zoo has none for this target)")
    names = [n for n in cfg.proposers if n not in takes_path or paths[n] is not None]
    grid = {f"{n} γ={g}": (n, g) for n in names for g in cfg.gammas}
    tree_names = [n for n in names if n in cfg.trees and (has_field(n, "tree") or has_field(n, "branches"))]
    grid |= {f"{n}{TREE_SUFFIX} γ={g}": (n + TREE_SUFFIX, g) for n in tree_names for g in cfg.tree_budgets}
    for n in names:
        paths[n + TREE_SUFFIX] = paths[n]
    llms = {"plain": LLM(target, runtime=runtime, engine_config=engine_cfg)}
    llms |= {k: LLM(target, method=method(n, g, paths[n], cfg), runtime=runtime, engine_config=engine_cfg)
             for k, (n, g) in grid.items()}
    runs = {k: Run(lambda llm=llm: llm.generate(prompts, sp), warmup=lambda llm=llm: llm.generate(warm_prompts, warm),
                   before=llm.pipeline.reset_stats,
                   steps=lambda clock, llm=llm: llm.generate_steps(prompts, sp, clock=clock))
             for k, llm in llms.items()}
    # Bare forward times at the mean decode context and the passes' batch, for the analytic
    # limit, timed by turns in the same passes (measure.limit_runs). The γ = 4 chains (the
    # JSON's breakdown) also time the verification right after their drafter drafted.
    ctx_len = limit_context([len(p) for p in prompts], cfg.new_tokens)
    at4 = [k for k, (n, g) in grid.items() if g == 4 and not n.endswith(TREE_SUFFIX)]
    runs |= limit_runs({k: llms[k] for k in grid}, ctx_len, requests=min(cfg.batch_size, len(prompts)),
                       after_other=at4)
    timing = lockstep(runs, baseline="plain", repeats=cfg.repeats)
    bare = limit_from(timing, {k: llms[k] for k in grid})
    plain_ids = [o.token_ids for o in timing.last("plain")]
    n_tokens = sum(len(ids) for ids in plain_ids)

    rows, breakdown = [], {}
    for key, (name, g) in grid.items():
        stats = llms[key].pipeline.stats()  # the last timed pass's
        counts = stats.counts
        speedup = timing.speedup(key)
        decode_speedup = timing.decode_speedup(key)
        bt = bare[key]
        limit = pass_limit(timing, key, bt, counts)
        judged = judge_outputs([o.token_ids for o in timing.last(key)], plain_ids, prompts,
                               llms["plain"].pipeline.target)  # type: ignore[attr-defined]
        breakdown[key] = step_breakdown(stats, timing.times[key][-1], bt)
        rows.append({"proposer": name, "gamma": g, "tau": counts.tau, "alpha": counts.alpha,
                     "accepted_len": counts.accepted_length, "tree_size": counts.tree_size,
                     "tok_s": n_tokens / timing.median(key), "speedup": speedup, "decode_speedup": decode_speedup,
                     "T_t(1)_ms": _ms(bt.t_target_1), "T_t(γ+1)_ms": _ms(bt.t_target_g1),
                     "T_d(1)_ms": _ms(bt.t_draft_1), "limit": limit,
                     "efficiency": efficiency(decode_speedup, limit),
                     "equal": judged["equal"], "near_ties": judged["near_ties"]})
    # The limit's S_plain (plain decoding's decode-phase step, median over its passes) over its bare T(1).
    plain_step_ms = statistics.median(plain_step_s(o) or float("nan") for o in timing.outputs["plain"]) * 1e3
    t1_ms = statistics.median(b.t_target_1 for b in bare.values()) * 1e3
    print_table([{"method": "plain", "tok_s": n_tokens / timing.median("plain"), "step_ms": plain_step_ms,
                  "bare T_t(1)_ms": t1_ms, "step / bare": plain_step_ms / t1_ms}],
                f"plain decoding, batch {cfg.batch_size}, {target}")
    print_table(rows, f"speculation, batch {cfg.batch_size}, {len(prompts)} prompts x {cfg.new_tokens} tokens, "
                f"{cfg.repeats} passes side by side (tok_s: median; speedup: median of per-pass ratios)")
    print_table([breakdown_row(k, b) for k, b in breakdown.items()],
                "step time, ms per speculative step in the loop (bare: the step's bare cost, the limit's C_spec), "
                "last timed pass; accounted = the phases' share of its wall time")
    best = max(rows, key=lambda r: r["speedup"])
    effs = [r["efficiency"] for r in rows]
    best_by: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["proposer"] not in best_by or r["speedup"] > best_by[r["proposer"]]["speedup"]:
            best_by[r["proposer"]] = r
    emit_json({
        f"efficiency_batch{cfg.batch_size}": _round(best["efficiency"], 4),
        # every run's: the limit is an upper bound, so none should pass 1 by more than the noise
        "efficiency_max": None if None in effs else round(max(effs), 4),
        "best": f"{best['proposer']} gamma={best['gamma']}",
        "speedup": {p: round(r["speedup"], 3) for p, r in best_by.items()},
        "tau": {p: round(r["tau"], 3) for p, r in best_by.items()},
        "at_gamma4": {r["proposer"]: {"tau": round(r["tau"], 3), "speedup": round(r["speedup"], 3),
                                      "decode_speedup": round(r["decode_speedup"], 3),
                                      "limit": _round(r["limit"]), "efficiency": _round(r["efficiency"])}
                      for r in rows if r["gamma"] == 4},
        "tree_budget": {p: {str(r["gamma"]): {"tau": round(r["tau"], 3), "speedup": round(r["speedup"], 3),
                                              "tree_size": round(r["tree_size"], 2),
                                              "accepted_length": round(r["accepted_len"], 3)}
                            for r in rows if r["proposer"] == p}
                        for p in dict.fromkeys(r["proposer"] for r in rows if r["proposer"].endswith(TREE_SUFFIX))},
        "tree_vs_chain": tree_vs_chain(rows),
        "plain_step_vs_bare": round(plain_step_ms / t1_ms, 3),
        "step_breakdown": {k: {**{f: round(b[f], 3) for f in ("step_ms", "bare_step_ms", "outside_ms", "accounted",
                                                             "target_forward_after_draft_ms",
                                                             "drafting_after_target_ms") if b.get(f) is not None},
                               "phases": b["phases"]} for k, b in breakdown.items() if grid[k][1] == 4},
        "accounted_min": round(min(b["accounted"] for b in breakdown.values()), 4),
        "outputs_equal": all(r["equal"] for r in rows),
        # outputs that differ from plain decoding only at a near tie of the target's logits (a GPU's
        # rounding; on CPU strict, so none: specdec/spec/exactness.py)
        "near_ties": sum(r["near_ties"] for r in rows),
    })


def _ms(seconds: float | None) -> float | None:
    """Seconds in ms; None (not timed) stays None."""
    return None if seconds is None else seconds * 1e3


def _round(x: float | None, digits: int = 3) -> float | None:
    """``x`` rounded; None (a figure not measured) stays None."""
    return None if x is None else round(x, digits)


def tree_vs_chain(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per drafter with both: best τ and best speedup of its trees and of its chains."""
    out = {}
    for p in dict.fromkeys(r["proposer"] for r in rows):
        if not p.endswith(TREE_SUFFIX):
            continue
        chain = [r for r in rows if r["proposer"] == p[: -len(TREE_SUFFIX)]]
        tree = [r for r in rows if r["proposer"] == p]
        if not chain:
            continue
        ct, tt = max(r["tau"] for r in chain), max(r["tau"] for r in tree)
        out[p] = {"best_chain_tau": round(ct, 3), "best_tree_tau": round(tt, 3),
                  "tau_ratio": round(tt / ct, 3) if ct else 0.0,
                  "best_chain_speedup": round(max(r["speedup"] for r in chain), 3),
                  "best_tree_speedup": round(max(r["speedup"] for r in tree), 3)}
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
