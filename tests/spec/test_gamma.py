"""Adaptive γ: the cost model, the choice, and exactness of adaptive runs."""

from __future__ import annotations

import types

import pytest

from specdec.api import LLM
from specdec.core.context import SamplingParams, TextContext
from specdec.core.pipeline_model import RuntimeConfig
from specdec.spec.gamma import (
    AdaptiveGamma,
    CostCurve,
    GammaPolicyConfig,
    StepTimes,
    TargetCost,
    choose_gamma,
    expected_tokens,
)
from specdec.spec.proposers.base import DrafterSpec
from specdec.spec.proposers.draft_model import DraftModelConfig
from specdec.spec.proposers.ngram import NgramConfig
from specdec.spec.tree import TreeConfig


def test_expected_tokens() -> None:
    # a = 0.5, γ = 2: 1 + 0.5 + 0.25 = 1.75 per request; two requests: 3.5
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(3.5)
    # a = 0: one token per step whatever γ
    assert expected_tokens([0.0], 4) == pytest.approx(1.0)


def test_cost_curve_interpolates_and_is_monotone() -> None:
    times = {1: 1.0, 4: 2.5, 8: 2.0}  # 8 measured faster than 4: noise
    c = CostCurve(lambda n: times[n], [1, 4, 8])
    assert c.times == [1.0, 2.5, 2.5]  # never cheaper with more tokens
    assert c(1) == 1.0 and c(0) == 1.0
    assert c(2) == pytest.approx(1.5)  # 1.0 + (2.5 - 1.0) * 1/3
    assert c(16) == pytest.approx(2.5)  # flat last segment extrapolated


def test_target_cost_is_measured_per_batch_and_linear_in_tokens_per_request_from_two_on() -> None:
    seen = []

    def measure(b: int, n: int) -> float:
        seen.append((b, n))
        # B requests of n tokens; from 2 tokens a request's rows attend under a mask: + 1.0
        return b * (1.0 + 0.5 * (n - 1)) + (1.0 if n > 1 else 0.0)

    t = TargetCost.measure(measure, [1, 4], 5)
    assert sorted(seen) == [(1, 1), (1, 2), (1, 5), (4, 1), (4, 2), (4, 5)]
    assert t(1, 1) == 1.0 and t(4, 5) == 13.0
    assert t(4, 2) == pytest.approx(7.0)  # measured: a line from n = 1 (4.0) to 5 would say 6.25
    assert t(4, 3) == pytest.approx(9.0)  # a third of the way from n = 2 (7.0) to n = 5 (13.0)
    assert t(2, 1) == pytest.approx(2.0)  # interpolated over B
    # γ = 1 (n = 2) pays that step: at acceptance 0.6 (1.6 tokens a request) it loses to plain,
    # where the line from n = 1 to 5 would have drafted.
    assert choose_gamma([0.6] * 4, 1, t, lambda b: 0.0) == 0
    line = lambda b, n: t(b, 1) + (t(b, 5) - t(b, 1)) * (n - 1) / 4  # noqa: E731
    assert choose_gamma([0.6] * 4, 1, line, lambda b: 0.0) == 1
    # Two points only (γ = 1): n = 2 is the last one.
    t2 = TargetCost.measure(measure, [1, 4], 2)
    assert t2(4, 2) == pytest.approx(7.0) and t2(4, 1) == 4.0


def test_target_cost_is_timed_by_turns_so_a_slow_spell_does_not_skew_its_ratios() -> None:
    true = {1: 1.0, 2: 1.6, 5: 2.0}  # T(1, n): the ratios adaptive γ decides on
    calls: list[int] = []

    def measure(b: int, n: int) -> float:
        calls.append(n)
        slow = 2 <= len(calls) <= 4  # a spell of three calls at half speed
        return true[n] * (2.0 if slow else 1.0)

    t = TargetCost.measure(measure, [1], 5, rounds=2)
    assert calls == [1, 2, 5, 1, 2, 5]  # one call per n in each round
    assert [t(1, n) for n in (1, 2, 5)] == [1.0, 1.6, 2.0]
    # One round: the spell falls on n = 2 and 5 alone, and γ = 1 looks twice as dear as it is.
    calls.clear()
    one = TargetCost.measure(measure, [1], 5, rounds=1)
    assert [one(1, n) for n in (1, 2, 5)] == [1.0, 3.2, 4.0]


