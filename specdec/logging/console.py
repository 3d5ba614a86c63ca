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
    ("tau", "τ", ".2f"),
    ("alpha", "α", ".3f"),
    ("analytic_limit", "limit", ".2f"),
    ("efficiency", "efficiency", ".2f"),
    ("outputs_equal", "equal", ""),
    ("errors", "errors", "d"),
)


def summary_table(summary: Mapping[str, Any]) -> str:
    """The run summary as one row for plain decoding and one per method."""
    plain = summary.get("plain", {})
    rows = [{"method": "plain", "gamma": 0, "requests": plain.get("requests"), "tokens": plain.get("tokens"),
             "tokens_per_s": plain.get("tokens_per_s"), "speedup": 1.0 if plain.get("tokens_per_s") else None,
             "tau": 1.0, "alpha": None, "outputs_equal": None, "errors": plain.get("errors")}]
    for name, m in summary.get("methods", {}).items():
        rows.append({"method": name, **{k: m.get(k) for k, _, _ in SUMMARY_COLUMNS if k != "method"}})
    return format_table(rows, SUMMARY_COLUMNS)
