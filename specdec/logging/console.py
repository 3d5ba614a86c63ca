"""Plain-text, aligned tables for the console and ``summary.txt``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _cell(v: Any, fmt: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, (int, float)) and fmt:
        return format(v, fmt)
    return str(v)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format spec). Text left-aligned, numbers right-aligned."""
    cells = [[_cell(r.get(k), f) for k, _, f in columns] for r in rows]
    headers = [h for _, h, _ in columns]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(r.get(k), (int, float)) or r.get(k) is None for r in rows) for k, _, _ in columns]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(vals, widths, numeric)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(c) for c in cells]
    return "\n".join(out)


SUMMARY_COLUMNS = (
    ("method", "method", ""),
    ("gamma", "γ", "d"),
    ("requests", "requests", "d"),
    ("tokens", "tokens", "d"),
    ("tokens_per_s", "tok/s", ".1f"),
    ("speedup", "speedup", ".2f"),
    ("decode_speedup", "decode ×", ".2f"),  # after each request's first step: what efficiency divides
    ("tau", "τ", ".2f"),
    ("alpha", "α", ".3f"),
    ("analytic_limit", "limit", ".2f"),
    ("efficiency", "efficiency", ".2f"),
    ("loop_share", "loops", ".2f"),
    ("outputs_equal", "equal", ""),
    ("errors", "errors", "d"),
)

STEP_COLUMNS = (  # the step-time breakdown (spec/metrics.py PhaseTimes), ms per speculative step
    ("method", "method", ""),
    ("step", "step ms", ".2f"),
    ("draft_prepare", "draft prep", ".2f"),
    ("target_prepare", "target prep", ".2f"),
    ("draft_catch_up", "catch-up", ".2f"),
    ("draft_steps", "draft steps", ".2f"),
    ("target_forward", "target fwd", ".2f"),
    ("verify", "verify", ".2f"),
    ("sync_commit", "sync+commit", ".2f"),
    ("prefill", "prefill", ".2f"),
    ("accounted", "accounted", ".3f"),
)

CATEGORY_COLUMNS = (
    ("category", "category", ""),
    ("method", "method", ""),
    ("requests", "requests", "d"),
    ("tokens_per_s", "tok/s", ".1f"),
    ("speedup", "speedup", ".2f"),
    ("tau", "τ", ".2f"),
    ("alpha", "α", ".3f"),
    ("outputs_equal", "equal", ""),
    ("errors", "errors", "d"),
)


def _plain_row(plain: Mapping[str, Any]) -> dict[str, Any]:
    """Plain decoding's figures as a method row: γ 0, speedup and τ 1 by definition."""
    return {"method": "plain", "gamma": 0, **plain, "speedup": 1.0 if plain.get("tokens_per_s") else None,
            "decode_speedup": None,
            "tau": 1.0, "alpha": None, "outputs_equal": None}


def _step_row(name: str, m: Mapping[str, Any]) -> dict[str, Any]:
    ph = m["step_time_ms"]
    return {"method": name, **ph, "step": sum(ph.values()), "sync_commit": ph.get("sync", 0.0) + ph.get("commit", 0.0),
            "accounted": m.get("step_time_accounted")}


def summary_table(summary: Mapping[str, Any]) -> str:
    """The run summary: one row for plain decoding and one per method; under it, when the
    prompts come in more than one category, the same figures per category (where a method
    wins differs by task: a mean over all of them hides it)."""
    plain = summary.get("plain", {})
    methods = summary.get("methods", {})
    rows = [_plain_row(plain)]
    for name, m in methods.items():
        rows.append({"method": name, **m})
    for r in rows:
        r["loop_share"] = (r.get("repetition") or {}).get("loop_share")
    table = format_table(rows, SUMMARY_COLUMNS)
    steps = [_step_row(name, m) for name, m in methods.items() if m.get("step_time_ms")]
    if steps:
        table += ("\n\nstep time (ms per speculative step; accounted: the phases' share of the wall time):\n"
                  + format_table(steps, STEP_COLUMNS))
    cats = plain.get("by_category") or {}
    if len(cats) < 2:
        return table
    cat_rows = []
    for cat, pc in cats.items():
        cat_rows.append({"category": cat, **_plain_row(pc)})
        for name, m in methods.items():
            cat_rows.append({"category": cat, "method": name, **(m.get("by_category") or {}).get(cat, {})})
    return table + "\n\nper category:\n" + format_table(cat_rows, CATEGORY_COLUMNS)