def test_choose_gamma() -> None:
    flat = lambda b, n: 1.0  # noqa: E731  memory-bound target: extra tokens are free
    linear = lambda b, n: float(b * n)  # noqa: E731  compute-bound target: cost grows with tokens
    free = lambda b: 0.0  # noqa: E731  model-free drafter
    # Free drafts, free verification, good acceptance: draft all the way.
    assert choose_gamma([0.8], 4, flat, free) == 4
    # Compute-bound target: verifying γ+1 tokens costs γ+1 times more; plain wins.
    assert choose_gamma([0.8] * 8, 4, linear, free) == 0
    # A drafter as expensive as the target cannot pay at a = 0.5:
    # γ=1: 1.5 / (1 + 1) = 0.75 tokens/s < 1 for plain.
    assert choose_gamma([0.5], 4, flat, lambda b: 1.0) == 0
    # A gain under min_gain is not worth it: a = 0.04, flat target, free drafts:
    # γ=1 gives 1.04 tokens per unit time, 4% over plain.
    assert choose_gamma([0.04], 1, flat, free, min_gain=0.0) == 1
    assert choose_gamma([0.04], 1, flat, free, min_gain=0.05) == 0
    # A one-time catch-up is paid back only over the tokens left: a = 0.5, γ = 1 gives 1.5
    # tokens per unit (plain: 1). 32 tokens left after a catch-up of 20 units:
    # 32 / (20 + 32 / 1.5) = 0.77 < 1, plain; with 320 left, 320 / (20 + 213) = 1.37.
    assert choose_gamma([0.5], 1, flat, free) == 1
    assert choose_gamma([0.5], 1, flat, free, catch_up_s=20.0, remaining_tokens=32) == 0
    assert choose_gamma([0.5], 1, flat, free, catch_up_s=20.0, remaining_tokens=320) == 1
    # A drafter whose full γ (here 4) is cheaper per draft (compiled, fused) is charged that there:
    # a = 0.8, drafts 0.25 each: γ=2 gives 2.44 / 1.5 = 1.63, γ=4 3.36 / 2 = 1.68 and
    # γ=3 2.95 / 1.75 = 1.69, the best; at 0.1 a draft for γ=4 (1.4): 3.36 / 1.4 = 2.40.
    quarter = lambda b: 0.25  # noqa: E731
    assert choose_gamma([0.8], 4, flat, quarter) == 3
    assert choose_gamma([0.8], 4, flat, quarter, fused=(4, lambda b: 0.1)) == 4
    assert choose_gamma([0.8], 3, flat, quarter, fused=(4, lambda b: 0.1)) == 3  # γ=4 is not on offer


def test_a_dynamic_tree_is_charged_its_levels_not_a_forward_per_node() -> None:
    """A dynamic tree drafts its ``depth`` levels whatever its node budget γ. Flat target,
    drafts at 0.5, a = 0.8: charged a forward per node, γ = 2 is the best (2.44 / 2 = 1.22,
    γ = 4: 3.36 / 3 = 1.12); charged its 2 levels, γ = 4 is (3.36 / 2 = 1.68)."""
    flat = lambda b, n: 1.0  # noqa: E731
    half = lambda b: 0.5  # noqa: E731
    assert choose_gamma([0.8], 4, flat, half) == 2
    assert choose_gamma([0.8], 4, flat, half, draft_forwards=DrafterSpec(depth=2).draft_forwards) == 4


def _tree_policy(t_target, accepted: dict[int, int]) -> AdaptiveGamma:
    """Adaptive γ for a dynamic tree 3 deep with a budget of 12 nodes, drafts at 0.1 a level,
    after 100 request steps at each node count in ``accepted`` (its accepted tokens each)."""
    tree = TreeConfig(kind="dynamic", top_k=4, depth=3, total_tokens=12)
    proposer = types.SimpleNamespace(spec=DrafterSpec(node_budget=True, depth=3),
                                     config=types.SimpleNamespace(tree=tree))
    ag = AdaptiveGamma(GammaPolicyConfig(adaptive=True, explore_tokens=0), 12, target=None, proposer=proposer,
                       measure_steps=False)
    ag.curves = (TargetCost.measure(t_target, [1, 4], 13), CostCurve(lambda b: 0.1, [1, 4]))
    for size, k in accepted.items():
        for key in range(100):
            ag.record(key, k, k + (k < 3), size=size)
    return ag


