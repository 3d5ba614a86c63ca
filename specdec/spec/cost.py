"""What one speculative step costs, defined once: the analytic limit
(:func:`specdec.spec.metrics.analytic_limit`), adaptive γ's choice
(:mod:`specdec.spec.gamma`) and the step-time breakdown
(:func:`specdec.measure.step_breakdown`) all charge a step with :func:`step_cost`.

A step costs at least the bare forwards it runs (seconds, host work left out):

    step_cost = T_target(rows) + forwards · T_draft

- ``rows``: tokens the target verifies per request (1 + the drafts it was given: a
  chain's γ, a tree's nodes, the tokens an n-gram lookup found, 0 in a plain step);
- ``T_target(n)``: the target's forward of ``n`` tokens per request (:func:`target_line`
  interpolates it between two measured points);
- ``forwards · T_draft``: the drafter's forwards as the step runs them, each ``T_draft``:
  a chain's γ (a compiled chain timed as one call, ``T_draft`` = that call ÷ γ), a dynamic
  tree's ``depth`` levels, Medusa's heads one pass (``T_draft`` = the pass ÷ its drafts),
  none for a model-free drafter (n-gram).
"""

from __future__ import annotations

from collections.abc import Callable


def target_line(t_1: float, t_n: float, n: int) -> Callable[[float], float]:
    """``T_target(rows)`` from the forwards of 1 and ``n`` tokens per request, linear between them.

    The measured curve is concave (a step up from 1 to 2 tokens, then about linear:
    :class:`specdec.spec.gamma.TargetCost`), so the line never charges more than the
    forward costs, and a mean of ``rows`` over steps is charged no more than the mean of
    those steps' forwards: the limit stays an upper bound."""
    if n < 1:
        raise ValueError(f"target_line: n must be >= 1 tokens per request, got {n}")

    def t(rows: float) -> float:
        if n == 1 or rows <= 1:
            return t_1
        return t_1 + (t_n - t_1) * (min(rows, n) - 1) / (n - 1)

    return t


def step_cost(rows: float, t_target: Callable[[float], float], *, draft_forwards: float = 0.0,
              t_draft: float = 0.0) -> float:
    """Bare seconds of one speculative step (module doc): the target's forward of ``rows``
    tokens per request plus ``draft_forwards`` drafter forwards of ``t_draft`` each."""
    return t_target(rows) + draft_forwards * t_draft
