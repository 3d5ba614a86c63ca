"""What the n-gram drafter drafts (:mod:`specdec.spec.proposers.ngram`).

Terms: a *follower* of an n-gram is the token right after one of its earlier
occurrences in the request's tokens. Draft token i is the most frequent
follower (the most recent among equally frequent ones) of the longest n-gram,
``max_n`` down to ``min_n``, that ends ``tokens + drafts[:i]`` and has one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.core.context import SamplingParams, TextContext
from specdec.spec.proposers.ngram import NgramConfig, NgramProposer, NgramIndex, lookup, lookup_tree


def draft(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    return lookup(tokens, NgramIndex(), max_n, min_n, k)


def reference(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The definition above, by brute force over every earlier occurrence."""
    drafts: list[int] = []
    while len(drafts) < k:
        context = tokens + drafts
        followers: list[int] = []
        for n in range(min(max_n, len(context)), min_n - 1, -1):
            followers = [tokens[e] for e in range(n, len(tokens)) if tokens[e - n : e] == context[-n:]]
            if followers:
                break
        if not followers:
            return drafts
        top = max(followers.count(t) for t in followers)
        drafts.append([t for t in followers if followers.count(t) == top][-1])
    return drafts


def test_a_loop_drafts_a_full_gamma_past_the_present_end() -> None:
    # The most recent earlier "1 2" ends two tokens back: copying what followed
    # it would draft only "1 2". The counts keep going round the loop.
    tokens = [7, 8, 1, 2, 1, 2, 1, 2]
    assert draft(tokens, 4) == [1, 2, 1, 2]
    assert draft(tokens, 7) == [1, 2, 1, 2, 1, 2, 1]


def test_a_long_continuation_is_drafted_in_full() -> None:
    # One earlier occurrence of the ending "4 5" with a long continuation after it.
    tokens = [4, 5, 10, 11, 12, 13, 14, 15, 9, 4, 5]
    assert draft(tokens, 6) == [10, 11, 12, 13, 14, 15]


def test_the_most_frequent_follower_wins_over_the_most_recent() -> None:
    # "9 5 6" was followed by 1 twice, then by 2 (the most recent).
    tokens = [9, 5, 6, 1, 9, 5, 6, 1, 9, 5, 6, 2, 9, 5, 6]
    assert draft(tokens, 1) == [1]


def test_equally_frequent_followers_go_to_the_most_recent() -> None:
    assert draft([9, 5, 6, 1, 9, 5, 6, 2, 9, 5, 6], 1) == [2]
    assert draft([9, 5, 6, 2, 9, 5, 6, 1, 9, 5, 6], 1) == [1]


def test_the_longest_context_with_followers_decides() -> None:
    # "1 2" was followed by 6 twice, but the longer ending "7 1 2" by 8.
    tokens = [7, 1, 2, 8, 9, 1, 2, 6, 9, 1, 2, 6, 7, 1, 2]
    assert draft(tokens, 1) == [8]
    assert draft(tokens, 1, max_n=2) == [6]


def test_nothing_is_drafted_without_an_n_gram_of_at_least_min_n() -> None:
    assert draft([1, 2, 3], 4) == []  # 3 never occurred before the end
    assert draft([1, 2, 3, 4, 2], 4, min_n=2) == []  # "4 2" never did either
    assert draft([1, 2, 3, 4, 2], 4, min_n=1) == [3, 4, 2, 3]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 40), max_size=5),
    k=st.integers(0, 6),
    max_n=st.integers(1, 4),
    data=st.data(),
)
def test_a_growing_index_drafts_what_the_definition_says(tokens, cuts, k, max_n, data) -> None:
    # The index grows step by step with the request's tokens, as in decoding;
    # after each step its drafts equal the brute-force definition's.
    min_n = data.draw(st.integers(1, max_n))
    index = NgramIndex()
    for end in sorted({c for c in cuts if c < len(tokens)} | {len(tokens)}):
        prefix = tokens[:end]
        assert lookup(prefix, index, max_n, min_n, k) == reference(prefix, k, max_n, min_n)


