"""The one cost model of a speculative step (specdec/spec/cost.py) and the analytic limit
built on it (specdec/spec/metrics.py): an upper bound by construction, and missing
figures reported missing (the same limit in every tool: tests/test_limit_tools.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specdec.experiment import summarize
from specdec.measure import ForwardTimes, efficiency
from specdec.spec.cost import step_cost, target_line

# Bare: the target's forward 10 ms for 1 token, 20 ms for 5; a drafter forward 1 ms.
# Plain decoding's step in its loop: 10 ms forward + 5 ms host work.
S_PLAIN = 0.015
BARE = ForwardTimes(t_target_1=0.010, t_target_g1=0.020, t_draft_1=0.001, max_rows=5, draft_forwards=4,
                    max_drafts=4)
C_SPEC = 0.024  # a full γ = 4 chain step: T_t(5) + 4 T_d(1)


def _records(spec_step_s: float, *, requests: int = 2, decode_steps: int = 10, tau: int = 3) -> list[dict]:
    """results.jsonl records of plain decoding and method ``m`` (γ 4, 4 drafts a step), whose
    decode steps take ``S_PLAIN`` and ``spec_step_s`` each: one first step, then
    ``decode_steps`` steps of ``tau`` tokens."""
    tokens = 1 + decode_steps * tau
    steps = 1 + decode_steps
    return [{
        "id": f"r{i}", "prompt_len": 3,
        "plain": {"output_len": tokens, "time_share_s": 0.1 + tokens * S_PLAIN, "error": None,
                  "decode_s": (tokens - 1) * S_PLAIN, "decode_tokens": tokens - 1},
        "methods": {"m": {"output_len": tokens, "time_share_s": 0.1 + decode_steps * spec_step_s, "error": None,
                          "steps": steps, "proposed": 4 * steps, "accepted": tokens - steps, "bonus": steps,
                          "equal_to_plain": True, "decode_s": decode_steps * spec_step_s,
                          "decode_tokens": tokens - 1}},
    } for i in range(requests)]


def _method(records: list[dict], times: ForwardTimes = BARE) -> dict:
    return summarize(records, gammas={"m": 4}, greedy=True, forward_times={"m": vars(times)})["methods"]["m"]


def test_a_step_that_costs_only_its_bare_forwards_reaches_the_limit_exactly() -> None:
    """limit = τ · S_plain / C_spec: a speculative step with no host work (it costs exactly
    C_spec) has efficiency 1, one with host work less; plain decoding's own host work is in
    S_plain, so speculation saving it does not push efficiency past 1."""
    ideal = _method(_records(C_SPEC))
    assert ideal["decode_speedup"] == pytest.approx(3 * S_PLAIN / C_SPEC)
    assert ideal["analytic_limit"] == pytest.approx(3 * S_PLAIN / C_SPEC)  # decode-phase τ = 3
    assert ideal["efficiency"] == pytest.approx(1.0)
    real = _method(_records(C_SPEC + 0.006))  # 6 ms of host work a step
    assert real["analytic_limit"] == pytest.approx(ideal["analytic_limit"])
    assert real["efficiency"] == pytest.approx(C_SPEC / (C_SPEC + 0.006))


def test_missing_figures_leave_limit_and_efficiency_missing() -> None:
    recs = _records(C_SPEC)
    for r in recs:  # records without decode timing: no decode-phase speedup or τ
        for e in (r["methods"]["m"], r["plain"]):
            del e["decode_s"], e["decode_tokens"]
    m = _method(recs)
    assert m["speedup"] is not None  # the whole-request speedup is there ...
    assert m["decode_speedup"] is None and m["analytic_limit"] is None
    assert m["efficiency"] is None  # ... but efficiency does not fall back to it
    # Bare times without the step's shape (an old forward_times.json), or with a forward
    # that was never timed: no limit, not one from the other figures.
    old = _method(_records(C_SPEC), ForwardTimes(t_target_1=0.010, t_target_g1=0.020, t_draft_1=0.001))
    assert old["analytic_limit"] is None and old["efficiency"] is None
    for missing in ("t_target_1", "t_target_g1", "t_draft_1"):
        m = _method(_records(C_SPEC), replace(BARE, **{missing: None}))
        assert m["analytic_limit"] is None and m["efficiency"] is None, missing
    # Plain decoding's side without decode timing: no S_plain, so no limit.
    recs = _records(C_SPEC)
    for r in recs:
        del r["plain"]["decode_s"], r["plain"]["decode_tokens"]
    assert _method(recs)["analytic_limit"] is None
    assert efficiency(1.5, None) is None and efficiency(None, 2.0) is None


def test_the_step_cost_charges_what_each_method_runs() -> None:
    line = target_line(0.010, 0.020, 5)
    # A chain at full γ: T_t(γ+1) and γ draft forwards (a fused chain: its call ÷ γ each).
    assert BARE.step_s(4) == pytest.approx(step_cost(5, line, draft_forwards=4, t_draft=0.001)) == C_SPEC
    # n-gram: no model, and only the rows its lookups found (2 of 4 drafts a step on average).
    ngram = ForwardTimes(t_target_1=0.010, t_target_g1=0.020, max_rows=5, draft_forwards=4, max_drafts=4)
    assert ngram.step_s(2) == pytest.approx(0.015)
    # Medusa: its heads' one pass (4 ms) ÷ its drafts per step, γ = 8 with 4 heads: one pass.
    medusa = ForwardTimes(t_target_1=0.010, t_target_g1=0.030, t_draft_1=0.001, max_rows=9, draft_forwards=4,
                          max_drafts=4)
    assert medusa.step_s(4) == pytest.approx(0.010 + 0.020 * 4 / 8 + 0.004)
    # A dynamic tree of 8 nodes, 3 levels deep: 9 rows verified, 3 draft forwards.
    tree = ForwardTimes(t_target_1=0.010, t_target_g1=0.030, t_draft_1=0.001, max_rows=9, draft_forwards=3,
                        max_drafts=8)
    assert tree.step_s(8) == pytest.approx(0.033)
    # The line from 1 to n tokens never charges more than the forward costs (the curve is
    # concave: a step up from 1 to 2 tokens, then linear), so the limit stays an upper bound.
    assert line(2) == pytest.approx(0.0125) and line(1) == 0.010 and line(9) == 0.020
