"""How many tokens to draft this step: fixed, or chosen to pay off.

:class:`AdaptiveGamma` picks the step's γ (0 … the method's γ) that maximises
expected tokens per second for the batch at hand:

    E[tokens](γ) = Σ_r (1 - a_r^(γ+1)) / (1 - a_r)      # a_r: request r's running acceptance
    cost(γ)      = T_target(B, γ+1) + γ · T_draft(B)    # specdec.spec.cost.step_cost

``T_target(B, n)`` is a forward of ``B`` requests feeding ``n`` tokens each (measured at
``n`` = 1, 2 and γ + 1: a step from 1 to 2, then about linear, :class:`TargetCost`) and
``T_draft(B)`` one drafting forward of ``B`` requests (at the method's full γ, what
a draft costs there: a compiled drafter runs those steps as one graph), both timed as they run:
``B`` contexts read, not one request of ``B · n`` tokens (which underrated a
batch-64 step enough that speculation switched on there and lost 9%).
γ = 0 is plain decoding (B tokens for T_target(B, 1)), so speculation is turned
off where it cannot pay: large batches (the target is compute-bound and
verifying γ+1 tokens per request costs nearly γ+1 times more) or low
acceptance. ``a_r`` is the request's acceptance per draft so far, accepted /
tried: a step that accepts ``k`` of its γ drafts tried ``k + 1`` of them (the
first rejected one), or ``γ`` if all were accepted, so the estimate is the
maximum-likelihood one of the geometric model above. (Accepted / proposed
is biased low: at a = 0.85 and γ = 4 it reads 0.68, and the policy then
drafts too little.) It has a prior worth ``prior_weight`` drafts: the
drafter's acceptance over every request the pipeline has verified (itself
starting from ``prior_accept``). Forward times come from a short
calibration on first use, interpolated linearly between measured points.

Exploration: the estimate must come from the drafter, not from the prior. A
prior that is too low picks γ = 0, and a pipeline that never drafts never
learns better (on the built-in pair, compiled, the prior 0.6 predicted no
gain for a drafter that accepts 0.8 and doubles nothing: speculation stayed
off and ran 5% *slower* than plain decoding). So until ``explore_tokens``
drafts have been verified, pipeline-wide, a step the model would run plain
drafts the method's γ instead (:func:`explore`). That is once per pipeline,
not per request: a few steps at most. It must also be long enough: a plain
step adds no evidence, and at batch 1 every new request starts from the same
pipeline-wide estimate, so exploration that ends on a low one turns
speculation off for the rest of the run. 32 drafts left it ±0.09 (one
standard error at 0.5), and an n-gram drafter's first drafts in a request are
its worst (the prompt is all it can match): on the built-in pair its first 25
accepted 12 (0.48), its first 2,429 accepted 1,745 (0.72). Hence 128.

Measured step times (:class:`StepTimes`): the cost model above counts forwards only.
A drafting step also packs drafts, verifies, syncs and commits (about 1.3 ms a step
on the built-in pair, compiled, at batch 4, beside a 3.7 ms forward), and an n-gram
step verifies only the drafts its lookups found. So once a batch size has run both
plain steps and steps at some γ, the ratio of their median measured times replaces
the model's cost ratio for that γ there. Logged on the built-in pair, compiled, at
batch 4: γ = 1 steps of the n-gram took 5.24 ms against 3.22 ms for plain steps
(1.63x) where the forwards alone predicted about 1.3x; its γ = 1 steps there lost,
and the sweep's n-gram ran at 0.93 of plain decoding.

Tried on 2026-12-06 and not kept (built-in pair, compiled, 2-core AMD EPYC Zen 1, 32
requests x 32 tokens at batch 4, half of each pass their prefills): the n-gram's γ = 1
steps emitted 5.77 tokens for 4 requests where the model expected 6.22 (its first draft
is its least likely: one acceptance rate for every position overrates γ = 1), at 1.46x a
plain step: break-even (0.79 against 0.80 tokens per ms). Scaling the expected tokens by
what measured steps at (B, γ) emitted over what the model expected of them turned that γ
off, but cut the n-gram at batch 1 from 1.31x to 1.06x plain (the same sweep before and
after; its A/A 0.99 in both): only requests rated high enough were measured (their
estimates err high), the scale fell, more requests went plain and, drafting nothing,
never showed better. Per-position acceptance (pipeline-wide rates for the first, second,
... draft) would fix the model without that loop; not built.
Neither plain prefill steps (no drafts in a step with a new prompt) nor ``min_gain`` 0.10
or 0.15 moved batch 4 past the noise: every variant read 0.97-0.99 of plain there, an
A/A run of plain against plain 0.98-1.00 in the same passes.
With the native forward (2026-12-07: a one-token forward 1.6-1.8 ms, the A/A 0.995-1.004)
the loss at batch 4 is real: compare_hf's sweep, batch 1 then 4 (32 requests x 32 tokens,
11 passes), read the n-gram at 0.966 with ``min_gain`` 0.05, and 0.992 with 0.15 — but
0.15 cost the draft model at batch 1 all its gain (1.165 -> 0.987: its prior predicts +5%,
so it never speculated and never learnt better), as noted above. Not changed.
Later that day, the same sweep with the steps that carry a prompt at batch > 1 run plain
(requests that accept a draft there fall out of step, and each pass ends on part-full
batches): the n-gram at batch 4 read 0.986 against 0.976 before, the A/A 1.003-1.004.
Built (``SpecDecodePipelineModel._spec_step``; drafters that draft after verifying are
left as they were, unmeasured). The rest of the loss, about 1.4%, was the pipeline's own
work in its plain steps (the draft model, plain in every batch-4 step, read 0.984-0.986);
leaner plain steps cut its host time over plain decoding's from about 26 to 23 ms a pass
of 32 requests x 32 tokens (2.2-2.4 s), and two full sweeps then read 0.988-1.001 for
both methods at batch 4-64.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specdec.spec.cost import step_cost


@dataclass(frozen=True)
class GammaPolicyConfig:
    adaptive: bool = False
    prior_accept: float = 0.6
    prior_weight: float = 4.0
    # Speculate only when the model predicts at least this much gain over plain
    # decoding: the cost model leaves out host work (packing, lookups), so a
    # predicted 2% gain is noise. (15% was tried: at batch 1 a good drafter's
    # prior prediction, +5%, then never speculated and never learnt better.)
    min_gain: float = 0.05
    # Drafts verified (pipeline-wide) before the model may turn speculation off (see module doc).
    explore_tokens: int = 128

    def __post_init__(self) -> None:
        if not (0.0 <= self.prior_accept < 1.0):
            raise ValueError(f"method.gamma_policy.prior_accept must be in [0, 1), got {self.prior_accept}")
        if self.explore_tokens < 0:
            raise ValueError(f"method.gamma_policy.explore_tokens must be >= 0, got {self.explore_tokens}")

    def acceptance(self, request: tuple[int, int], drafter: tuple[int, int]) -> float:
        """A request's acceptance estimate from its own ``(accepted, tried)`` and the
        drafter's over every request so far (its prior, itself from ``prior_accept``)."""
        w = self.prior_weight
        base = (drafter[0] + self.prior_accept * w) / (drafter[1] + w)
        return (request[0] + base * w) / (request[1] + w)

    def explore(self, gamma: int, max_gamma: int, drafter_tried: int) -> int:
        """The step's γ after exploration: ``max_gamma`` where the model chose 0 while fewer
        than ``explore_tokens`` drafts have been tried (verified up to the first rejection)."""
        return max_gamma if gamma == 0 and drafter_tried < self.explore_tokens else gamma