def test_a_tree_picks_plain_the_chain_sized_tree_or_its_budget_by_what_each_size_accepts() -> None:
    """Batch 4, tree 3 deep, budget 12 (both sizes draft 3 levels: 0.3). (a) Flat target, the
    wide tree accepts 2 a step, the chain-sized one 1: 12 / 1.3 = 9.2 tokens a unit beats
    8 / 1.3 = 6.2 (and plain's 4): 12 nodes. (b) A target whose forward grows 0.15 a token:
    12 nodes cost 1 + 1.8 + 0.3 = 3.1 (12 / 3.1 = 3.9 < plain's 4), 3 nodes 1.75 (8 / 1.75 =
    4.6): 3 nodes. (c) Nothing accepted: plain. (d) A size never run (a budget capped to 8) is
    credited the budget's estimate (chain model, acceptance 0.6: 1.5 accepted), so it is tried."""
    sp = SamplingParams(max_new_tokens=64)
    batch = [TextContext(request_id=r, tokens=[1, 2, 3], prompt_len=3, sampling=sp) for r in "abcd"]
    flat = lambda b, n: 1.0  # noqa: E731
    growing = lambda b, n: 1.0 + 0.15 * (n - 1)  # noqa: E731
    assert _tree_policy(flat, {3: 1, 12: 2}).choose(batch, [12] * 4, False) == 12
    assert _tree_policy(growing, {3: 1, 12: 2}).choose(batch, [12] * 4, False) == 3
    assert _tree_policy(flat, {3: 0, 12: 0}).choose(batch, [12] * 4, False) == 0
    assert _tree_policy(flat, {3: 1, 12: 2}).choose(batch, [8] * 4, False) == 8


def test_step_times_give_a_ratio_once_both_sides_have_enough_steps() -> None:
    st = StepTimes(window=4, min_steps=3)
    for t in (1.0, 1.0):
        st.record(4, 0, t)
        st.record(4, 2, 3 * t)
    assert st.ratio(4, 2) is None  # two steps each: too few
    st.record(4, 0, 9.0)  # a slow plain step: the median shrugs it off
    assert st.ratio(4, 2) is None  # plain has 3, γ = 2 still 2
    st.record(4, 2, 3.0)
    assert st.ratio(4, 2) == pytest.approx(3.0)
    assert st.ratio(4, 1) is None and st.ratio(2, 2) is None  # other γ, other batch sizes: none
    for _ in range(4):  # the window keeps the last 4: older steps drop out
        st.record(4, 2, 1.5)
    assert st.ratio(4, 2) == pytest.approx(1.5)


def test_measured_step_ratios_replace_the_modelled_cost() -> None:
    flat = lambda b, n: 1.0  # noqa: E731
    free = lambda b: 0.0  # noqa: E731
    # Modelled: free drafts and verification, so γ = 4 (3.36 tokens for the cost of one).
    assert choose_gamma([0.8], 4, flat, free) == 4
    # Measured: a γ = 4 step takes 4x a plain step (host work the model leaves out):
    # 3.36 / 4 = 0.84 < 1; γ = 1..3 unmeasured keep the model's cost, so γ = 3 (2.95 / 1).
    four = lambda b, g: 4.0 if g == 4 else None  # noqa: E731
    assert choose_gamma([0.8], 4, flat, free, measured=four) == 3
    # Every γ measured at 2x plain: γ = 4 gives 3.36 / 2 = 1.68, still the best.
    assert choose_gamma([0.8], 4, flat, free, measured=lambda b, g: 2.0) == 4
    # A measured γ = 1 step at 1.63x plain (the n-gram's at batch 4): at a = 0.5 it gives
    # 1.5 / 1.63 = 0.92 of plain, so plain, where the model's free γ = 1 gave 1.5.
    assert choose_gamma([0.5] * 4, 1, flat, free) == 1
    assert choose_gamma([0.5] * 4, 1, flat, free, measured=lambda b, g: 1.63) == 0
    # Measured per batch size: only batch 4 is.
    at4 = lambda b, g: 1.63 if b == 4 else None  # noqa: E731
    assert choose_gamma([0.5] * 2, 1, flat, free, measured=at4) == 1


_STATIC = [[0], [1], [0, 0], [0, 1], [0, 0, 0], [1, 0]]  # 6 nodes, 3 deep: its first 3 reach depth 2


