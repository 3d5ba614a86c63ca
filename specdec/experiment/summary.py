"""Run figures from ``results.jsonl`` records: the summary, per-request metrics, table rows.

Figures (τ, α, per-position acceptance) are defined in
:mod:`specdec.spec.metrics`; the analytic limit and efficiency in
:mod:`specdec.measure`; repetition in :func:`repetition`. Here speedup =
tokens/s with speculation ÷ tokens/s of plain decoding over the same
requests, batches and run; tokens/s of a pipeline = its output tokens ÷ the
summed wall time of its batches. A multi-turn request counts once, with the
tokens and time of all its turns.

Per category (a prompt's ``source``: Spec-Bench's ``category``), the same
figures over that category's requests: ``plain.by_category.<cat>`` =
:data:`PLAIN_CATEGORY_KEYS`, ``methods.<name>.by_category.<cat>`` =
:data:`CATEGORY_KEYS`; present when any request has a category (requests
without one count under :data:`NO_CATEGORY`).

Greedy equality is judged by each request's ``first_mismatch`` verdict (the run's
exactness policy, :mod:`specdec.spec.exactness`): ``outputs_equal`` is false on any
``mismatch``; outputs that differ only at a ``near_tie`` count in ``near_ties``
(per method and in all) and leave it true.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specdec.experiment.rundir import PLAIN, failed
from specdec.measure import ForwardTimes, efficiency, spec_limit
from specdec.spec.exactness import EQUAL, MISMATCH, NEAR_TIE
from specdec.spec.metrics import SpecCounts


CATEGORY_KEYS = ("requests", "tokens_per_s", "plain_tokens_per_s", "speedup", "tau", "alpha", "outputs_equal",
                 "errors")
PLAIN_CATEGORY_KEYS = ("requests", "tokens", "tokens_per_s", "errors")
NO_CATEGORY = "uncategorized"


def repetition(outputs: Iterable[Sequence[int]]) -> dict[str, float | None]:
    """How repetitive generated outputs (token id lists) are: ``{"loop_share", "distinct_4"}``.

    Degenerate loops (one line over and over) are easy to draft, so they raise
    τ and speedup while the text gets worse; a run reports them beside the
    speed figures (a multi-turn request's turns are separate outputs):

    - ``loop_share``: the share of outputs in which some 4-gram occurs at least
      4 times (occurrences may overlap); None over no output;
    - ``distinct_4``: distinct 4-grams / 4-grams, each output's counted within
      that output, summed over outputs (1.0: no 4-gram repeats inside any
      output; an output shorter than 4 tokens has none); None without a 4-gram.

    Runs keep :class:`Repetition` counts per output, which add up over
    requests, turns and resumed runs, and take the figures from their sum.
    """
    return sum((Repetition.of(o) for o in outputs), Repetition()).figures()


@dataclass
class Repetition:
    """The counts behind :func:`repetition`: per output, and summed over outputs."""

    outputs: int = 0
    looping: int = 0  # outputs with some N-gram occurring >= LOOP_COUNT times
    ngrams: int = 0
    distinct: int = 0  # distinct N-grams, each output's own

    N = 4
    LOOP_COUNT = 4

    @classmethod
    def of(cls, tokens: Sequence[int]) -> Repetition:
        """The counts of one output."""
        grams = Counter(tuple(tokens[i : i + cls.N]) for i in range(len(tokens) - cls.N + 1))
        looping = int(bool(grams) and max(grams.values()) >= cls.LOOP_COUNT)
        return cls(outputs=1, looping=looping, ngrams=sum(grams.values()), distinct=len(grams))

    def __add__(self, other: Repetition) -> Repetition:
        return Repetition(self.outputs + other.outputs, self.looping + other.looping,
                          self.ngrams + other.ngrams, self.distinct + other.distinct)

    def figures(self) -> dict[str, float | None]:
        return {"loop_share": self.looping / self.outputs if self.outputs else None,
                "distinct_4": self.distinct / self.ngrams if self.ngrams else None}


def _repetition_of(entries: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """The figures over the counts ``entries`` recorded (entries from before the counts existed: skipped)."""
    return sum((Repetition(**e["repetition"]) for e in entries if e.get("repetition")), Repetition()).figures()


def merge_counts(entries: Sequence[Mapping[str, Any]]) -> tuple[SpecCounts, bool]:
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


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _decode_rate(entries: Sequence[Mapping[str, Any]]) -> float | None:
    """Tokens/s after each request's first step (None: a record without decode timing)."""
    if not entries or any("decode_s" not in e for e in entries):
        return None
    t = sum(e["decode_s"] for e in entries)
    return sum(e["decode_tokens"] for e in entries) / t if t > 0 else None


def summarize(
    records: Sequence[Mapping[str, Any]],
    *,
    gammas: Mapping[str, int],
    greedy: bool,
    forward_times: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, Any]:
    """Run figures over ``records`` (results.jsonl lines): plain and per method, overall and per category.

    With ``forward_times`` (per method: the fields of
    :class:`specdec.measure.ForwardTimes`) each method also gets its analytic
    limit and efficiency = decode_speedup / limit (both defined in
    :mod:`specdec.spec.metrics`; None where records lack decode timing).
    """
    cats = _categories(records)
    plain = _plain_figures(records)
    if cats is not None:
        plain["by_category"] = {c: _pick(_plain_figures(rs), PLAIN_CATEGORY_KEYS) for c, rs in cats.items()}
    out: dict[str, Any] = {"plain": plain, "methods": {}}
    for name, gamma in gammas.items():
        m = out["methods"][name] = _method_figures(records, name, gamma, greedy, (forward_times or {}).get(name))
        if cats is not None:
            m["by_category"] = {c: _pick(_method_figures(rs, name, gamma, greedy, None), CATEGORY_KEYS)
                                for c, rs in cats.items()}
    eqs = [m["outputs_equal"] for m in out["methods"].values()]
    out["outputs_equal"] = False if False in eqs else (True if eqs and None not in eqs else None)
    out["near_ties"] = sum(m["near_ties"] for m in out["methods"].values())
    out["errors"] = sum(1 for r in records if failed(r))  # requests that failed in any pipeline
    return out


def _categories(records: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]] | None:
    """The records by category (``source``), in order of first appearance; None when no record has one."""
    if all(r.get("source") is None for r in records):
        return None
    cats: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        src = r.get("source")
        cats.setdefault(NO_CATEGORY if src is None else str(src), []).append(r)
    return cats


