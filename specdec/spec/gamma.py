"""How many tokens to draft this step: fixed, or chosen to pay off.

:class:`AdaptiveGamma` picks the step's γ (0 … the method's γ) that maximises
expected tokens per second for the batch at hand:

    E[tokens](γ) = Σ_r (1 - a_r^(γ+1)) / (1 - a_r)      # a_r: request r's running acceptance
    cost(γ)      = T_target(B, γ+1) + F(γ) · T_draft(B)  # specdec.spec.cost.step_cost

``T_target(B, n)`` is a forward of ``B`` requests feeding ``n`` tokens each
(:class:`TargetCost`), ``F(γ)`` the drafter forwards a step of γ runs
(``DrafterSpec.draft_forwards``: γ for a chain, a dynamic tree's ``depth`` levels
whatever its node budget γ) and ``T_draft(B)`` one drafting forward of ``B`` requests, both
timed as they run (``B`` contexts read, not one request of ``B · n`` tokens), from a
short calibration on first use. γ = 0 is plain decoding, so speculation is turned
off where it cannot pay: large batches (a compute-bound target verifies γ+1 tokens
for nearly γ+1 times the cost) or low acceptance.

``a_r`` is accepted / tried: a step that accepts ``k`` of its γ drafts tried ``k + 1``
(up to the first rejected one), or ``k`` if none was rejected (all γ, or a tree's path
to its deepest node) — the maximum-likelihood estimate of the geometric model above
(accepted / proposed reads low and drafts too little). Its prior, worth ``prior_weight``
drafts, is the drafter's acceptance over every request so far (from ``prior_accept``).

Trees (γ a node budget, ``DrafterSpec.node_budget``): n nodes side by side are not n
deep, so the model above over-credits a wide tree. A tree step picks among plain, the
chain-sized tree (as many nodes as the budget's tree is deep, ``TreeConfig.depth_at``)
and the whole budget N, each expected to give 1 + the accepted tokens per request step
learnt at that node count (drafter-wide; before any, the model above at N, no deeper
than the count's tree, worth ``prior_weight`` steps: optimistic, so an untried count
gets tried), each costed as above at its n nodes (or by its measured step ratio),
``min_gain`` and plain-step probes as for a chain. A drafter drafts the count chosen
(a dynamic tree its best n candidates, a static tree its first n choices); one that
drafts after verification drafts it for the next step, which verifies at most that.

Exploration: a prior that is too low picks γ = 0, and a pipeline that never drafts
never learns better. So until ``explore_tokens`` drafts have been verified,
pipeline-wide, a step the model would run plain drafts the method's γ instead
(:meth:`GammaPolicyConfig.explore`); long enough that the estimate it ends on is
the drafter's, not the noise of its first (worst) drafts.

Measured step times (:class:`StepTimes`): the cost model counts forwards only; a
drafting step also packs, verifies, syncs and commits. Once a batch size has run
both plain steps and steps at some γ, the ratio of their median times replaces the
model's cost ratio for that γ there. Where the model speculates, nothing would ever
time a plain step at that batch size, so the model's optimism would stand: until a
batch size holds ``StepTimes.min_steps`` plain steps, every other step the model
would draft in runs plain instead (a *probe*, by turns with the drafting steps, so a
slow spell covers both). A probe costs at most that step's speculative gain; a
speculation that loses to plain decoding once host work is counted then stops.
Drafters that draft after verification (EAGLE, Medusa) are not probed: their γ = 0
step still catches up and drafts one token for the next step (the pipeline's
``_next_gamma``), so it is no plain step to measure, and the model charges it that
one drafter forward.

At batch > 1 a step that carries prompt rows decodes plain: drafting there throws
the requests out of step with each other, and the run ends in part-full batches.
(Measurements behind these choices: results/history.md.)
"""

from __future__ import annotations

import bisect
import operator
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.spec.cost import step_cost

if TYPE_CHECKING:  # (this module loads no torch)
    from specdec.core.context import TextContext
    from specdec.core.pipeline_model import DecoderPipelineModel
    from specdec.spec.proposers.base import Proposer