def _adaptive_method(tiny_llama, target, method: str):
    """(config, budget N, chain-sized count D) of ``method`` under adaptive γ."""
    from eagle_heads import head_for  # tests/spec/eagle_heads.py
    from medusa_heads import medusa_for  # tests/spec/medusa_heads.py

    from specdec.spec.proposers.eagle import Eagle3Config
    from specdec.spec.proposers.medusa import MedusaConfig

    draft = tiny_llama(qk_scale=0.3, perturb=0.01)
    dynamic = TreeConfig(kind="dynamic", top_k=2, depth=3, total_tokens=6)
    static = TreeConfig(kind="static", choices=_STATIC)
    if method == "ngram":
        return NgramConfig(num_speculative_tokens=4, adaptive_gamma=True), 4, 4
    if method == "medusa_static_tree":
        return MedusaConfig(path=str(medusa_for(target, "medusa-echo")), num_speculative_tokens=6,
                            adaptive_gamma=True, tree=static), 6, 3
    if method == "eagle3_tree":
        return Eagle3Config(path=str(head_for(target, "eagle3")), num_speculative_tokens=6, adaptive_gamma=True,
                            tree=dynamic), 6, 3
    tree = {"draft_model": TreeConfig(), "draft_model_tree": dynamic, "draft_model_static_tree": static}[method]
    return DraftModelConfig(path=str(draft.path), num_speculative_tokens=6 if tree.is_tree else 4,
                            adaptive_gamma=True, tree=tree), (6 if tree.is_tree else 4), (3 if tree.is_tree else 4)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_model_tree", "draft_model_static_tree",
                                    "eagle3_tree", "medusa_static_tree"])
def test_adaptive_gamma_is_exact(tiny_llama, method: str) -> None:
    """Outputs equal plain decoding's under the calibrated model, and for a tree also under a
    cost model where drafting pays, so steps draft the chain-sized tree and the whole budget."""
    target = tiny_llama(qk_scale=0.3)  # loopy greedy output: n-gram drafts get accepted
    cfg, budget, chain = _adaptive_method(tiny_llama, target, method)
    rt = RuntimeConfig(max_batch_size=8, max_seq_len=96)
    prompts = [[1, 2, 3, 4, 5] * 3, [7, 8, 9], [11, 12, 13, 14] * 2, [20]]
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(target.path, runtime=rt).generate(prompts, sp)]
    llm = LLM(target.path, method=cfg, runtime=rt)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == plain
    ag = llm.pipeline.adaptive
    assert ag.curves is not None  # calibrated at build time
    if budget == chain:
        return
    # Free drafts and verification, learning from scratch: the chain-sized tree runs first
    # (a tie, and the smaller wins), then the budget, credited the prior's estimate, is tried.
    ag.policy = GammaPolicyConfig(adaptive=True, explore_tokens=0, prior_accept=0.9, min_gain=0.0)
    ag.curves = (TargetCost.measure(lambda b, n: 1.0, [1, 8], budget + 1), CostCurve(lambda b: 0.0, [1, 8]))
    ag.step_times, ag.fused, ag.drafter, ag.by_size = None, None, [0, 0], {}
    chosen: list[int] = []
    choose = ag.choose
    ag.choose = lambda *a: chosen.append(choose(*a)) or chosen[-1]
    assert [o.token_ids for o in llm.generate(prompts, sp)] == plain
    assert {chain, budget} <= set(chosen) <= {0, chain, budget}


def test_a_tree_accepted_to_its_depth_counts_no_rejection(tiny_llama) -> None:
    """A drafter that is the target accepts every step's path to the tree's deepest node:
    nothing was rejected, so its acceptance is 1 (not accepted / nodes), whichever size ran."""
    target = tiny_llama(qk_scale=0.3)
    tree = TreeConfig(kind="static", choices=[[0], [1], [0, 0], [0, 0, 0]])  # 4 nodes, 3 deep
    llm = LLM(target.path, method=DraftModelConfig(path=str(target.path), num_speculative_tokens=4,
                                                   adaptive_gamma=True, tree=tree),
              runtime=RuntimeConfig(max_batch_size=2, max_seq_len=96))
    ag = llm.pipeline.adaptive
    ag.policy = GammaPolicyConfig(adaptive=True, explore_tokens=0, prior_accept=0.9)
    ag.curves = (TargetCost.measure(lambda b, n: 1.0, [1, 2], 5), CostCurve(lambda b: 0.01, [1, 2]))
    ag.step_times = None
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert ag.by_size.get(4, [0, 0])[1] > 0  # the whole budget ran (3 accepted of 4 nodes a step) ...
    assert ag.drafter[0] == ag.drafter[1] > 0  # ... and rejected nothing


def _call(llm: LLM, prompts: list[list[int]], ids: list[str], sp: SamplingParams) -> int:
    """One batch with these request ids; returns the drafts it proposed."""
    before = llm.pipeline.stats().counts
    engine = llm.new_engine()
    for p, rid in zip(prompts, ids):
        engine.add_request(p, sp, request_id=rid)
    engine.run()
    after = llm.pipeline.stats().counts
    return after.proposed - before.proposed


