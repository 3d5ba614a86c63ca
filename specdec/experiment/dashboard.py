"""What a run shows on a dashboard (W&B): its labels and its run-level tables.

Labels make runs of different methods, settings and sweeps easy to find and
compare: a name that reads as the setting, the experiment as ``job_type``,
the sweep as ``group``, tags per method, γ, temperature, target and batch
size. The tables hold run-level figures only, one row per method (or method
and position, or method and category), each row carrying the run's setting
so that tables of several runs concatenated in W&B still say which is which.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.experiment.rundir import PLAIN
from specdec.experiment.summary import CATEGORY_KEYS


@dataclass(frozen=True)
class RunLabels:
    """How a run is named and filed on the dashboard (see :func:`run_labels`)."""

    name: str
    tags: tuple[str, ...]
    group: str | None
    job_type: str
    notes: str | None


def _num(x: float) -> str:
    return f"{x:g}"


def run_labels(*, experiment: str, target: str, gammas: Mapping[str, int], temperature: float, batch_size: int,
               adaptive: Sequence[str] = (), overrides: str | None = None, sweep: str | None = None) -> RunLabels:
    """Name, tags, group, job type and notes of a run.

    ``gammas``: method -> γ (empty: plain decoding only); ``adaptive``: the methods
    with adaptive γ; ``overrides``: Hydra's override string (kept in the notes);
    ``sweep``: the multirun's dir name (the group: every job of one sweep together)."""
    target_name = Path(str(target)).name or str(target)
    methods = "+".join(gammas) or "plain"
    gamma = "/".join(dict.fromkeys(str(g) for g in gammas.values()))
    name = f"{experiment} · {methods}" + (f" · γ={gamma}" if gamma else "")
    name += f" · T={_num(temperature)} · bs={batch_size} · {target_name}"
    tags = [f"exp:{experiment}", f"target:{target_name}", *(f"method:{m}" for m in gammas or [PLAIN]),
            *(f"gamma:{g}" for g in dict.fromkeys(gammas.values())), f"T:{_num(temperature)}",
            "greedy" if temperature == 0 else "sampled", f"batch:{batch_size}",
            *(["adaptive-gamma"] if adaptive else []), *(["sweep"] if sweep else [])]
    return RunLabels(name=name, tags=tuple(dict.fromkeys(tags)), group=f"{experiment}-{sweep}" if sweep else None,
                     job_type=experiment, notes=f"overrides: {overrides}" if overrides else None)


def _setting(summary: Mapping[str, Any]) -> dict[str, Any]:
    return {"target": Path(str(summary.get("target") or "")).name or None,
            "temperature": (summary.get("sampling") or {}).get("temperature"),
            "batch_size": summary.get("batch_size"), "num_prompts": summary.get("num_prompts")}


METHOD_COLUMNS = ("method", "gamma", "target", "temperature", "batch_size", "num_prompts", "requests", "tokens",
                  "tokens_per_s", "plain_tokens_per_s", "speedup", "tau", "alpha", "analytic_limit", "efficiency",
                  "outputs_equal", "errors")


def method_rows(summary: Mapping[str, Any]) -> list[list[Any]]:
    """One row for plain decoding and one per method, in :data:`METHOD_COLUMNS` order."""
    setting = _setting(summary)
    plain = summary.get("plain") or {}
    rows = [{"method": PLAIN, "gamma": 0, **setting, **plain, "plain_tokens_per_s": plain.get("tokens_per_s"),
             "speedup": 1.0 if plain.get("tokens_per_s") else None, "tau": 1.0}]
    for name, m in (summary.get("methods") or {}).items():
        rows.append({**m, "method": name, **setting})
    return [[r.get(c) for c in METHOD_COLUMNS] for r in rows]


POSITION_COLUMNS = ("method", "gamma", "position", "reached", "accepted", "acceptance", "ci95_low", "ci95_high")


def position_rows(summary: Mapping[str, Any]) -> list[list[Any]]:
    """Per method and draft position: times reached and accepted, the rate and its 95% Wilson interval.

    A position never reached has no rate and no row; without counts in the
    summary, rows carry the rate alone."""
    from specdec.plots import position_counts, wilson_interval  # matplotlib: only when a run logs

    rows = []
    for name, m in (summary.get("methods") or {}).items():
        pp = m.get("per_position_acceptance") or []
        counts = position_counts(m)
        for i, p in enumerate(pp):
            if counts is None:
                rows.append([name, m.get("gamma"), i + 1, None, None, p, None, None])
                continue
            k, n = counts[i]
            if n:
                lo, hi = wilson_interval(k, n)
                rows.append([name, m.get("gamma"), i + 1, n, k, k / n, lo, hi])
    return rows


CATEGORY_COLUMNS = ("method", "category", *CATEGORY_KEYS)


def category_rows(summary: Mapping[str, Any]) -> list[list[Any]]:
    """Per pipeline and prompt category (``plain.by_category``, ``methods.<m>.by_category``), in
    :data:`CATEGORY_COLUMNS` order; plain decoding's rows are the baseline (τ = speedup = 1)."""
    rows = []
    for cat, f in sorted(((summary.get("plain") or {}).get("by_category") or {}).items()):
        f = f or {}
        base = {"plain_tokens_per_s": f.get("tokens_per_s"), "speedup": 1.0 if f.get("tokens_per_s") else None,
                "tau": 1.0}
        rows.append([PLAIN, cat, *({**f, **base}.get(k) for k in CATEGORY_KEYS)])
    for name, m in (summary.get("methods") or {}).items():
        for cat, f in sorted((m.get("by_category") or {}).items()):
            rows.append([name, cat, *((f or {}).get(k) for k in CATEGORY_KEYS)])
    return rows