@dataclass(frozen=True)
class GammaPolicyConfig:
    adaptive: bool = False
    prior_accept: float = 0.6
    prior_weight: float = 4.0
    # Speculate only when the model predicts at least this much gain over plain
    # decoding: the cost model leaves out host work (packing, lookups), so a
    # predicted 2% gain is noise; much more and a good drafter's prior never speculates.
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
    the same (a line from n = 1 put T(B, 2) too low, and γ = 1 steps then lost)."""

    def __init__(self, one: CostCurve, two: CostCurve, most: CostCurve, max_n: int) -> None:
        self.one, self.two, self.most, self.max_n = one, two, most, max_n

    @classmethod
    def measure(cls, measure: Callable[[int, int], float], batch_points: Sequence[int], max_n: int,
                rounds: int = 1) -> TargetCost:
        """``measure(B, n)`` at every batch point, for ``n`` = 1, 2 and ``max_n``, by turns:
        ``rounds`` rounds of one call per ``n`` at a batch point, each ``n``'s least time kept.
        Adaptive γ decides on the *ratios* T(B, n) / T(B, 1), and a shared machine's speed
        moves within a minute: timed one curve after another, a slow spell over one curve
        skews them. By turns, a spell that covers fewer than ``rounds`` calls leaves each
        ``n`` a call outside it."""
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

    def count(self, batch: int, gamma: int) -> int:
        """Steps held at ``(batch size, γ)``."""
        times = self._times.get((batch, gamma))
        return len(times) if times is not None else 0

    def counts(self) -> dict[tuple[int, int], int]:
        """Steps held, by ``(batch size, γ)``."""
        return {key: len(times) for key, times in self._times.items()}

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
    draft_forwards: Callable[[int], float] | None = None,
    plain_draft_forwards: float = 0.0,
    candidates: Sequence[int] | None = None,
    tokens: Callable[[int], float] | None = None,
) -> int:
    """The γ in 0 … ``max_gamma`` with the most expected tokens per second;
    0 (plain decoding) unless the best γ beats it by ``min_gain``.
    ``t_target(B, n)``: a forward of B requests of n tokens each.
    ``candidates``: the γ on offer besides 0 (default 1 … ``max_gamma``); ``tokens(γ)``:
    the batch's expected tokens of a step at γ (default :func:`expected_tokens` of ``accept``).

    ``catch_up_s``: a one-time cost of starting to speculate (a draft model
    reading prompts it has not seen), paid back only over the batch's
    ``remaining_tokens``: a speculative rate r then counts as
    ``R / (catch_up_s + R / r)``. Short outputs of long prompts stay plain.
    Example: R = 32 tokens, plain 1 token/ms, speculation 2 tokens/ms after a
    20 ms catch-up: 32 / (20 + 16) = 0.89 tokens/ms, so plain wins.

    ``fused = (G, t)``: at γ = G a draft costs ``t(B)`` instead of ``t_draft(B)``
    (a compiled drafter runs the method's full γ as one graph, cheaper per draft).

    ``measured(B, γ)``: a step at γ over a plain step, as measured at this batch size
    (:class:`StepTimes`), or None; where given, it replaces the modelled cost ratio.

    ``draft_forwards(γ)``: drafter forwards a step of γ runs (default γ; a dynamic tree
    runs its ``depth`` levels whatever its node budget).

    ``plain_draft_forwards``: drafter forwards even a γ = 0 step runs (a drafter that
    drafts after verification catches up and drafts one for the next step)."""
    b = len(accept)
    t_plain = t_target(b, 1) + plain_draft_forwards * t_draft(b)
    plain = b / t_plain
    best, best_rate = 0, plain
    for g in range(1, max_gamma + 1) if candidates is None else candidates:
        ratio = measured(b, g) if measured is not None else None
        if ratio is not None:
            cost = ratio * t_plain
        else:
            per_draft = fused[1](b) if fused is not None and g == fused[0] else t_draft(b)
            forwards = g if draft_forwards is None else draft_forwards(g)
            cost = step_cost(g + 1, lambda n, b=b: t_target(b, int(n)), draft_forwards=forwards, t_draft=per_draft)
        rate = (expected_tokens(accept, g) if tokens is None else tokens(g)) / cost
        if catch_up_s > 0:
            rate = remaining_tokens / (catch_up_s + remaining_tokens / rate)
        if rate > best_rate:
            best, best_rate = g, rate
    return best if best_rate >= plain * (1 + min_gain) else 0


class AdaptiveGamma:
    """Adaptive γ for one pipeline: what it has learnt and measured, and the step's choice.

    ``choose(batch, gammas, prefilling)`` picks the step's γ; ``record(key, accepted,
    tried)`` feeds back what a request's step verified; ``forget(key)`` drops a finished
    request; ``record_step(batch_size, seconds)`` times a decode step at the γ chosen
    (:class:`StepTimes`). ``curves`` (T_target, T_draft) are calibrated on first use
    (:meth:`calibrate`); set them to model a machine."""

    def __init__(self, policy: GammaPolicyConfig, max_gamma: int, *, target: DecoderPipelineModel,
                 proposer: Proposer, measure_steps: bool = True) -> None:
        self.policy, self.max_gamma = policy, max_gamma
        self.target, self.proposer = target, proposer
        self.running: dict[int, list[int]] = {}  # [accepted, tried] per live request (TextContext.key)
        self.drafter = [0, 0]  # the same over every request so far (the prior)
        self.by_size: dict[int, list[int]] = {}  # a tree's [accepted, request steps] by node count, drafter-wide
        self.curves: tuple[TargetCost, CostCurve] | None = None
        self.catch_up: CostCurve | None = None  # seconds for the drafter to read n unseen tokens
        self.fused: tuple[int, CostCurve] | None = None  # (method γ, T_draft(B) there) when it differs
        self.step_times = StepTimes() if measure_steps else None
        self.step_gamma = 0  # the γ chosen for the step under way
        self._plain_for: tuple[list[TextContext], tuple[int, ...]] | None = None  # see still_plain

    def still_plain(self, batch: Sequence[TextContext]) -> bool:
        """Whether the model chose plain decoding for this very batch (the same request
        objects) and nothing it read has changed since. A step that drafts nothing changes
        no acceptance and only makes speculation costlier (more catch-up, fewer tokens
        left), and each request's γ cap only shrinks: the model need not run again."""
        last = self._plain_for
        return (last is not None and len(last[0]) == len(batch) and all(map(operator.is_, last[0], batch))
                and last[1] == tuple(self.drafter))

    def choose(self, batch: Sequence[TextContext], gammas: Sequence[int], prefilling: bool) -> int:
        """The step's γ for ``batch`` (``gammas``: each request's cap; ``prefilling``: the
        step carries prompt rows): 0 is plain decoding."""
        mixed = prefilling and len(batch) > 1 and not self.proposer.spec.drafts_after_verify
        self.step_gamma = 0 if mixed else self._model(batch, gammas)
        return self.step_gamma

    def _model(self, batch: Sequence[TextContext], gammas: Sequence[int]) -> int:
        pol = self.policy
        seen = tuple(self.drafter)
        if self.still_plain(batch):
            return 0
        accept = [pol.acceptance(tuple(self.running.get(c.key, (0, 0))), seen) for c in batch]
        tt, td = self.calibrate()
        # Unseen tokens past a step's own catch-up (γ + 1 at most) are a one-time cost.
        catch_up = 0.0
        if self.catch_up is not None and self.catch_up.times[-1] > 0:
            extra = sum(u for u in map(self.proposer.unseen_tokens, batch) if u > max(gammas) + 1)
            catch_up = self.catch_up(extra) if extra else 0.0
        remaining = sum(max(1, c.sampling.max_new_tokens - c.num_generated) for c in batch)
        sizes = tokens = None
        if self.proposer.spec.node_budget:  # a tree: its node counts on offer, priced as learnt
            sizes, tokens = self._tree_sizes(accept, max(gammas))
        g = choose_gamma(accept, max(gammas), tt, td, pol.min_gain, catch_up_s=catch_up, remaining_tokens=remaining,
                         fused=self.fused, measured=self.step_times.ratio if self.step_times else None,
                         draft_forwards=self.proposer.spec.draft_forwards,
                         plain_draft_forwards=1.0 if self.proposer.spec.drafts_after_verify else 0.0,
                         candidates=sizes, tokens=tokens)
        g = pol.explore(g, max(gammas), seen[1])
        self._plain_for = (list(batch), seen) if g == 0 else None
        return 0 if g and self._probe_plain(len(batch), g) else g

    def _tree_sizes(self, accept: Sequence[float], budget: int) -> tuple[list[int], Callable[[int], float]]:
        """A tree's node counts on offer (the chain-sized tree, as many nodes as it is deep, and
        the ``budget``) and the batch's expected tokens at each (module doc): per request, 1 +
        the accepted per step learnt at that count, from a prior worth ``prior_weight`` steps:
        the chain model's at the budget (optimistic: an untried count gets tried), no deeper
        than the count's tree."""
        tree = getattr(getattr(self.proposer, "config", None), "tree", None)
        depth = tree.depth_at if tree is not None else (lambda n: n)
        prior, w = expected_tokens(accept, budget) / len(accept) - 1, self.policy.prior_weight

        def tokens(n: int) -> float:
            accepted, steps = self.by_size.get(n, (0, 0))
            return len(accept) * (1 + (accepted + min(prior, depth(n)) * w) / (steps + w))

        return sorted({min(depth(budget), budget), budget}), tokens

    def _probe_plain(self, batch_size: int, gamma: int) -> bool:
        """Whether this step, which the model would run at ``gamma``, runs plain instead to
        time plain steps at this batch size (module doc: by turns, until ``min_steps``)."""
        st = self.step_times
        if st is None or self.proposer.spec.drafts_after_verify:
            return False
        plain = st.count(batch_size, 0)
        return plain < st.min_steps and plain < st.count(batch_size, gamma)

    def record(self, key: int, accepted: int, tried: int, size: int = 0) -> None:
        """A request's step verified ``tried`` drafts (up to the first rejected one) and accepted
        ``accepted`` of the ``size`` it was given (a tree's node count)."""
        if size:
            by_size = self.by_size.setdefault(size, [0, 0])
            by_size[0] += accepted
            by_size[1] += 1
        running = self.running.get(key)
        if running is None:
            running = self.running[key] = [0, 0]
        running[0] += accepted
        running[1] += tried
        self.drafter[0] += accepted
        self.drafter[1] += tried

    def forget(self, key: int) -> None:
        """A finished request's running acceptance goes (the drafter-wide one stays)."""
        self.running.pop(key, None)

    def record_step(self, batch_size: int, seconds: float) -> None:
        """A whole decode step of ``batch_size`` requests took ``seconds`` at the γ chosen for it."""
        if self.step_times is not None:
            self.step_times.record(batch_size, self.step_gamma, seconds)

    def calibrate(self) -> tuple[TargetCost, CostCurve]:
        """T_target(B requests, n tokens each) and T_draft(B) from a short calibration (first use)."""
        if self.curves is None:
            from specdec.dist.group import current
            from specdec.spec.forward_time import forward_time

            rt, g, target, proposer = self.target.runtime, self.max_gamma, self.target, self.proposer
            ctx = min(128, rt.max_seq_len - 1)
            # Batches of throwaway requests the KV cache holds (a draft model's too); past them the
            # curves extend by their last slope. Not even one: name the setting to raise.
            models = [target] + ([proposer.spec.model] if proposer.spec.model is not None else [])
            fits = min(m.num_free_blocks() // m.blocks_for(ctx + g + 1) for m in models)
            if fits < 1:
                raise ValueError(f"adaptive γ times a request of {ctx + g + 1} tokens, but the KV cache holds "
                                 f"{target.num_free_blocks()} free blocks of {target.block_size} tokens: raise "
                                 f"runtime.num_blocks (or set method.adaptive_gamma=false)")
            top = min(rt.max_batch_size, fits)
            bpts = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < top] + [top]
            tt = TargetCost.measure(lambda b, n: forward_time(target, n, max(ctx, n), repeats=2, stat="min",
                                                              requests=b, warmup=1), bpts, g + 1, rounds=4)
            td = CostCurve(lambda b: proposer.draft_cost(b, ctx), bpts)
            # A compiled drafter's full γ runs as one graph: per draft, that cost / γ.
            fused = {b: proposer.fused_draft_cost(b, ctx) for b in bpts}
            fc = (CostCurve(lambda b: (fused[b] or 0.0) / g, bpts) if None not in fused.values() else None)
            # A drafter's one-time read of a prompt it has not seen (one request, n tokens).
            npts = sorted({min(n, rt.max_seq_len - 1) for n in (16, 64, 256, 1024)})
            tc = CostCurve(proposer.catch_up_cost, npts)
            # Under torchrun every rank must pick the same γ: all take rank 0's curves.
            curves = tt.curves
            times, td.times, tc.times, full_times = current().broadcast_object(
                ([c.times for c in curves], td.times, tc.times, fc and fc.times))
            for c, ts in zip(curves, times):
                c.times = ts
            if fc is not None:
                fc.times = full_times
            self.curves = (tt, td)
            self.catch_up = tc
            self.fused = (g, fc) if fc is not None else None
        return self.curves