def _adaptive(tiny_llama, **policy) -> LLM:
    target = tiny_llama(seed=0)
    draft = tiny_llama(seed=0, perturb=0.01, perturb_seed=1)  # a good drafter
    cfg = DraftModelConfig(path=str(draft.path), num_speculative_tokens=4, adaptive_gamma=True)
    llm = LLM(target.path, method=cfg, runtime=RuntimeConfig(max_batch_size=2, max_seq_len=96))
    llm.pipeline.adaptive.policy = GammaPolicyConfig(adaptive=True, **policy)
    # Flat target, drafts at 0.3 a token: the prior's 0.6 acceptance picks γ = 1,
    # a learned high acceptance picks more.
    llm.pipeline.adaptive.curves = (TargetCost.measure(lambda b, n: 1.0, [1, 2], 5), CostCurve(lambda b: 0.3, [1, 2]))
    return llm


def test_adaptive_gamma_carries_no_request_state_over_reused_ids(tiny_llama) -> None:
    """Engines on one pipeline may reuse request ids ("req-0" …). What one request learnt must
    not pass to a later one with its id: a second call with the same ids proposes exactly what it would with
    fresh ids (the drafter-wide estimate, which every later request starts from, is the same)."""
    prompts, sp = [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=24, ignore_eos=True)
    second = {}
    for ids in (["r0", "r1"], ["s0", "s1"]):
        llm = _adaptive(tiny_llama)
        assert _call(llm, prompts, ["r0", "r1"], sp) > 0
        second[ids[0]] = _call(llm, prompts, ids, sp)
    assert second["r0"] == second["s0"] > 0


def test_adaptive_gamma_learns_the_drafter_before_it_turns_speculation_off(tiny_llama) -> None:
    """A prior far too low for the drafter predicts no gain. Without exploration the pipeline
    then never drafts and never learns (the trap); with it, the first steps draft, the
    drafter-wide acceptance is learnt, and later requests speculate from the start."""
    prompts, sp = [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=24, ignore_eos=True)
    trapped = _adaptive(tiny_llama, prior_accept=0.05, explore_tokens=0)
    assert _call(trapped, prompts, ["a", "b"], sp) == 0
    assert _call(trapped, prompts, ["c", "d"], sp) == 0
    learns = _adaptive(tiny_llama, prior_accept=0.05, explore_tokens=8)
    first = _call(learns, prompts, ["a", "b"], sp)
    assert first > 8  # explored, then kept drafting on what it learnt
    acc, tried = learns.pipeline.adaptive.drafter
    assert tried >= 8 and acc / tried > 0.6
    # A new request starts from the learnt estimate: its first step drafts (the trapped
    # pipeline's would not).
    fresh = [TextContext(request_id="new", tokens=[1, 2, 3], prompt_len=3, sampling=sp)]
    learns.pipeline.adaptive.step_times = None  # the model's choice (no probe to time plain steps)
    assert learns.pipeline.adaptive.choose(fresh, [4], False) > 0 and trapped.pipeline.adaptive.choose(fresh, [4], False) == 0


def test_exploration_stops_where_speculation_cannot_pay(tiny_llama) -> None:
    """Verifying costs as much per token as decoding (a compute-bound target): however good
    the drafter, plain decoding wins, so after its exploration the pipeline drafts no more."""
    llm = _adaptive(tiny_llama, explore_tokens=8)
    llm.pipeline.adaptive.curves = (TargetCost.measure(lambda b, n: float(b * n), [1, 2], 5),
                                    CostCurve(lambda b: 0.3, [1, 2]))
    prompts, sp = [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=24, ignore_eos=True)
    assert _call(llm, prompts, ["a", "b"], sp) > 0  # exploring steps only: ...
    assert llm.pipeline.adaptive.drafter[1] < 8 + 2 * 4  # ... it stopped once 8 drafts were tried
    assert _call(llm, prompts, ["c", "d"], sp) == 0


def test_plain_chosen_for_a_batch_is_not_worked_out_again_until_the_batch_changes(tiny_llama, monkeypatch) -> None:
    """Where speculation cannot pay, the model runs once per batch composition, not every step
    (a step that drafts nothing cannot make speculation pay better); outputs stay plain's."""
    from specdec.spec import gamma as gamma_module

    llm = _adaptive(tiny_llama, explore_tokens=0)
    llm.pipeline.adaptive.curves = (TargetCost.measure(lambda b, n: float(b * n), [1, 2], 5),
                                            CostCurve(lambda b: 0.3, [1, 2]))  # compute-bound: plain always wins
    calls: list[int] = []
    choose = gamma_module.choose_gamma
    monkeypatch.setattr(gamma_module, "choose_gamma", lambda accept, *a, **k: calls.append(len(accept))
                        or choose(accept, *a, **k))
    prompts, sp = [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = LLM(tiny_llama(seed=0).path, runtime=RuntimeConfig(max_batch_size=2, max_seq_len=96))
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, sp)]
    assert llm.pipeline.stats().counts.proposed == 0
    assert calls == [2]  # both requests start together and end together: one batch, one decision
    calls.clear()
    llm.generate(prompts[:1], sp)
    llm.generate(prompts[1:], sp)
    assert calls == [1, 1]  # a new batch is worked out anew (the same request id, another request)


