"""A drafter that drafts after verification, from the target's hidden states.

``echo_test`` (tests/spec/echo_drafter.py) keeps a feature per request in the
shared state store and drafts from it inside the same module call as the
verification, without a second target pass. Its drafts are fixed by plain
decoding's output, so besides exactness these tests check that each request's
own feature reached its own next step: batched, ragged (prompt lengths, γ and
max_new_tokens per request), with rejected drafts rolled back.
"""

from __future__ import annotations

import random

import pytest

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig

from echo_drafter import EchoConfig, expected_counts

VOCAB = 64


def _prompts(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture
def loopy(tiny_llama):
    # Shrunk queries/keys: greedy output repeats itself, so "the last token
    # repeats" is sometimes right and drafts get accepted, not only rejected.
    return tiny_llama(vocab=VOCAB, seed=0, qk_scale=0.1)


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_batched_ragged_outputs_and_counts_follow_each_requests_own_features(loopy, generate, gamma) -> None:
    ps = _prompts(gamma, 9, lo=1, hi=40)
    sps = [SamplingParams(max_new_tokens=n) for n in (1, 2, 5, 9, 16, 16, 20, 24, 24)]
    ref, _ = generate(loopy, None, ps, sps)
    out, llm = generate(loopy, EchoConfig(num_speculative_tokens=gamma, aux_layer=1), ps, sps,
                        engine=EngineConfig(max_batch_size=4))  # requests join and leave
    assert out == ref
    stats = llm.pipeline.stats()
    assert llm.pipeline.module.drafter.bonus_mismatches == 0  # drafted from the row that made the bonus
    for i, r in enumerate(ref):
        want, got = expected_counts(r, gamma), stats.per_request[f"req-{i}"]
        assert (got.steps, got.proposed, got.accepted) == (want.steps, want.proposed, want.accepted), i
    assert stats.counts.accepted > 0  # the accept path ran, not only rejections
    assert stats.counts.accepted < stats.counts.proposed  # and rollbacks of rejected drafts


def test_preemption_recomputes_the_feature_and_stays_exact(loopy, generate) -> None:
    # 40 blocks of 4 for 12 requests of up to 50 tokens: the newest requests
    # are evicted (their slots, features and waiting drafts released) and
    # recomputed later.
    ps = _prompts(8, 12, lo=10, hi=30)
    sp = SamplingParams(max_new_tokens=20)
    ref, _ = generate(loopy, None, ps, sp, max_seq_len=64, block_size=4)
    llm = LLM(str(loopy.path), EchoConfig(num_speculative_tokens=4),
              runtime=RuntimeConfig(max_batch_size=12, max_seq_len=64, block_size=4, num_blocks=40),
              engine_config=EngineConfig(max_batch_size=12))
    engine = llm.new_engine()
    ctxs = [engine.add_request(p, sp) for p in ps]
    engine.run()
    assert engine.stats.preemptions > 0
    assert [c.generated for c in ctxs] == ref
    assert llm.pipeline.module.drafter.bonus_mismatches == 0
    assert llm.pipeline.stats().counts.accepted > 0
    assert llm.pipeline.state.num_free == 12  # every slot came back


def test_a_target_layer_the_target_lacks_fails_at_build_naming_it(loopy) -> None:
    with pytest.raises(ValueError, match=r"target layers \[7\]"):
        LLM(str(loopy.path), EchoConfig(aux_layer=7), runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64))
