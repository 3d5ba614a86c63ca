"""Greedy speculation over flex attention (``runtime.attention="flex"``,
specdec/core/flex.py) is exact: token for token plain decoding over flex attention.

A row verified among γ + 1 rows gets the bits it gets decoded alone there: its keys
sit at their slots whatever the batch, and both calls pad to the same row count.
Each padded row count and mask kind compiles the flex call once per cache size
(seconds to tens of seconds on a busy 2-core machine), so the cases are few.
"""

from __future__ import annotations

import pytest

from specdec.core.context import SamplingParams
from specdec.spec.proposers.draft_model import DraftModelConfig
from specdec.spec.proposers.ngram import NgramConfig
from specdec.spec.tree import TreeConfig

PROMPTS = [[3, 5, 7, 11, 13, 17, 19], [1, 2, 1, 2, 1]]
SP = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.mark.slow  # compiles the flex call for the target and the draft cache (15-60 s)
def test_flex_greedy_speculation_equals_plain_flex_decoding(tiny_llama, generate) -> None:
    """A draft-model chain over flex attention (target and draft) gives plain decoding's
    tokens over flex attention, which are the default attention's."""
    target = tiny_llama(vocab=64, seed=0)
    draft = tiny_llama(vocab=64, seed=0, perturb=0.01, perturb_seed=1)
    rt = {"max_batch_size": 2, "max_seq_len": 48, "attention": "flex"}
    plain, llm = generate(target, None, PROMPTS, SP, **rt)
    assert llm.pipeline.target.module.attention_kernel == "flex"
    spec, _ = generate(target, DraftModelConfig(path=str(draft.path), num_speculative_tokens=3), PROMPTS, SP, **rt)
    default, _ = generate(target, None, PROMPTS, SP, max_batch_size=2, max_seq_len=48)
    assert spec == plain == default


@pytest.mark.slow  # tree masks and another drafter: compiles of their own
@pytest.mark.parametrize("method", ["tree", "ngram"])
def test_flex_greedy_speculation_equals_plain_flex_decoding_tree_and_ngram(tiny_llama, generate, method) -> None:
    target = tiny_llama(vocab=64, seed=0, qk_scale=0.1)  # loopy: n-gram drafts get accepted
    draft = tiny_llama(vocab=64, seed=0, qk_scale=0.1, perturb=0.01, perturb_seed=1)
    rt = {"max_batch_size": 2, "max_seq_len": 48, "attention": "flex"}
    if method == "tree":
        cfg = DraftModelConfig(path=str(draft.path), num_speculative_tokens=5,
                               tree=TreeConfig(kind="static", choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]))
    else:
        cfg = NgramConfig(num_speculative_tokens=3)
    plain, _ = generate(target, None, PROMPTS, SP, **rt)
    spec, llm = generate(target, cfg, PROMPTS, SP, **rt)
    assert spec == plain
    assert llm.pipeline.stats().counts.accepted > 0  # speculation did happen


@pytest.mark.slow  # 4000 sampled requests, each padded row count compiled once
def test_flex_sampled_speculation_follows_the_target_distribution(tiny_llama) -> None:
    """Seeded sampling over flex attention: the first three tokens of a draft-model chain
    follow the target's exact joint distribution (chi-square)."""
    import numpy as np

    from specdec.api import LLM
    from specdec.core.pipeline_model import RuntimeConfig
    from specdec.engine import EngineConfig

    from test_sampling_exactness import N, P_PASS, PROMPT, V, exact_joint, gof_pvalue

    target = tiny_llama(vocab=V, init=0.2, seed=0)
    draft = tiny_llama(vocab=V, init=0.2, seed=0, perturb=0.005, perturb_seed=1)
    rt = RuntimeConfig(max_batch_size=64, max_seq_len=32, block_size=4, attention="flex")
    llm = LLM(str(target.path), DraftModelConfig(path=str(draft.path), num_speculative_tokens=3), runtime=rt,
              engine_config=EngineConfig(max_batch_size=64))
    sps = [SamplingParams(seed=150_000 + i, max_new_tokens=3, temperature=1.0) for i in range(N)]
    counts = np.zeros((V, V, V))
    for o in llm.generate([PROMPT] * N, sps):
        assert o.error is None and len(o.token_ids) == 3, o
        counts[tuple(o.token_ids)] += 1
    p = gof_pvalue(counts, exact_joint(target.hf, PROMPT, temperature=1.0))
    c = llm.pipeline.stats().counts
    assert c.accepted > N // 4  # drafts were verified and partly accepted
    assert p > P_PASS, f"chi-square p = {p:.3g}"
