"""τ, α and per-position acceptance equal values counted by hand.

Definitions (:mod:`specdec.spec.metrics`):
- τ = (accepted + bonus) / target forward passes (per request: its steps);
- α = accepted / proposed;
- per-position acceptance i = accepted_at[i] / reached[i], position i being
  *reached* when drafts 0 … i-1 were all accepted.

A test-only proposer, ``scripted_test``, proposes a scripted sequence: the
target's true greedy continuation with wrong tokens injected at known
generated indices. Greedy verification keeps exactly the drafts before the
first wrong one, so every step's outcome can be worked out on paper.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from fractions import Fraction

import pytest
import torch

from specdec.core.context import SamplingParams, TextContext
from specdec.sampling import SamplingTensors
from specdec.spec.metrics import SpecCounts
from specdec.spec.proposers.base import (
    DraftBatch,
    Drafter,
    DraftTree,
    Proposer,
    ProposerConfig,
    ProposerDeps,
    register_proposer,
)
from specdec.spec.proposers.draft_model import DraftModelConfig
from specdec.spec.proposers.ngram import NgramConfig

# -- SpecCounts by itself ----------------------------------------------------------------------


def test_record_counts_one_request_by_hand() -> None:
    c = SpecCounts()
    c.record(3, 1)  # γ 3: d0 kept, d1 rejected -> reached [1,1,0], kept [1,0,0]
    c.record(3, 3)  # all kept, bonus        -> reached [1,1,1], kept [1,1,1]
    c.record(2, 0)  # γ 2: d0 rejected       -> reached [1,0],   kept [0,0]
    c.record(0, 0)  # plain decoding step     -> nothing reached
    assert c.steps == 4
    assert c.proposed == 3 + 3 + 2 + 0 == 8
    assert c.accepted == 1 + 3 + 0 + 0 == 4
    assert c.bonus == 4  # one per step
    assert c.reached == [3, 2, 1]
    assert c.accepted_at == [2, 1, 1]
    assert c.accepted_hist == [2, 1, 0, 1]  # k = 0 twice, 1 once, 3 once
    assert c.tau == (4 + 4) / 4 == 2.0
    assert c.alpha == 4 / 8
    assert c.per_position == [2 / 3, 1 / 2, 1 / 1]


@pytest.mark.parametrize("before", [[], [(0, 0)], [(3, 1), (2, 2)]])
def test_a_plain_step_records_as_a_step_that_drafted_nothing(before) -> None:
    a, b = SpecCounts(), SpecCounts()
    for c in (a, b):
        for n, k in before:
            c.record(n, k)
    a.record_plain()
    b.record(0, 0)
    assert a == b and a.steps == len(before) + 1


def test_record_grows_with_the_largest_gamma_seen() -> None:
    c = SpecCounts()
    c.record(1, 1)  # reached [1],        kept [1]
    c.record(4, 2)  # reached [1,1,1,0],  kept [1,1,0,0]
    assert c.reached == [2, 1, 1, 0]
    assert c.accepted_at == [2, 1, 0, 0]
    assert c.per_position == [1.0, 1.0, 0.0, 0.0]  # never-reached position: 0, not a division by zero


def test_merge_adds_counters_elementwise() -> None:
    a = SpecCounts()
    a.record(2, 2)  # reached [1,1], kept [1,1], hist [0,0,1]
    b = SpecCounts()
    b.record(4, 0)  # reached [1,0,0,0], kept [0,0,0,0], hist [1]
    b.record(4, 4)  # reached [1,1,1,1], kept [1,1,1,1], hist [0,0,0,0,1]
    a.merge(b)
    assert (a.steps, a.proposed, a.accepted, a.bonus) == (3, 2 + 8, 2 + 4, 3)
    assert a.reached == [3, 2, 1, 1]
    assert a.accepted_at == [2, 2, 1, 1]
    assert a.accepted_hist == [1, 0, 1, 0, 1]
    assert a.tau == (6 + 3) / 3
    assert a.alpha == 6 / 10
    assert a.per_position == [2 / 3, 1.0, 1.0, 1.0]
    empty = SpecCounts()
    assert (empty.tau, empty.alpha, empty.per_position) == (0.0, 0.0, [])


# -- a scripted drafter against a real target ----------------------------------------------------


@dataclass(frozen=True)
class ScriptedConfig(ProposerConfig):
    """Drafts by request id: ``script[rid][i]`` is proposed for generated index ``i``."""

    num_speculative_tokens: int = 3
    script: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclass
class ScriptedBatch(DraftBatch):
    tokens: torch.Tensor  # [B, γ]


class ScriptedDrafter(Drafter):
    def forward(self, batch: ScriptedBatch, sampling: SamplingTensors) -> DraftTree:  # type: ignore[override]
        return DraftTree.chain(batch.tokens)


@register_proposer("scripted_test", ScriptedConfig)
class ScriptedProposer(Proposer):
    def __init__(self, config: ScriptedConfig, deps: ProposerDeps | None = None) -> None:
        self.script = dict(config.script)
        self.drafter = ScriptedDrafter()
        self.calls: list[tuple[str, int, int]] = []  # (request, generated so far, drafts asked)

    def prepare(self, batch: list[TextContext], gamma: int, num_draft: list[int]) -> ScriptedBatch:
        rows = []
        for ctx, k in zip(batch, num_draft):
            self.calls.append((ctx.request_id, ctx.num_generated, k))
            s = self.script[ctx.request_id][ctx.num_generated : ctx.num_generated + k]
            rows.append(list(s) + [0] * (gamma - len(s)))
        return ScriptedBatch(
            gamma=gamma,
            num_draft=torch.tensor(num_draft, dtype=torch.long),
            first_position=torch.tensor([len(c.tokens) for c in batch], dtype=torch.long),
            tokens=torch.tensor(rows, dtype=torch.long).view(len(batch), gamma),
        )


def _wrong_at(greedy: list[int], idx: set[int], vocab: int) -> tuple[int, ...]:
    return tuple((t + 1) % vocab if i in idx else t for i, t in enumerate(greedy))


@pytest.fixture
def target(tiny_llama):
    return tiny_llama(vocab=64, seed=0)


def test_scripted_drafter_counts_by_hand(target, generate) -> None:
    p0, p1 = [3, 14, 15, 9, 2, 6], [27, 18, 28]
    (g0, g1), _ = generate(target, None, [p0, p1], [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=8)])
    script = (
        ("req-0", _wrong_at(g0, {1, 5, 6}, 64)),
        ("req-1", _wrong_at(g1, {0, 2}, 64)),
    )
    out, llm = generate(
        target, ScriptedConfig(num_speculative_tokens=3, script=script), [p0, p1],
        [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=8)],
    )
    assert out == [g0, g1]  # exact, whatever the drafts

    # req-0: γ = 3, 12 new tokens, wrong drafts at generated indices 1, 5, 6.
    #   step 1: gen 0, drafts idx 0,1,2: idx 1 wrong -> k = 1, emits g0[0], recovered g0[1]   gen 2
    #   step 2: gen 2, drafts idx 2,3,4: all right   -> k = 3, emits 3 + bonus g0[5]          gen 6
    #   step 3: gen 6, drafts idx 6,7,8: idx 6 wrong -> k = 0, emits recovered g0[6]          gen 7
    #   step 4: gen 7, drafts idx 7,8,9: all right   -> k = 3, emits 3 + bonus g0[10]         gen 11
    #   step 5: gen 11: one token left, γ = 12 - 11 - 1 = 0 -> plain step, k = 0              gen 12
    # steps 5, proposed 3+3+3+3+0 = 12, accepted 1+3+0+3+0 = 7, bonus 5
    # reached:     s1 [1,1,0] s2 [1,1,1] s3 [1,0,0] s4 [1,1,1] -> [4,3,2]
    # accepted_at: s1 [1,0,0] s2 [1,1,1] s3 [0,0,0] s4 [1,1,1] -> [3,2,2]
    # hist: k = 1, 3, 0, 3, 0 -> [2, 1, 0, 2]
    c0 = llm.pipeline.stats().per_request["req-0"]
    assert (c0.steps, c0.proposed, c0.accepted, c0.bonus) == (5, 12, 7, 5)
    assert (c0.reached, c0.accepted_at, c0.accepted_hist) == ([4, 3, 2], [3, 2, 2], [2, 1, 0, 2])
    assert c0.tau == pytest.approx((7 + 5) / 5)  # 2.4
    assert c0.alpha == pytest.approx(7 / 12)
    assert c0.per_position == pytest.approx([3 / 4, 2 / 3, 2 / 2])

    # req-1: γ = 3, 8 new tokens, wrong drafts at generated indices 0, 2.
    #   step 1: gen 0, drafts idx 0,1,2: idx 0 wrong -> k = 0, recovered g1[0]                gen 1
    #   step 2: gen 1, drafts idx 1,2,3: idx 2 wrong -> k = 1, emits g1[1], recovered g1[2]   gen 3
    #   step 3: gen 3, drafts idx 3,4,5: all right   -> k = 3, emits 3 + bonus g1[6]          gen 7
    #   step 4: gen 7: γ = 8 - 7 - 1 = 0 -> plain step                                        gen 8
    # steps 4, proposed 3+3+3+0 = 9, accepted 0+1+3+0 = 4, bonus 4
    # reached:     s1 [1,0,0] s2 [1,1,0] s3 [1,1,1] -> [3,2,1]
    # accepted_at: s1 [0,0,0] s2 [1,0,0] s3 [1,1,1] -> [2,1,1]
    # hist: k = 0, 1, 3, 0 -> [2, 1, 0, 1]
    c1 = llm.pipeline.stats().per_request["req-1"]
    assert (c1.steps, c1.proposed, c1.accepted, c1.bonus) == (4, 9, 4, 4)
    assert (c1.reached, c1.accepted_at, c1.accepted_hist) == ([3, 2, 1], [2, 1, 1], [2, 1, 0, 1])
    assert c1.tau == pytest.approx((4 + 4) / 4)  # 2.0
    assert c1.alpha == pytest.approx(4 / 9)
    assert c1.per_position == pytest.approx([2 / 3, 1 / 2, 1 / 1])

    # The run: both requests merged.
    run = llm.pipeline.stats().counts
    assert (run.steps, run.proposed, run.accepted, run.bonus) == (9, 21, 11, 9)
    assert (run.reached, run.accepted_at, run.accepted_hist) == ([7, 5, 3], [5, 3, 3], [4, 2, 0, 3])
    assert Fraction(run.accepted + run.bonus, run.steps) == Fraction(20, 9)
    assert run.tau == pytest.approx(20 / 9)
    assert run.alpha == pytest.approx(11 / 21)
    assert run.per_position == pytest.approx([5 / 7, 3 / 5, 3 / 3])


def test_gamma_zero_method_is_plain_decoding(target, generate) -> None:
    # γ = 0: every step proposes nothing and emits one token -> τ = 1, α = 0.
    ps = [[1, 2, 3], [4, 5, 6, 7, 8]]
    ref, _ = generate(target, None, ps, SamplingParams(max_new_tokens=6))
    out, llm = generate(target, NgramConfig(num_speculative_tokens=0), ps, SamplingParams(max_new_tokens=6))
    assert out == ref
    c = llm.pipeline.stats().counts
    assert (c.steps, c.proposed, c.accepted, c.bonus) == (12, 0, 0, 12)
    assert (c.tau, c.alpha) == (1.0, 0.0)


def test_self_draft_tau_is_gamma_plus_one(target, generate) -> None:
    # Drafter == target: every draft kept. 1 prompt, γ = 4, 15 new tokens:
    # steps emit 5, 5, 5 tokens -> τ = 15 / 3 = 5 = γ + 1, α = 1.
    (out,), llm = generate(target, DraftModelConfig(path=str(target.path), num_speculative_tokens=4),
                           [[9, 8, 7]], SamplingParams(max_new_tokens=15))
    c = llm.pipeline.stats().counts
    assert (c.steps, c.proposed, c.accepted, c.bonus) == (3, 12, 12, 3)
    assert (c.tau, c.alpha, c.per_position) == (5.0, 1.0, [1.0] * 4)


def test_self_draft_accepts_everything_while_batch_mates_finish(target, generate) -> None:
    # A self-drafting request must keep α = 1 however its batch-mates come and
    # go. req-1 (7 new tokens, γ = 5) takes one full step (6 tokens), then a
    # last step with γ = 0 while req-0 and req-2 still speculate; that step
    # must not disturb their draft KV caches. (Two long requests, so the batch
    # never shrinks to one request before they finish.)
    ps = [list(range(1, 21)), list(range(30, 35)), list(range(40, 52))]
    sps = [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=7), SamplingParams(max_new_tokens=30)]
    ref, _ = generate(target, None, ps, sps, max_batch_size=4, max_seq_len=64, block_size=4)
    out, llm = generate(target, DraftModelConfig(path=str(target.path), num_speculative_tokens=5), ps, sps,
                        max_batch_size=4, max_seq_len=64, block_size=4)
    assert out == ref  # exact regardless
    c1 = llm.pipeline.stats().per_request["req-1"]
    assert (c1.steps, c1.proposed, c1.accepted) == (2, 5, 5)
    for rid in ("req-0", "req-2"):
        c = llm.pipeline.stats().per_request[rid]
        # 30 tokens, γ = min(5, left): 6+6+6+6+6 -> 5 steps, 25 proposed, all kept.
        assert (c.steps, c.proposed, c.accepted) == (5, 25, 25), (rid, c.summary())


# -- the step-time breakdown (PhaseTimes, measure.step_breakdown) ---------------------------------


@dataclass(frozen=True)
class SleepyConfig(ScriptedConfig):
    """The scripted drafter, whose forward sleeps ``catch_up_s`` (then marks its catch-up) and ``steps_s``."""

    catch_up_s: float = 0.0
    steps_s: float = 0.0


class SleepyDrafter(ScriptedDrafter):
    def __init__(self, config: SleepyConfig) -> None:
        super().__init__()
        self.config = config
        self.calls = 0

    def forward(self, batch: ScriptedBatch, sampling: SamplingTensors) -> DraftTree:  # type: ignore[override]
        self.calls += 1
        time.sleep(self.config.catch_up_s)
        self.caught_up()
        time.sleep(self.config.steps_s)
        return super().forward(batch, sampling)


@register_proposer("sleepy_test", SleepyConfig)
class SleepyProposer(ScriptedProposer):
    def __init__(self, config: SleepyConfig, deps: ProposerDeps | None = None) -> None:
        super().__init__(config, deps)
        self.drafter = SleepyDrafter(config)


def test_step_phases_attribute_the_drafters_time_and_cover_the_run(target, generate) -> None:
    # A drafter that spends 20 ms catching up and 40 ms on its other steps, per call:
    # the breakdown puts each where it belongs, the first step (it carries the prompt)
    # goes to prefill whole, and the phases cover the run's wall time.
    p = [3, 14, 15, 9, 2, 6]
    (g,), _ = generate(target, None, [p], SamplingParams(max_new_tokens=9))
    cfg = SleepyConfig(num_speculative_tokens=2, script=(("req-0", tuple(g)),), catch_up_s=0.02, steps_s=0.04)
    t = time.perf_counter()
    (out,), llm = generate(target, cfg, [p], SamplingParams(max_new_tokens=9))
    wall = time.perf_counter() - t
    assert out == g
    stats = llm.pipeline.stats()
    calls = llm.pipeline.proposer.drafter.calls
    ph = stats.phase_s
    assert stats.counts.steps == calls == 3  # 3 + 3 + 3 tokens, all drafts right
    assert stats.spec_steps == 2  # decode steps: the first one carried the prompt
    slack = 0.05  # seconds in all: sleeps overshoot, and the phases hold a little host work
    assert 0.06 <= ph["prefill"] < 0.06 + slack + 0.5  # the first step's drafting and target forward
    assert 0.02 * 2 <= ph["draft_catch_up"] < 0.02 * 2 + slack
    assert 0.04 * 2 <= ph["draft_steps"] < 0.04 * 2 + slack
    assert ph["target_forward"] > 0 and ph["verify"] > 0 and ph["draft_prepare"] > 0
    assert (stats.draft_time_s, stats.target_time_s) == (ph["draft_catch_up"] + ph["draft_steps"], ph["target_forward"])
    assert sum(ph.values()) < wall
    llm.pipeline.reset_stats()
    assert sum(llm.pipeline.stats().phase_s.values()) == 0 and llm.pipeline.stats().spec_steps == 0


def test_step_breakdown_sets_each_phase_beside_its_bare_cost() -> None:
    from specdec.measure import ForwardTimes, step_breakdown
    from specdec.spec.metrics import PHASES, RunStats

    ph = dict.fromkeys(PHASES, 0.0) | {"draft_catch_up": 0.004, "draft_steps": 0.012, "target_forward": 0.05,
                                       "verify": 0.002, "target_prepare": 0.002}
    full = SpecCounts(steps=2, proposed=8)  # 4 drafts a step: a full γ = 4 chain
    stats = RunStats(counts=full, phase_s=ph, spec_steps=2)  # 70 ms over 2 steps
    bare = ForwardTimes(t_target_1=0.010, t_target_g1=0.020, t_draft_1=0.001, max_rows=5, draft_forwards=4,
                        max_drafts=4)
    b = step_breakdown(stats, 0.080, bare)
    assert b["phases"]["target_forward"] == [25.0, 20.0]  # ms per step: in the loop, bare T_t(γ+1)
    assert b["phases"]["draft_catch_up"] == [2.0, 1.0]  # the first of γ draft forwards
    assert b["phases"]["draft_steps"] == [6.0, 3.0]  # the other γ - 1
    assert b["phases"]["verify"] == [1.0, 0.0]  # host work: the step's bare cost has none
    assert b["bare_step_ms"] == 24.0 and b["step_ms"] == 40.0
    assert abs(b["accounted"] - 70 / 80) < 1e-12 and abs(b["outside_ms"] - 5.0) < 1e-12
    # A drafter without a catch-up (Medusa's heads): all its forwards under draft_steps.
    no_catch = RunStats(counts=full, phase_s=ph | {"draft_catch_up": 0.0}, spec_steps=2)
    assert step_breakdown(no_catch, 0.08, bare)["phases"]["draft_steps"] == [6.0, 4.0]
    # Half the drafts (an n-gram's misses, adaptive γ's plain steps): half the rows and forwards.
    half = step_breakdown(RunStats(counts=SpecCounts(steps=2, proposed=4), phase_s=ph, spec_steps=2), 0.08, bare)
    assert half["phases"]["target_forward"][1] == pytest.approx(15.0)  # T_t(3) on the line T_t(1) .. T_t(5)
    assert half["bare_step_ms"] == pytest.approx(17.0)
    # Bare times without the step's shape (an old forward_times.json): no bare cost, said so.
    old = step_breakdown(stats, 0.08, ForwardTimes(t_target_1=0.010, t_target_g1=0.020))
    assert old["bare_step_ms"] is None and old["phases"]["target_forward"] == [25.0, 0.0]


def test_after_other_forward_times_run_the_other_model_before_each_timed_call(target, generate) -> None:
    # t_target_g1_after_draft: the verification forward timed with the drafter's bare
    # drafting just before every timed call (as a step runs them); t_draft_1_after_target:
    # the drafting timed with a bare verification forward just before every timed call;
    # both only when asked for.
    from specdec.measure import ForwardTimes, limit_from, limit_runs, step_breakdown
    from specdec.spec.metrics import RunStats

    _, llm = generate(target, DraftModelConfig(path=str(target.path), num_speculative_tokens=3),
                      [[3, 14, 15, 9]], SamplingParams(max_new_tokens=4))
    proposer = llm.pipeline.proposer
    own = proposer.draft_forward_time
    calls: list[tuple[int, int, int]] = []  # (repeats, warm-up calls, target forwards run in between)

    def counted(ctx: int, reps: int = 10, *, between=None, warmup: int = 3) -> float:
        ran = [0]

        def before() -> None:
            ran[0] += 1
            between()

        t = own(ctx, reps, between=before if between is not None else None, warmup=warmup)
        calls.append((reps, warmup, ran[0]))
        return t

    proposer.draft_forward_time = counted

    def limit(**after) -> ForwardTimes:  # one timed pass of each bare forward (2 rounds of 3 calls), as a run's
        runs = limit_runs({"m": llm}, 16, chunks=2, repeats=3, **after)
        return limit_from({k: [r.fn()] for k, r in runs.items()}, {"m": llm})["m"]

    plain = limit()
    assert plain.t_target_g1_after_draft is None and plain.t_draft_1_after_target is None  # not measured
    assert plain.step_s(3.0, after_other=True) is None  # ... so not replaced by the bare ones
    assert (plain.max_rows, plain.draft_forwards, plain.max_drafts) == (4, 3.0, 3)  # a chain of γ = 3
    assert calls == [(3, 3, 0), (3, 3, 0)]  # T_draft(1) once per round
    calls.clear()
    t = limit(after_other=True)
    # Per round: T_draft(1) (3 repeats); one drafting (1 call, no warm-up: as a step drafts
    # once) before each of 3 timed verification forwards; T_draft(1) again with a
    # verification forward before each of its 3.
    assert sorted(calls) == [(1, 0, 0)] * 6 + [(3, 3, 0)] * 2 + [(3, 3, 3)] * 2
    assert t.t_target_g1_after_draft > 0 and t.t_draft_1_after_target > 0
    # The step's cost charges the bare forwards unless asked for the after-other ones.
    ft = ForwardTimes(t_target_1=0.010, t_target_g1=0.020, t_draft_1=0.001, max_rows=5, draft_forwards=4,
                      max_drafts=4, t_target_g1_after_draft=0.025, t_draft_1_after_target=0.0015)
    assert ft.step_s(4) == pytest.approx(0.024)
    assert ft.step_s(4, after_other=True) == pytest.approx(0.031)
    b = step_breakdown(RunStats(counts=SpecCounts(steps=1, proposed=4), spec_steps=1), 0.03, ft)
    assert b["target_forward_after_draft_ms"] == 25.0 and b["phases"]["target_forward"][1] == 20.0
    assert b["drafting_after_target_ms"] == pytest.approx(6.0)  # γ drafts at 1.5 ms


def test_a_dynamic_trees_step_is_charged_its_depth_of_draft_forwards(target, generate) -> None:
    # The limit charges what a step runs: a dynamic tree's drafter runs one forward per level
    # (``depth``), not one per node, and the target verifies the budget's rows.
    from specdec.measure import step_shape
    from specdec.spec.tree import TreeConfig

    tree = TreeConfig(kind="dynamic", top_k=2, depth=2)
    _, llm = generate(target, DraftModelConfig(path=str(target.path), num_speculative_tokens=6, tree=tree),
                      [[3, 14, 15, 9]], SamplingParams(max_new_tokens=4))
    assert step_shape(llm) == (7, 2.0, 6)  # rows γ + 1, forwards = depth, drafts = the node budget


def test_bench_checkpoints_in_scratch_dirs_go_when_the_process_exits() -> None:
    # Benches on random targets save checkpoints and heads per run; they must not pile up in /tmp.
    import os
    import subprocess
    import sys
    import tempfile

    code = ("from specdec.measure import scratch_dir\n"
            "d = scratch_dir('specdec-test-'); (d / 'model.safetensors').write_bytes(b'x'); print(d)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    made = out.stdout.strip().splitlines()[-1]
    assert made.startswith(tempfile.gettempdir()) and "specdec-test-" in made
    assert not os.path.exists(made)


# -- lockstep: the runs of a pass timed at once, by turns ------------------------------------


class FakeTimer:
    """Seconds that pass only when a step says so: lockstep's turns, exactly."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _stepper(timer: FakeTimer, log: list[str], name: str, steps: int, step_s: float, result: str):
    """A stepped pass: ``steps`` steps of ``step_s`` each on ``timer``, logged; returns ``result``
    and the pass's own clock reading at its end."""
    def steps_fn(clock):
        start = clock()
        for _ in range(steps):
            timer.now += step_s
            log.append(name)
            yield
        return result, clock() - start
    return steps_fn