def test_adaptive_gamma_measures_decode_steps_and_follows_them(tiny_llama) -> None:
    """Decode steps are measured by (batch size, γ chosen); prefill steps are not. Where
    measured steps say speculation costs more than it brings, the pipeline decodes plain
    though the forwards alone predict a gain; outputs stay plain's either way."""
    prompts, sp = [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(tiny_llama(seed=0).path,
                                      runtime=RuntimeConfig(max_batch_size=2, max_seq_len=96)).generate(prompts, sp)]
    free = _adaptive(tiny_llama, explore_tokens=0)
    free.pipeline.adaptive.step_times = StepTimes(window=1000)
    assert [o.token_ids for o in free.generate(prompts, sp)] == plain
    times = free.pipeline.adaptive.step_times.counts()
    assert sum(times.values()) == free.pipeline.num_spec_steps  # every decode step, no prefill
    assert {b for b, _ in times} <= {1, 2} and any(g > 0 for _, g in times)
    assert free.pipeline.stats().counts.proposed > 0  # the flat cost model speculates
    slow = _adaptive(tiny_llama, explore_tokens=0)
    for b in (1, 2):  # measured: any drafting step takes 10x a plain step
        for g in range(5):
            for _ in range(8):
                slow.pipeline.adaptive.step_times.record(b, g, 10.0 if g else 1.0)
    assert [o.token_ids for o in slow.generate(prompts, sp)] == plain
    assert slow.pipeline.stats().counts.proposed == 0


def test_a_step_carrying_a_prompt_beside_other_requests_drafts_nothing(tiny_llama) -> None:
    """At batch > 1, a step with prompt rows decodes plain (drafting there throws the requests
    out of step with each other); decode-only steps still draft, and every request's output
    is plain decoding's. A third request joins while the first still decodes, so its
    prompt lands in a mixed step."""
    llm = _adaptive(tiny_llama, explore_tokens=0)  # the flat cost model: speculates
    pipe = llm.pipeline
    drafted: list[tuple[int, bool]] = []  # (batch size, step carries prompt rows) per drafting step
    plain_steps: list[tuple[int, bool]] = []
    prepare, plain_step = pipe.proposer.prepare, pipe.plain.decode

    def spy_prepare(batch, *a, **k):
        drafted.append((len(batch), pipe.module.times.prefilling))
        return prepare(batch, *a, **k)

    def spy_plain(batch, num_new):
        plain_steps.append((len(batch), max(num_new) > 1))
        return plain_step(batch, num_new)

    pipe.proposer.prepare, pipe.plain.decode = spy_prepare, spy_plain
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12]]
    lengths = [24, 6, 12]  # the second ends early: the third's prompt joins the first's decoding
    engine = llm.new_engine()
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True), request_id=f"r{i}")
    got = {r.request_id: r.generated for r in engine.run()}
    plain = LLM(tiny_llama(seed=0).path, runtime=RuntimeConfig(max_batch_size=2, max_seq_len=96))
    want = [o.token_ids for o in plain.generate(prompts[:1], SamplingParams(max_new_tokens=24, ignore_eos=True))
            + plain.generate(prompts[1:2], SamplingParams(max_new_tokens=6, ignore_eos=True))
            + plain.generate(prompts[2:], SamplingParams(max_new_tokens=12, ignore_eos=True))]
    assert [got[f"r{i}"] for i in range(3)] == want
    assert (2, True) in plain_steps  # a mixed step happened, and ran plain ...
    assert drafted and all(not (b > 1 and pre) for b, pre in drafted)  # ... and no drafting step was one
    assert any(b == 2 for b, _ in drafted)  # decode-only steps at batch 2 still draft


