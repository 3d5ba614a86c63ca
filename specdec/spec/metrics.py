"""Speculation figures, defined once:

- γ: draft tokens proposed per request per step;
- accepted: draft tokens the target keeps; bonus: the one token the target
  adds each step (after the last accepted one, or in place of the first
  rejected one);
- τ (mean accepted length) = (accepted + bonus) / target forward passes —
  tokens per target call; plain decoding has τ = 1. Counted per request:
  a request's target passes are the verification steps it took part in;
- α (acceptance rate) = accepted / proposed;
- per-position acceptance: P(draft token i accepted | tokens < i accepted) =
  accepted_at[i] / reached[i].

Step time (``PhaseTimes``): the host clock of each speculative step, cut into
consecutive phases: ``draft_prepare`` (the proposer's host packing, n-gram
lookups), ``target_prepare`` (the target's packing, sampling tensors),
``draft_catch_up`` (the drafter's first forward: a draft model's over the
tokens it has not seen, an EAGLE head's over every row the target was fed),
``draft_steps`` (its other draft forwards, tree expansion, storing drafts),
``target_forward``, ``verify`` (acceptance, fault checks), ``sync`` (the step's
one device-to-host copy) and ``commit`` (counts, KV rollback, the proposer's
bookkeeping). A step that carries prompt rows (a request's first step, prefill
chunks) goes to ``prefill`` whole, so the other phases are those of decode
steps, comparable with bare one-step forward times.
On a GPU the host clock sees launches, not kernels (the device work lands in
``sync``); on the CPU every phase is its own compute.

Analytic limit and efficiency (:func:`analytic_limit`; every tool, the run summary and the
benchmarks alike, through :func:`specdec.measure.spec_limit`):

    limit      = τ_decode · S_plain / C_spec
    efficiency = decode_speedup / limit

- ``τ_decode``: tokens per step after each request's first step (the prefill, the
  same work with or without speculation): decode tokens ÷ (steps - first steps);
- ``S_plain``: plain decoding's decode-phase seconds per step in its own loop, same
  batch (decode seconds ÷ decode tokens per request), of the very plain passes the
  decode speedup divides by (median over passes; the run's batches are one pass);
- ``C_spec``: the bare cost of what the method's decode step runs
  (:func:`specdec.spec.cost.step_cost`: the target over the rows it verified on
  average, the drafter's forwards as they run), from bare forward times at the mean
  decode context (mean prompt + half the new tokens), each forward feeding the batch's
  requests at once (as a step of B does: S_plain is a step of B), timed by turns within
  those same passes, so that S_plain / C_spec holds while the machine's speed drifts.

Every speculative step costs at least ``C_spec``, so the limit is the speedup a
speculative step with no host work at all would reach over this run's plain decoding,
and efficiency ≤ 1 up to noise; at batch 1 it is ``C_spec`` ÷ the measured speculative
step. ``decode_speedup`` is speculation's decode-phase tokens/s ÷ plain decoding's; a
figure that is missing (no decode timing, no bare times) leaves limit and efficiency
missing (None), never replaced by another. For scale, plain decoding by the same
measure scores T_target(1) ÷ S_plain (about 0.45-0.5 on a 2-core CPU, whose plain step
in the loop costs about twice its bare forward). Bare times are medians of short
bursts and loop times sums, so on a machine busy with other work the loop absorbs
every preemption and efficiency reads low.

Token trees (specdec/spec/tree.py): γ is the tree's *size* (nodes verified
per request per step; ``tree_size`` = mean nodes per step), τ stays tokens
per target forward, ``accepted_length`` is the mean accepted path length per
step, and the per-position figures are **per depth**: depth ``i + 1`` is
reached when the path accepted ``i`` nodes and the tree has a node that deep,
and accepted when one of its nodes there is (``acceptance_per_depth``). For a
chain, depth and position coincide.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

PHASES = ("draft_prepare", "target_prepare", "draft_catch_up", "draft_steps", "target_forward", "verify",
          "sync", "commit", "prefill")


class PhaseTimes:
    """Seconds per phase of the speculative steps (module doc), summed since :meth:`reset`.

    Phases follow one another: ``t = times.lap("verify", t)`` adds the time
    since ``t`` to ``verify`` and returns now, the start of the next phase.
    While ``prefilling`` (a step with prompt rows) every lap goes to ``prefill``.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.prefilling = False

    def add(self, phase: str, seconds: float) -> None:
        self.seconds["prefill" if self.prefilling else phase] += seconds

    def lap(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.add(phase, now - since)
        return now

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)