def test_lockstep_alternates_the_runs_and_times_each_by_its_own_turns() -> None:
    from specdec.measure import Run, lockstep

    timer, log, whole = FakeTimer(), [], []

    def other() -> str:  # not steppable: it runs whole, before the turns
        whole.append(len(log))
        timer.now += 0.5
        return "o"

    runs = {
        "plain": Run(lambda: None, warmup=lambda: None, steps=_stepper(timer, log, "plain", 36, 0.001, "p")),
        "spec": Run(lambda: None, warmup=lambda: None, steps=_stepper(timer, log, "spec", 12, 0.001, "s")),
        "other": Run(other, warmup=lambda: None),
    }
    t = lockstep(runs, baseline="plain", repeats=2, turn_s=0.0055, timer=timer)
    assert [o[0] for o in t.outputs["plain"]] == ["p", "p"] and [o[0] for o in t.outputs["spec"]] == ["s", "s"]
    assert t.outputs["other"] == ["o", "o"] and whole == [0, 48] and t.times["other"] == [0.5, 0.5]
    turns = [[(k, len(list(g))) for k, g in itertools.groupby(log[a:b])] for a, b in ((0, 48), (48, 96))]
    # Pass 1, equal turns (6 one-ms steps: the one past 5.5 ms ends a turn): spec is done after
    # two turns and plain runs its last 24 steps alone.
    assert turns[0] == [("plain", 6), ("spec", 6), ("plain", 6), ("spec", 6), ("plain", 24)]
    # Pass 2 (rotated: spec first): each turn is turn_s x the run's last time ÷ the baseline's,
    # spec's a third of plain's (2 steps against 6), so the two finish together.
    assert turns[1] == [("spec", 2), ("plain", 6)] * 6
    for name, n in (("plain", 36), ("spec", 12)):
        assert t.times[name] == [pytest.approx(n * 0.001)] * 2  # its own steps, not the other's turns
        assert [own for _, own in t.outputs[name]] == t.times[name]  # its clock ran only in its turns
    assert t.ratios["plain"] == [1.0, 1.0] and t.speedup("spec") == pytest.approx(3.0)