# -- branches (NgramConfig.branches > 1) ---------------------------------------------------


def followers(tokens: list[int], context: list[int], max_n: int, min_n: int) -> list[int]:
    """Every follower, in order, of the longest n-gram ending ``context`` that has one."""
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        found = [tokens[e] for e in range(n, len(tokens)) if tokens[e - n : e] == context[-n:]]
        if found:
            return found
    return []


def reference_tree(tokens: list[int], k: int, max_n: int, min_n: int, branches: int) -> list[tuple[int, ...]]:
    """The module doc's tree by brute force, as the kept root-to-node paths: every
    chain from each of the first ``branches`` root followers (the drafted one, then
    by count, ties the first seen), each node scored by the product of its
    followers' frequencies; the k best (ties: shallower, then earlier branch)."""
    root = followers(tokens, tokens, max_n, min_n)
    if not root or k == 0:
        return []
    best = reference(tokens, 1, max_n, min_n)[0]
    heads = [best] + sorted(dict.fromkeys(t for t in root if t != best), key=lambda t: -root.count(t))
    cand = []
    for bi, head in enumerate(heads[:branches]):
        path, score = [head], root.count(head) / len(root)
        cand.append((-score, 0, bi, tuple(path)))
        for depth in range(1, k):
            f = followers(tokens, tokens + path, max_n, min_n)
            if not f:
                break
            top = max(f.count(t) for t in f)  # the chain rule: the most frequent, the most recent among equals
            nxt = [t for t in f if f.count(t) == top][-1]
            score *= f.count(nxt) / len(f)
            path = path + [nxt]
            cand.append((-score, depth, bi, tuple(path)))
    return sorted(c[3] for c in sorted(cand)[:k])


def paths(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    out = []
    for i in range(len(tokens)):
        p, j = [], i
        while j >= 0:
            p.append(tokens[j])
            j = parents[j]
        out.append(tuple(reversed(p)))
    return sorted(out)


def test_branches_docstring_examples() -> None:
    t = [5, 6, 1, 7, 8, 5, 6, 1, 7, 8, 5, 6, 2, 9, 5, 6]
    assert lookup_tree(t, NgramIndex(), 2, 1, 3, 2) == ([1, 7, 8], [-1, 0, 1])  # nothing in doubt: the chain
    t = [5, 6, 2, 9, 5, 6, 1, 7, 3, 5, 6]
    assert lookup_tree(t, NgramIndex(), 2, 1, 4, 2) == ([1, 7, 2, 9], [-1, 0, -1, 2])
    assert lookup_tree(t, NgramIndex(), 2, 1, 4, 3) == ([1, 7, 2, 9], [-1, 0, -1, 2])  # only two followers
    assert lookup_tree(t, NgramIndex(), 2, 1, 0, 2) == ([], [])


@settings(max_examples=300, deadline=None, derandomize=True)  # the same examples every run
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    k=st.integers(0, 8),
    max_n=st.integers(1, 3),
    branches=st.integers(1, 4),
    data=st.data(),
)
def test_a_tree_keeps_the_best_nodes_and_one_branch_is_the_chain(tokens, k, max_n, branches, data) -> None:
    min_n = data.draw(st.integers(1, max_n))
    toks, parents = lookup_tree(tokens, NgramIndex(), max_n, min_n, k, branches)
    assert len(toks) <= k and all(p < i for i, p in enumerate(parents))  # parents first
    assert paths(toks, parents) == reference_tree(tokens, k, max_n, min_n, branches)
    if branches == 1:
        assert toks == lookup(tokens, NgramIndex(), max_n, min_n, k) and parents == list(range(-1, len(toks) - 1))