class CostCurve:
    """Seconds of one forward as a function of its token count (piecewise linear)."""

    def __init__(self, measure: Callable[[int], float], points: Sequence[int]) -> None:
        self.points = sorted(set(points))
        times = [measure(n) for n in self.points]
        # More tokens never cost less: smooth measurement noise into a monotone curve.
        self.times = [max(times[: i + 1]) for i in range(len(times))]

    def __call__(self, n: int) -> float:
        xs, ys = self.points, self.times
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:  # extrapolate with the last slope
            if len(xs) == 1:
                return ys[0] * n / xs[0]
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (n - xs[-1])
        i = bisect.bisect_left(xs, n)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)


class TargetCost:
    """``T_target(B, n)``: seconds of one target forward of ``B`` requests feeding ``n`` tokens
    each, from measured curves over ``B`` at ``n = 1``, ``n = 2`` and ``n = max_n``: linear in
    ``n`` from 2 to ``max_n``, but not from 1. A forward of one token per request is a
    decode (one query each, attention without a mask); from two on it attends under a
    mask (a step up at any batch; hiding rows from each other's non-finite keys is not
    it: compiled without that, the times did not move), and then each token costs about
    the same.
    On the built-in target, compiled, at context 128 (ms, n = 1 / 2 / 5): batch 1 1.32 /
    1.87 / 2.24, batch 4 2.10 / 2.93 / 4.37, batch 16 5.4 / 8.7 / 13.9. A line from n = 1 to
    n = 5 put T(16, 2) at 7.5, and adaptive γ's γ = 1 steps then lost."""

    def __init__(self, one: CostCurve, two: CostCurve, most: CostCurve, max_n: int) -> None:
        self.one, self.two, self.most, self.max_n = one, two, most, max_n

    @classmethod
    def measure(cls, measure: Callable[[int, int], float], batch_points: Sequence[int], max_n: int,
                rounds: int = 1) -> TargetCost:
        """``measure(B, n)`` at every batch point, for ``n`` = 1, 2 and ``max_n``, by turns:
        ``rounds`` rounds of one call per ``n`` at a batch point, each ``n``'s least time kept.
        Adaptive γ decides on the *ratios* T(B, n) / T(B, 1), and this machine's speed moves by
        half within a minute (the built-in target's bare T(1, 1), least of 15, read 1.46 ms and
        2.32 ms a few seconds apart, 0.89 ms later). Timed one curve after another, a slow spell
        over one curve skewed the ratios: T(1, 5) / T(1, 1) read 1.43 in one pipeline and 2.2 in
        the next, built a minute apart. By turns, a spell that covers fewer than ``rounds``
        calls leaves each ``n`` a call outside it."""
        ns = sorted({1, min(2, max_n), max_n})
        least: dict[tuple[int, int], float] = {}
        for b in sorted(set(batch_points)):
            for _ in range(rounds):
                for n in ns:
                    t = measure(b, n)
                    least[b, n] = min(t, least.get((b, n), t))
        one = CostCurve(lambda b: least[b, 1], batch_points)
        two = CostCurve(lambda b: least[b, 2], batch_points) if max_n > 1 else one
        most = CostCurve(lambda b: least[b, max_n], batch_points) if max_n > 2 else two
        return cls(one, two, most, max_n)

    @property
    def curves(self) -> tuple[CostCurve, CostCurve, CostCurve]:
        return self.one, self.two, self.most

    def __call__(self, b: int, n: int) -> float:
        one = self.one(b)
        if self.max_n <= 1 or n <= 1:
            return one
        two = max(one, self.two(b))  # more tokens never cost less
        if self.max_n == 2 or n == 2:
            return two
        most = max(two, self.most(b))
        return two + (most - two) * (n - 2) / (self.max_n - 2)


