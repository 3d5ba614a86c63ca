"""Run figures from ``results.jsonl`` records: the summary, per-request metrics, table rows.

Figures (τ, α, per-position acceptance) are defined in
:mod:`specdec.spec.metrics`; the analytic limit and efficiency in
:mod:`specdec.measure`. Here speedup = tokens/s with speculation ÷ tokens/s
of plain decoding over the same requests, batches and run; tokens/s of a
pipeline = its output tokens ÷ the summed wall time of its batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from specdec.experiment.rundir import PLAIN, failed
from specdec.measure import ForwardTimes, efficiency
from specdec.spec.metrics import SpecCounts


def _counts_from(entries: Sequence[Mapping[str, Any]]) -> tuple[SpecCounts, bool]:
    """The entries' counts merged, and whether every entry has its accepted-length histogram."""
    total = SpecCounts()
    has_hist = all(e.get("accepted_hist") is not None for e in entries)
    for e in entries:
        c = SpecCounts(steps=e.get("steps", 0), proposed=e.get("proposed", 0), accepted=e.get("accepted", 0),
                       bonus=e.get("bonus", 0), reached=list(e.get("reached", [])),
                       accepted_at=list(e.get("accepted_at", [])),
                       accepted_hist=list(e["accepted_hist"]) if has_hist else [])
        total.merge(c)
    return total, has_hist


def _throughput(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    tokens = sum(e["output_len"] for e in entries)
    t = sum(e["time_share_s"] for e in entries)
    return {"requests": len(entries), "tokens": tokens, "time_s": t, "tokens_per_s": tokens / t if t > 0 else None}


def summarize(
    records: Sequence[Mapping[str, Any]],
    *,
    gammas: Mapping[str, int],
    greedy: bool,
    forward_times: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, Any]:
    """Run figures over ``records`` (results.jsonl lines): plain and per method.

    With ``forward_times`` (per method: the fields of
    :class:`specdec.measure.ForwardTimes`) each method also gets its analytic
    limit and efficiency = speedup / limit.
    """
    ok = [r for r in records if not r[PLAIN].get("error")]
    out: dict[str, Any] = {"plain": {**_throughput([r[PLAIN] for r in ok]), "errors": len(records) - len(ok)},
                           "methods": {}}
    for name, gamma in gammas.items():
        mine = [r["methods"][name] for r in records if name in r["methods"]]
        both = [r for r in ok if name in r["methods"] and not r["methods"][name].get("error")]
        ents = [r["methods"][name] for r in both]
        thr = _throughput(ents)
        base = _throughput([r[PLAIN] for r in both])
        counts, has_hist = _counts_from(ents)
        n_eq = sum(1 for e in ents if e.get("equal_to_plain"))
        taus = [e["tau"] for e in ents if e.get("tau") is not None]
        m = out["methods"][name] = {
            "gamma": gamma,
            **thr,
            "plain_tokens_per_s": base["tokens_per_s"],
            "speedup": thr["tokens_per_s"] / base["tokens_per_s"]
            if thr["tokens_per_s"] and base["tokens_per_s"] else None,
            "tau": counts.tau if counts.steps else None,  # nothing measured (every request failed)
            "alpha": counts.alpha if counts.steps else None,
            "per_position_acceptance": counts.per_position,
            "accepted_hist": list(counts.accepted_hist) if has_hist else None,
            "steps": counts.steps,
            "proposed": counts.proposed,
            "accepted": counts.accepted,
            "mean_request_tau": sum(taus) / len(taus) if taus else None,
            # equal only when every request was compared: a failed one (here or in plain) is not
            "outputs_equal": _all_equal(n_eq, len(ents), len(mine)) if greedy else None,
            "num_equal": n_eq,
            "draft_time_s": sum(e.get("draft_time_s") or 0.0 for e in ents),
            "target_time_s": sum(e.get("target_time_s") or 0.0 for e in ents),
            "errors": sum(1 for e in mine if e.get("error")),
        }
        ft = (forward_times or {}).get(name)
        if ft and m["speedup"] and counts.steps:
            m["analytic_limit"] = ForwardTimes(**ft).limit(counts.tau, gamma)
            m["efficiency"] = efficiency(m["speedup"], m["analytic_limit"])
            m["forward_times_s"] = dict(ft)
    eqs = [m["outputs_equal"] for m in out["methods"].values()]
    out["outputs_equal"] = False if False in eqs else (True if eqs and None not in eqs else None)
    out["errors"] = sum(1 for r in records if failed(r))  # requests that failed in any pipeline
    return out


def _all_equal(n_equal: int, n_compared: int, n_requests: int) -> bool | None:
    """False on any mismatch; True when all ``n_requests`` were compared and equal; else None (unknown)."""
    if n_equal < n_compared:
        return False
    return True if n_requests and n_compared == n_requests else None


def request_metrics(rec: Mapping[str, Any]) -> dict[str, Any]:
    """One W&B step per request: flat numbers."""
    m: dict[str, Any] = {"request/prompt_len": rec["prompt_len"], "plain/tokens_per_s": rec[PLAIN].get("tokens_per_s"),
                         "plain/time_s": rec[PLAIN].get("time_s")}
    pt = rec[PLAIN].get("time_s")
    for name, e in rec["methods"].items():
        m[f"{name}/tau"] = e.get("tau")
        m[f"{name}/alpha"] = e.get("alpha")
        m[f"{name}/tokens_per_s"] = e.get("tokens_per_s")
        m[f"{name}/time_s"] = e.get("time_s")
        m[f"{name}/speedup"] = pt / e["time_s"] if pt and e.get("time_s") else None
        eq = e.get("equal_to_plain")  # None: not compared (a failed request)
        m[f"{name}/equal_to_plain"] = None if eq is None else int(eq)
    return {k: v for k, v in m.items() if v is not None}


TABLE_COLUMNS = ("id", "method", "gamma", "prompt_len", "output_len", "steps", "proposed", "accepted", "tau",
                 "alpha", "equal_to_plain", "time_s", "tokens_per_s", "finish_reason", "error")


def table_rows(records: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
    """One row per request and pipeline, in :data:`TABLE_COLUMNS` order."""
    rows = []
    for r in records:
        for name, e in [(PLAIN, r[PLAIN]), *r["methods"].items()]:
            row = {"id": r["id"], "method": name, "prompt_len": r["prompt_len"], "gamma": e.get("gamma", 0), **e}
            if name == PLAIN:
                row.update(steps=e["output_len"], tau=1.0, equal_to_plain=True)
            rows.append([row.get(c) for c in TABLE_COLUMNS])
    return rows
