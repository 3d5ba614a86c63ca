"""Adaptive γ: the cost model, the choice, and exactness of adaptive runs."""

from __future__ import annotations

import pytest

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.spec.gamma import CostCurve, choose_gamma, expected_tokens
from specdec.spec.proposers.draft_model import DraftModelConfig
from specdec.spec.proposers.ngram import NgramConfig


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


def test_choose_gamma() -> None:
    flat = lambda n: 1.0  # noqa: E731  memory-bound target: extra tokens are free
    linear = lambda n: float(n)  # noqa: E731  compute-bound target: cost grows with tokens
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


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_adaptive_gamma_is_exact(tiny_llama, method: str) -> None:
    target = tiny_llama(qk_scale=0.3)  # loopy greedy output: n-gram drafts get accepted
    draft = tiny_llama(qk_scale=0.3, perturb=0.01)
    cfg = (NgramConfig(num_speculative_tokens=4, adaptive_gamma=True) if method == "ngram"
           else DraftModelConfig(path=str(draft.path), num_speculative_tokens=4, adaptive_gamma=True))
    rt = RuntimeConfig(max_batch_size=8, max_seq_len=96)
    prompts = [[1, 2, 3, 4, 5] * 3, [7, 8, 9], [11, 12, 13, 14] * 2, [20]]
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(target.path, runtime=rt).generate(prompts, sp)]
    llm = LLM(target.path, method=cfg, runtime=rt)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == plain
    assert llm.pipeline._curves is not None  # calibrated at build time


def test_adaptive_gamma_starts_fresh_for_each_request(tiny_llama) -> None:
    """A second generate() reuses request ids ("req-0" …); the adaptive policy
    must not carry the first call's acceptance into it."""
    target = tiny_llama(seed=0)
    draft = tiny_llama(seed=0, perturb=0.01, perturb_seed=1)  # a good drafter
    cfg = DraftModelConfig(path=str(draft.path), num_speculative_tokens=4, adaptive_gamma=True)
    llm = LLM(target.path, method=cfg, runtime=RuntimeConfig(max_batch_size=2, max_seq_len=96))
    # Flat target, drafts at 0.3 a token: the prior's 0.6 acceptance picks γ = 1,
    # a learned high acceptance picks more. The γ sequence then shows what was carried over.
    llm.pipeline._curves = (CostCurve(lambda n: 1.0, [1, 64]), CostCurve(lambda b: 0.3, [1, 2]))
    prompts, sp = [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=24, ignore_eos=True)
    proposed = []
    for _ in range(2):  # the run's counters accumulate: take each call's share
        before = llm.pipeline.stats().counts.proposed
        llm.generate(prompts, sp)
        proposed.append(llm.pipeline.stats().counts.proposed - before)
    assert proposed[0] > 0
    assert proposed[1] == proposed[0]