class StepTimes:
    """Measured decode-step times by ``(batch size, γ)``: the last ``window`` of each, whole
    steps as the loop runs them (γ is the one the policy chose; 0 is plain decoding).

    ``ratio(B, γ)``: median step time at γ over median plain step time, both at batch
    size ``B``, once each has ``min_steps`` steps; else None (the model decides there).
    Both are recent steps of the same run, so a machine-wide slow spell moves both."""

    def __init__(self, window: int = 64, min_steps: int = 8) -> None:
        self.window, self.min_steps = window, min_steps
        self._times: dict[tuple[int, int], deque[float]] = {}
        self._medians: dict[tuple[int, int], float | None] = {}

    def record(self, batch: int, gamma: int, seconds: float) -> None:
        times = self._times.get((batch, gamma))
        if times is None:
            times = self._times[batch, gamma] = deque(maxlen=self.window)
        times.append(seconds)
        self._medians.pop((batch, gamma), None)

    def median(self, batch: int, gamma: int) -> float | None:
        key = (batch, gamma)
        if key not in self._medians:
            times = self._times.get(key)
            self._medians[key] = statistics.median(times) if times and len(times) >= self.min_steps else None
        return self._medians[key]

    def ratio(self, batch: int, gamma: int) -> float | None:
        plain = self.median(batch, 0)
        spec = self.median(batch, gamma) if plain is not None else None
        return spec / plain if spec is not None and plain is not None else None