def test_the_proposer_packs_ragged_trees_with_their_host_facts() -> None:
    proposer = NgramProposer(NgramConfig(num_speculative_tokens=4, max_n=2, branches=2))
    two = _ctx("two", [5, 6, 2, 9, 5, 6, 1, 7, 3, 5, 6])  # 1 → 7 and 2 → 9
    loop = _ctx("loop", [7, 8, 1, 2, 1, 2, 1, 2])  # one follower each time: a chain
    batch = proposer.prepare([two, loop], 4, [4, 3])
    assert batch.gamma == 4 and batch.num_draft.tolist() == [4, 3]
    assert batch.tokens.tolist() == [[1, 7, 2, 9], [1, 2, 1, 0]]
    assert batch.parents is not None and batch.parents.tolist() == [[-1, 0, -1, 2], [-1, 0, 1, -1]]
    assert (batch.max_depth, batch.max_children) == (3, 2)
    tree = proposer.drafter(batch, None)
    assert not tree.is_chain and tree.num_nodes.tolist() == [4, 3]
    # Chains everywhere: the step keeps the chain path.
    chains = proposer.prepare([loop], 4, [2])
    assert chains.parents is None and proposer.drafter(chains, None).is_chain


def _ctx(rid: str, tokens: list[int]) -> TextContext:
    return TextContext(request_id=rid, tokens=list(tokens), prompt_len=len(tokens), sampling=SamplingParams())


def test_the_proposer_drafts_per_request_and_verifies_only_as_many_rows_as_found() -> None:
    proposer = NgramProposer(NgramConfig(num_speculative_tokens=4))
    loop, fresh = _ctx("loop", [7, 8, 1, 2, 1, 2, 1, 2]), _ctx("fresh", [1, 2, 3])
    batch = proposer.prepare([loop, fresh], 4, [3, 4])
    assert batch.gamma == 3  # the most any request found (its own cap was 3)
    assert batch.num_draft.tolist() == [3, 0]
    assert batch.tokens.tolist() == [[1, 2, 1], [0, 0, 0]]  # [B, γ], padded
    # The requests grow (as after a step); each request's counts grow with them.
    loop.tokens += [1, 2, 1]
    fresh.tokens += [1, 2]
    batch = proposer.prepare([loop, fresh], 4, [4, 4])
    assert batch.tokens.tolist() == [[2, 1, 2, 1], [3, 1, 2, 3]]
    assert torch.equal(batch.first_position, torch.tensor([11, 5]))
    # free forgets only the freed request's counts. A request's tokens only grow, so the
    # counts kept for it are read on; replacing its tokens shows which counts remain.
    proposer.free(loop)
    loop.tokens[:], fresh.tokens[:] = [5, 6, 5, 6, 5, 6], [4, 4, 4, 4, 4]
    batch = proposer.prepare([loop, fresh], 4, [4, 4])
    assert batch.tokens.tolist() == [[5, 6, 5, 6], [0, 0, 0, 0]]  # loop: its new tokens alone, as a new request's
    assert batch.num_draft.tolist() == [4, 0]  # fresh: still the old counts, which never saw 4


@pytest.mark.slow
def test_builtin_pair_acceptance_at_least_transformers_prompt_lookup() -> None:
    # Issue 17: on the shipped pair's first 8 held-out prompts (greedy, 64 new
    # tokens), tokens per target forward at least those of transformers'
    # prompt lookup with as many proposed tokens (it takes the earliest match).
    from specdec.api import LLM
    from specdec.core.pipeline_model import RuntimeConfig
    from specdec.measure import builtin_pair, builtin_prompts, hf_model

    pair = builtin_pair()
    if pair is None:
        pytest.skip("the built-in pair is not shipped in this checkout")
    target, n, gamma = pair[0], 64, 4
    prompts = builtin_prompts(target, 8)
    assert prompts
    rt = RuntimeConfig(max_batch_size=1, max_seq_len=max(map(len, prompts)) + n + 16, compile=False, threads=1)
    llm = LLM(target, method=NgramConfig(num_speculative_tokens=gamma), runtime=rt)
    llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    ours = len(prompts) * n / llm.pipeline.stats().target_forwards

    hf = hf_model(target)
    calls = 0
    forward = hf.forward

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return forward(*args, **kwargs)

    hf.forward = counted
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, eos_token_id=None, pad_token_id=0, prompt_lookup_num_tokens=gamma)
    theirs = len(prompts) * n / calls
    assert ours >= theirs, (ours, theirs)