def _policy(**policy) -> tuple[AdaptiveGamma, list[TextContext]]:
    """An AdaptiveGamma on a flat target (1 s a forward at any size) and drafts at 0.3 s,
    no model behind it, and three fresh requests."""
    proposer = types.SimpleNamespace(spec=DrafterSpec())  # drafts before verification
    ag = AdaptiveGamma(GammaPolicyConfig(adaptive=True, **policy), 4, target=None, proposer=proposer)
    ag.curves = (TargetCost.measure(lambda b, n: 1.0, [1, 2], 5), CostCurve(lambda b: 0.3, [1, 2]))
    sp = SamplingParams(max_new_tokens=24)
    return ag, [TextContext(request_id=r, tokens=[1, 2, 3], prompt_len=3, sampling=sp) for r in "abc"]


def test_adaptive_gamma_learns_from_recorded_steps_and_forgets_finished_requests() -> None:
    ag, (a, b, c) = _policy(prior_accept=0.05, explore_tokens=0)
    assert ag.choose([a], [4], False) == 0  # the prior alone predicts no gain
    assert ag.still_plain([a]) and not ag.still_plain([b])  # the same batch, until something changes
    ag.record(c.key, 100, 100)  # another request accepted everything
    assert not ag.still_plain([a])
    ag.record(a.key, 0, 40)  # ... and this one nothing
    assert ag.choose([a], [4], False) == 0  # its own record outweighs the drafter's
    assert ag.choose([b], [4], False) > 0  # a new request starts from the drafter's
    ag.forget(a.key)
    assert ag.choose([a], [4], False) > 0  # forgotten: it starts from the drafter's too
    assert ag.drafter == [100, 140]  # (the drafter-wide record stays)


def test_adaptive_gamma_runs_a_mixed_step_plain_and_times_steps_at_the_gamma_chosen() -> None:
    ag, (a, b, _) = _policy(prior_accept=0.9, explore_tokens=0)
    g = ag.choose([a, b], [4, 4], False)
    assert g > 0
    ag.record_step(2, 0.5)
    assert ag.choose([a, b], [4, 4], True) == 0  # prompt rows beside other requests: plain
    ag.record_step(2, 0.25)
    assert ag.choose([a], [4], True) > 0  # ... not for one request alone
    assert ag.step_times is not None and ag.step_times.counts() == {(2, g): 1, (2, 0): 1}


def test_calibration_fits_the_kv_cache_it_has_or_names_the_setting(tiny_llama) -> None:
    target = tiny_llama(seed=0)
    method = NgramConfig(num_speculative_tokens=4, adaptive_gamma=True)
    # Room for 3 of the 4 requests' calibration batches: it calibrates up to 3 and runs exactly.
    rt = RuntimeConfig(num_blocks=40, block_size=8, max_batch_size=4, max_seq_len=96)
    llm = LLM(target.path, method=method, runtime=rt)
    plain = LLM(target.path, runtime=rt)
    sp = SamplingParams(max_new_tokens=12)
    assert [o.token_ids for o in llm.generate([[1, 2, 3]] * 4, sp)] == \
        [o.token_ids for o in plain.generate([[1, 2, 3]] * 4, sp)]
    with pytest.raises(ValueError, match=r"raise runtime.num_blocks .*adaptive_gamma=false"):
        LLM(target.path, method=method, runtime=RuntimeConfig(num_blocks=4, block_size=8, max_batch_size=4,
                                                                max_seq_len=96))


def test_where_the_model_speculates_plain_steps_are_timed_by_turns_then_the_measurement_decides() -> None:
    """The model leaves host work out, so it may speculate where that loses. Until a batch size
    holds min_steps plain steps, every other step the model would draft in runs plain (timed
    by turns with the drafting ones); then measured steps decide: a drafting step at 4x a
    plain one loses (plain from then on), at 1.2x it pays (drafting, no more probes)."""
    for spec_time, pays in ((4.0, False), (1.2, True)):
        ag, (a, b, _) = _policy(prior_accept=0.9, explore_tokens=0)
        st = ag.step_times
        assert st is not None
        picks = []
        for _ in range(64):
            g = ag.choose([a, b], [4, 4], False)
            picks.append(g)
            ag.record_step(2, spec_time if g else 1.0)
        assert picks[0] > 0 and picks[1] == 0 and picks[2] > 0  # probes by turns ...
        assert picks[: 2 * st.min_steps].count(0) == st.min_steps
        if pays:  # ... only until plain is timed
            assert 0 not in picks[2 * st.min_steps:] and st.count(2, 0) == st.min_steps
        else:
            assert picks[-8:] == [0] * 8 and ag.still_plain([a, b])


def test_a_drafter_that_drafts_after_verification_is_not_probed() -> None:
    """An EAGLE-style drafter's γ = 0 step still drafts for the next one: no plain step to time."""
    ag, (a, b, _) = _policy(prior_accept=0.9, explore_tokens=0)
    ag.proposer = types.SimpleNamespace(spec=DrafterSpec(drafts_after_verify=True))
    for _ in range(4):
        assert ag.choose([a, b], [4, 4], False) > 0
        ag.record_step(2, 1.0)