def expected_tokens(accept: Sequence[float], gamma: int) -> float:
    """Σ_r E[tokens emitted by request r in one step] with γ drafts (accepted + 1)."""
    total = 0.0
    for a in accept:
        a = min(max(a, 0.0), 0.999)
        total += (1 - a ** (gamma + 1)) / (1 - a)
    return total


def choose_gamma(
    accept: Sequence[float],
    max_gamma: int,
    t_target: Callable[[int, int], float],
    t_draft: Callable[[int], float],
    min_gain: float = 0.0,
    *,
    catch_up_s: float = 0.0,
    remaining_tokens: float = float("inf"),
    fused: tuple[int, Callable[[int], float]] | None = None,
    measured: Callable[[int, int], float | None] | None = None,
) -> int:
    """The γ in 0 … ``max_gamma`` with the most expected tokens per second;
    0 (plain decoding) unless the best γ beats it by ``min_gain``.
    ``t_target(B, n)``: a forward of B requests of n tokens each.

    ``catch_up_s``: a one-time cost of starting to speculate (a draft model
    reading prompts it has not seen), paid back only over the batch's
    ``remaining_tokens``: a speculative rate r then counts as
    ``R / (catch_up_s + R / r)``. Short outputs of long prompts stay plain.
    Example: R = 32 tokens, plain 1 token/ms, speculation 2 tokens/ms after a
    20 ms catch-up: 32 / (20 + 16) = 0.89 tokens/ms, so plain wins.

    ``fused = (G, t)``: at γ = G a draft costs ``t(B)`` instead of ``t_draft(B)``
    (a compiled drafter runs the method's full γ as one graph, cheaper per draft).

    ``measured(B, γ)``: a step at γ over a plain step, as measured at this batch size
    (:class:`StepTimes`), or None; where given, it replaces the modelled cost ratio."""
    b = len(accept)
    t_plain = t_target(b, 1)
    plain = b / t_plain
    best, best_rate = 0, plain
    for g in range(1, max_gamma + 1):
        ratio = measured(b, g) if measured is not None else None
        if ratio is not None:
            cost = ratio * t_plain
        else:
            per_draft = fused[1](b) if fused is not None and g == fused[0] else t_draft(b)
            cost = step_cost(g + 1, lambda n, b=b: t_target(b, int(n)), draft_forwards=g, t_draft=per_draft)
        rate = expected_tokens(accept, g) / cost
        if catch_up_s > 0:
            rate = remaining_tokens / (catch_up_s + remaining_tokens / rate)
        if rate > best_rate:
            best, best_rate = g, rate
    return best if best_rate >= plain * (1 + min_gain) else 0