@dataclass
class SpecCounts:
    """Counters of one request or of a whole run."""

    steps: int = 0  # verification steps (target forward passes per request)
    proposed: int = 0
    accepted: int = 0
    bonus: int = 0
    reached: list[int] = field(default_factory=list)  # [γ] draft position i was verified
    accepted_at: list[int] = field(default_factory=list)  # [γ] and accepted there
    accepted_hist: list[int] = field(default_factory=list)  # [k] steps that accepted exactly k

    def record(self, num_draft: int, num_accepted: int, depth: int | None = None) -> None:
        """One verification step: ``num_draft`` proposed, ``num_accepted`` kept;
        a tree step gives its tree's ``depth`` (positions are then depths)."""
        self.steps += 1
        self.proposed += num_draft
        self.accepted += num_accepted
        self.bonus += 1
        span = num_draft if depth is None else depth  # positions (chain) or depths (tree) offered
        if len(self.reached) < span:
            grow = span - len(self.reached)
            self.reached += [0] * grow
            self.accepted_at += [0] * grow
        # Position i is reached when all before it were accepted.
        for i in range(min(span, num_accepted + 1)):
            self.reached[i] += 1
        for i in range(num_accepted):
            self.accepted_at[i] += 1
        if len(self.accepted_hist) <= num_accepted:
            self.accepted_hist += [0] * (num_accepted + 1 - len(self.accepted_hist))
        self.accepted_hist[num_accepted] += 1

    def record_plain(self) -> None:
        """A step that drafted nothing: ``record(0, 0)`` without its loops (adaptive γ's
        plain steps record one per request per step)."""
        self.steps += 1
        self.bonus += 1
        if not self.accepted_hist:
            self.accepted_hist.append(0)
        self.accepted_hist[0] += 1

    def merge(self, other: SpecCounts) -> None:
        self.steps += other.steps
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.bonus += other.bonus
        n = max(len(self.reached), len(other.reached))
        self.reached = [a + b for a, b in zip(_pad(self.reached, n), _pad(other.reached, n))]
        self.accepted_at = [a + b for a, b in zip(_pad(self.accepted_at, n), _pad(other.accepted_at, n))]
        m = max(len(self.accepted_hist), len(other.accepted_hist))
        self.accepted_hist = [a + b for a, b in zip(_pad(self.accepted_hist, m), _pad(other.accepted_hist, m))]

    @property
    def tau(self) -> float:
        return (self.accepted + self.bonus) / self.steps if self.steps else 0.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def per_position(self) -> list[float]:
        """Acceptance at each position (chains) or depth (trees), given the ones before."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]

    @property
    def accepted_length(self) -> float:
        """Mean accepted drafts per step (τ - 1 when every step drafted)."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tree_size(self) -> float:
        """Mean draft tokens (tree nodes) verified per request per step."""
        return self.proposed / self.steps if self.steps else 0.0

    def summary(self) -> dict[str, Any]:
        return {**asdict(self), "tau": self.tau, "alpha": self.alpha, "per_position_acceptance": self.per_position,
                "accepted_length": self.accepted_length, "tree_size": self.tree_size}


@dataclass
class RunStats:
    """A pipeline's figures since its last ``reset_stats()`` (``pipeline.stats()``)."""

    counts: SpecCounts = field(default_factory=SpecCounts)  # every request's, merged
    per_request: dict[str, SpecCounts] = field(default_factory=dict)  # request id -> its counts
    target_forwards: int = 0  # target forward passes (a step is one; a prefill chunk forward too)
    draft_time_s: float = 0.0  # host clock in the drafter (before-verify and after-verify drafting)
    target_time_s: float = 0.0  # host clock in the target forward
    phase_s: dict[str, float] = field(default_factory=dict)  # PhaseTimes: seconds per step phase, summed
    spec_steps: int = 0  # decode steps (speculative steps without prompt rows): the phases' step count
    host_syncs: int = 0  # device-to-host reads of the draft-and-verify steps (one a step)


def _pad(x: list[int], n: int) -> list[int]:
    return x + [0] * (n - len(x))


def decode_tau(decode_tokens: int, steps: int, first_steps: int) -> float | None:
    """τ of the decode phase: the tokens emitted after each request's first step ÷ the steps
    after it (``first_steps``: one per request, per turn of a conversation); None without any."""
    n = steps - first_steps
    return decode_tokens / n if n > 0 and decode_tokens > 0 else None


def analytic_limit(*, tau: float | None, plain_step_s: float | None, spec_step_s: float | None) -> float | None:
    """Best speedup a speculative step with no host work reaches over the run's plain decoding:
    τ · S_plain / C_spec (module doc); None when a figure is missing."""
    if not tau or not plain_step_s or not spec_step_s:
        return None
    return tau * plain_step_s / spec_step_s