def _pick(figures: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    return {k: figures.get(k) for k in keys}


def _plain_figures(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    ok = [r[PLAIN] for r in records if not r[PLAIN].get("error")]
    return {**_throughput(ok), "errors": len(records) - len(ok), "repetition": _repetition_of(ok)}


def _method_figures(
    records: Sequence[Mapping[str, Any]],
    name: str,
    gamma: int,
    greedy: bool,
    forward_times: Mapping[str, float] | None,
) -> dict[str, Any]:
    """One method's figures over ``records``: speed against plain decoding of the same requests."""
    mine = [r["methods"][name] for r in records if name in r["methods"]]
    both = [r for r in records
            if not r[PLAIN].get("error") and name in r["methods"] and not r["methods"][name].get("error")]
    ents = [r["methods"][name] for r in both]
    thr = _throughput(ents)
    base = _throughput([r[PLAIN] for r in both])
    counts, has_hist = merge_counts(ents)
    n_eq = sum(1 for e in ents if e.get("equal_to_plain"))
    ties = [r for r in both if _verdict(r["methods"][name]) == NEAR_TIE]
    wrong = [r for r in both if _verdict(r["methods"][name]) == MISMATCH]
    taus = [e["tau"] for e in ents if e.get("tau") is not None]
    m = {
        "gamma": gamma,
        **thr,
        "plain_tokens_per_s": base["tokens_per_s"],
        "speedup": thr["tokens_per_s"] / base["tokens_per_s"] if thr["tokens_per_s"] and base["tokens_per_s"] else None,
        "decode_speedup": _ratio(_decode_rate(ents), _decode_rate([r[PLAIN] for r in both])),
        "tau": counts.tau if counts.steps else None,  # nothing measured (every request failed)
        "alpha": counts.alpha if counts.steps else None,
        "per_position_acceptance": counts.per_position,
        "reached": list(counts.reached),  # [γ] steps that verified draft position i (the per-position n)
        "accepted_at": list(counts.accepted_at),  # [γ] and accepted it
        "accepted_hist": list(counts.accepted_hist) if has_hist else None,
        "steps": counts.steps,
        "proposed": counts.proposed,
        "accepted": counts.accepted,
        "mean_request_tau": sum(taus) / len(taus) if taus else None,
        # equal only when every request was compared: a failed one (here or in plain) is not
        "outputs_equal": _all_equal(n_eq + len(ties), len(ents), len(mine)) if greedy else None,
        "num_equal": n_eq,
        "near_ties": len(ties) if greedy else 0,  # differing only where the target's top logits (near) tie
        # the first request (in run order) whose output differs from plain decoding's beyond a near
        # tie, and the first near tie: where, the target's margin there and the tie bound
        "first_mismatch": _first(wrong, name) if greedy else None,
        "first_near_tie": _first(ties, name) if greedy else None,
        "draft_time_s": sum(e.get("draft_time_s") or 0.0 for e in ents),
        "target_time_s": sum(e.get("target_time_s") or 0.0 for e in ents),
        "errors": sum(1 for e in mine if e.get("error")),
        "repetition": _repetition_of([e for e in mine if not e.get("error")]),
    }
    m.update(_step_time(ents))
    if forward_times:
        # One definition in every tool (measure.spec_limit): decode-phase τ of these requests,
        # S_plain from plain decoding's same requests (the decode speedup's baseline), C_spec
        # from the bare forwards timed by turns within the run's batches.
        m["analytic_limit"] = spec_limit(ForwardTimes.from_dict(forward_times), counts, ents,
                                         [[r[PLAIN] for r in both]])
        m["efficiency"] = efficiency(m["decode_speedup"], m["analytic_limit"])
        m["forward_times_s"] = dict(forward_times)
    return m


def _step_time(ents: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``step_time_ms``: ms per speculative step in each phase (spec/metrics.py PhaseTimes),
    and ``step_time_accounted``: the phases' share of the method's wall time."""
    ents = [e for e in ents if e.get("phase_s")]
    steps = sum(e["spec_steps"] for e in ents)
    if not ents or not steps:
        return {}
    phases = {p: 1e3 * sum(e["phase_s"][p] for e in ents) / steps for p in ents[0]["phase_s"]}
    wall = sum(e["time_share_s"] for e in ents)
    return {"step_time_ms": phases, "step_time_accounted": sum(phases.values()) * steps / 1e3 / wall if wall else None}


def _verdict(e: Mapping[str, Any]) -> str | None:
    """A compared entry's verdict (``equal``, ``near_tie``, ``mismatch``); None: not compared. A
    record from before verdicts (``first_mismatch`` a bare position, or unjudged) differs: mismatch."""
    if e.get("equal_to_plain") is None:
        return None
    if e["equal_to_plain"]:
        return EQUAL
    fm = e.get("first_mismatch")
    return fm.get("class", MISMATCH) if isinstance(fm, Mapping) else MISMATCH


def _first(records: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any] | None:
    """``{id, position, margin, bound}`` of the first of ``records``' ``name`` differences; None: none."""
    if not records:
        return None
    r = records[0]
    fm = r["methods"][name].get("first_mismatch")
    fm = fm if isinstance(fm, Mapping) else {"position": fm}
    return {"id": r["id"], **{k: fm.get(k) for k in ("position", "margin", "bound")}}


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