def test_lockstep_needs_its_baseline_in_every_pass() -> None:
    from specdec.measure import Run, lockstep

    with pytest.raises(ValueError, match="baseline 'plain'"):
        lockstep({"spec": Run(lambda: None)}, baseline="plain", repeats=1)
    with pytest.raises(ValueError, match="turn_s"):
        lockstep({"plain": Run(lambda: None)}, baseline="plain", repeats=1, turn_s=0)


def test_limit_runs_time_the_bare_forwards_within_the_passes_and_leave_their_tokens_alone(
        target, generate, monkeypatch) -> None:
    # The analytic limit's bare forwards are contestants of the passes they are a limit
    # for: timed by turns among the passes' own steps (a request mid-flight beside them,
    # in a cache with room for one more), and limit_from takes each forward's median
    # over every round of every pass.
    import statistics

    import specdec.measure as measure
    from specdec.core.pipeline_model import RuntimeConfig
    from specdec.measure import Run, limit_from, limit_runs, lockstep, with_room_for_bare

    rt = with_room_for_bare(RuntimeConfig(max_batch_size=1, max_seq_len=128, block_size=8))
    prompts, sp = [[3, 14, 15, 9, 2, 6]], SamplingParams(max_new_tokens=24, ignore_eos=True)
    ref, llm = generate(target, DraftModelConfig(path=str(target.path), num_speculative_tokens=3), prompts, sp,
                        max_batch_size=1, num_blocks=rt.num_blocks)
    log: list[str] = []
    own = measure.forward_time

    def logged(*a, **k):
        log.append("bare")
        return own(*a, **k)

    def steps(clock):
        gen = llm.generate_steps(prompts, sp, clock=clock)
        try:
            while True:
                next(gen)
                log.append("step")
                yield
        except StopIteration as done:
            return done.value

    monkeypatch.setattr(measure, "forward_time", logged)
    bare = limit_runs({"m": llm}, 16, chunks=3, repeats=2)
    assert sorted(bare) == ["bare m: t1", "bare m: td", "bare m: tg"]
    runs = {"plain": Run(lambda: llm.generate(prompts, sp), steps=steps)} | bare
    timing = lockstep(runs, baseline="plain", repeats=2, turn_s=1e-4)
    for o in timing.outputs["plain"]:  # throwaway requests beside it change none of its tokens
        assert [x.token_ids for x in o] == ref
    # Bare forwards ran while a pass was under way (between two of its steps), not only around it.
    first, last = log.index("step"), len(log) - 1 - log[::-1].index("step")
    assert "bare" in log[first:last]
    for what in ("t1", "tg", "td"):
        rounds = timing.outputs[f"bare m: {what}"]
        assert len(rounds) == 2 and all(len(r) == 3 and min(r) > 0 for r in rounds)
    ft = limit_from(timing, {"m": llm})["m"]
    assert ft.t_target_1 == statistics.median(x for r in timing.outputs["bare m: t1"] for x in r)
    assert ft.t_draft_1 == statistics.median(x for r in timing.outputs["bare m: td"] for x in r)
    assert ft.t_target_g1_after_draft is None  # not timed here