def test_a_speculating_pipeline_times_plain_steps_and_stays_exact(tiny_llama) -> None:
    """A real run where the model speculates: some decode steps at batch 2 run plain (the
    probes), the rest draft, and every output is plain decoding's."""
    llm = _adaptive(tiny_llama, explore_tokens=0)  # the flat cost model: speculates
    prompts, sp = [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = LLM(tiny_llama(seed=0).path, runtime=RuntimeConfig(max_batch_size=2, max_seq_len=96))
    assert [o.token_ids for o in llm.generate(prompts, sp)] == [o.token_ids for o in plain.generate(prompts, sp)]
    st = llm.pipeline.adaptive.step_times
    assert 0 < st.count(2, 0) <= st.min_steps
    assert any(n for (b, g), n in st.counts().items() if b == 2 and g > 0)
    assert llm.pipeline.stats().counts.proposed > 0


def test_where_nothing_pays_a_step_is_a_plain_step_and_the_drafter_does_no_work(tiny_llama) -> None:
    """A compute-bound target (verifying n tokens costs n plain steps): every decode step
    takes plain decoding's path (PlainGeneration.decode); the drafter is never asked to
    draft and the draft-and-verify module never runs; outputs are plain decoding's."""
    llm = _adaptive(tiny_llama, explore_tokens=0)
    pipe = llm.pipeline
    pipe.adaptive.curves = (TargetCost.measure(lambda b, n: float(b * n), [1, 2], 5), CostCurve(lambda b: 0.3, [1, 2]))
    calls = {"prepare": 0, "module": 0, "plain": 0}
    prepare, module, decode = pipe.proposer.prepare, pipe.module.forward, pipe.plain.decode

    def count(name, fn):
        def spy(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return spy

    pipe.proposer.prepare, pipe.module.forward, pipe.plain.decode = (
        count("prepare", prepare), count("module", module), count("plain", decode))
    prompts, sp = [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = LLM(tiny_llama(seed=0).path, runtime=RuntimeConfig(max_batch_size=2, max_seq_len=96))
    assert [o.token_ids for o in llm.generate(prompts, sp)] == [o.token_ids for o in plain.generate(prompts, sp)]
    assert calls["prepare"] == calls["module"] == 0
    assert calls["plain"] >= 23  # every decode step (24 tokens each, one per step, both requests at once)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("pays", [False, True])
def test_a_drafter_that_drafts_after_verification_drafts_one_where_adaptive_gamma_runs_plain(
        tiny_llama, pays: bool, tree: bool) -> None:
    """EAGLE drafts the next step's tokens after verification. Where adaptive γ runs a step
    plain it drafts just one (the head still catches up, so speculation can resume), not the
    method's γ; where speculation pays it drafts the full γ. Outputs are plain decoding's."""
    from eagle_heads import head_for  # tests/spec/eagle_heads.py

    from specdec.spec.proposers.eagle import EagleConfig

    target = tiny_llama(seed=0, qk_scale=0.1)
    shape = TreeConfig(kind="static", choices=[[0], [1], [0, 0], [0, 1]]) if tree else TreeConfig()
    llm = LLM(target.path, method=EagleConfig(path=str(head_for(target, "eagle-echo")), num_speculative_tokens=4,
                                              adaptive_gamma=True, tree=shape),
              runtime=RuntimeConfig(max_batch_size=2, max_seq_len=96))
    ag = llm.pipeline.adaptive
    ag.policy = GammaPolicyConfig(adaptive=True, explore_tokens=0, prior_accept=0.9)
    cost = (lambda b, n: 1.0) if pays else (lambda b, n: float(b * n))  # noqa: E731  flat or compute-bound
    ag.curves = (TargetCost.measure(cost, [1, 2], 5), CostCurve(lambda b: 0.05, [1, 2]))
    drafted: list[int] = []
    draft_after = llm.pipeline.proposer.drafter.draft_after

    def spy(step, gamma, sampling):
        drafted.append(gamma)
        return draft_after(step, gamma, sampling)

    llm.pipeline.proposer.drafter.draft_after = spy
    prompts, sp = [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = LLM(target.path, runtime=RuntimeConfig(max_batch_size=2, max_seq_len=96))
    assert [o.token_ids for o in llm.generate(prompts, sp)] == [o.token_ids for o in plain.generate(prompts, sp)]
    assert drafted and (max(drafted) == 4 if pays else set(drafted) == {1})
