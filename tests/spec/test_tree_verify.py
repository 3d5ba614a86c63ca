"""Token trees (:mod:`specdec.spec.tree`): shapes, selection, and lossless verification.

Rows: row 0 is the root (the last committed token), row ``i + 1`` node ``i``;
``path`` lists the rows of the emitted tokens' contexts, ``tokens`` the
accepted tokens then the recovered / bonus one (``-1`` past them).

The sampled verifiers are checked for exactness by chi-square tests of the
*joint* distribution of the first three emitted tokens against the exact
target joint, over a 4-token vocabulary whose target distribution depends on
the whole prefix. One step emits ``num_accepted + 1`` tokens; the rest of the
three are drawn from the exact target (what later lossless steps would do),
so the test checks that a step's emitted prefix has the target's law. Each
test has a negative control (a known-wrong verifier) that must fail.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2

from specdec.sampling import LANE_ACCEPT, LANE_TARGET, sample_from, uniform
from specdec.spec.tree import (
    accepted_slot_moves,
    best_static_tree,
    ancestor_mask,
    children_table,
    depths,
    dynamic_tree_select,
    expand_topk,
    static_tree,
    static_tree_tokens,
    tree_attention_mask,
    tree_lane,
    verify_tree_greedy,
    verify_tree_sampled,
)
from specdec.spec.verify import verify_greedy, verify_sampled

from tree_helpers import tree_positions  # tests/spec/tree_helpers.py


def L(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long)


def logits_with_argmax(argmax: list[list[int]], vocab: int = 10) -> torch.Tensor:
    """[B, n, V] logits whose argmax at [b, i] is ``argmax[b][i]`` (margin 5)."""
    a = L(argmax)
    return torch.zeros(*a.shape, vocab).scatter_(-1, a.unsqueeze(-1), 5.0)


# -- shapes ------------------------------------------------------------------------------------


def test_ancestor_mask_depths_children_positions() -> None:
    parents = L([[-1, 0, -1, 1, 0]])  # 0 -> {1, 4}, 1 -> 3; 2 alone under the root
    m = ancestor_mask(parents)
    assert m[0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 0, 0, 1],
    ]
    assert depths(parents).tolist() == [[1, 2, 1, 3, 2]]
    # children of each row (row 0 root, row i+1 node i), in node order
    assert children_table(parents).tolist() == [[[0, 2], [1, 4], [3, -1], [-1, -1], [-1, -1], [-1, -1]]]
    assert tree_positions(parents, L([10])).tolist() == [[10, 11, 12, 11, 13, 12]]
    tm = tree_attention_mask(parents)
    assert tm.shape == (1, 6, 6)
    assert tm[0, :, 0].all() and tm[0, 1:, 1:].equal(m[0])


def test_shapes_ragged_padding_is_inert() -> None:
    # Request 1 has 2 real nodes; its padding holds garbage parents.
    parents = L([[-1, 0, 1, 1], [-1, -1, 0, 0]])
    nn = L([4, 2])
    m = ancestor_mask(parents, nn)
    assert m[1, 2:].int().tolist() == [[0, 0, 1, 0], [0, 0, 0, 1]]  # padding sees itself only
    assert not m[1, :2, 2:].any()
    assert depths(parents, nn).tolist() == [[1, 2, 3, 3], [1, 1, 0, 0]]
    assert children_table(parents, nn).tolist()[1] == [[0, 1], [-1, -1], [-1, -1], [-1, -1], [-1, -1]]


def test_chain_mask_is_causal() -> None:
    g = 5
    parents = (torch.arange(g) - 1).expand(2, g)
    assert tree_attention_mask(parents)[0].equal(torch.ones(g + 1, g + 1, dtype=torch.bool).tril())
    assert depths(parents).tolist() == [[1, 2, 3, 4, 5]] * 2


def test_static_tree_medusa_order_and_tokens() -> None:
    t = static_tree([[1, 0], [0], [0, 1], [1], [0, 0], [0, 0, 2]])  # any order in
    assert t.paths == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 2)]  # sorted by (len, path)
    assert t.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    assert t.ranks.tolist() == [0, 1, 0, 1, 0, 2]
    assert t.depths.tolist() == [1, 1, 2, 2, 2, 3]
    assert t.depths.equal(depths(t.parents.unsqueeze(0))[0])
    # parent_topk [B=1, N+1=7, K=3]: row r's top-3 tokens = 10r, 10r+1, 10r+2
    topk = (torch.arange(7).view(1, 7, 1) * 10 + torch.arange(3)).long()
    # node i = rank-th token of its parent row: node 0 (root, rank 0) -> 0, node 1 -> 1,
    # node 2 (under node 0 = row 1, rank 0) -> 10, node 3 -> 11, node 4 (row 2) -> 20, node 5 (row 3, rank 2) -> 32
    assert static_tree_tokens(t.parents, t.ranks, topk).tolist() == [[0, 1, 10, 11, 20, 32]]
    with pytest.raises(ValueError, match="lacks its parent"):
        static_tree([[0], [1, 0]])
    with pytest.raises(ValueError, match="duplicates"):
        static_tree([[0], [0]])


def test_a_budget_keeps_the_choices_as_listed() -> None:
    likeliest_first = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [2]]
    assert static_tree(likeliest_first, budget=4).paths == [(0,), (1,), (0, 0), (0, 0, 0)]
    assert static_tree(likeliest_first, budget=6).paths == static_tree(likeliest_first).paths
    with pytest.raises(ValueError, match=r"lacks its parent \[1\] among the first 2"):
        static_tree([[0], [1, 0], [1]], budget=2)
    with pytest.raises(ValueError, match="outside 1..6"):
        static_tree(likeliest_first, budget=7)


def _expected_accepted(paths: list[tuple[int, ...]], acc: list[list[float]]) -> float:
    return sum(math.prod(acc[d][r] for d, r in enumerate(p)) for p in paths)


@given(st.sampled_from([(1, 3), (2, 2), (2, 3), (3, 2)]), st.integers(1, 6), st.randoms(use_true_random=False))
@settings(max_examples=30, deadline=None)
def test_best_static_tree_is_the_best_tree_of_its_size(shape: tuple[int, int], budget: int, rnd) -> None:
    """Against brute force: no connected tree of the same size has a larger expected accepted length."""
    depth, ranks = shape
    acc = [[rnd.random() for _ in range(ranks)] for _ in range(depth)]
    best = best_static_tree(acc, budget)
    universe = [p for d in range(1, depth + 1) for p in itertools.product(range(ranks), repeat=d)]
    n = min(budget, len(universe))
    assert len(best) == n and len(set(best)) == n
    static_tree(best)  # connected: every prefix has its parent
    for k in range(1, n + 1):  # each prefix is the best tree of its size
        top = max(_expected_accepted(list(c), acc) for c in itertools.combinations(universe, k)
                  if all(len(p) == 1 or p[:-1] in c for p in c))
        assert _expected_accepted(best[:k], acc) == pytest.approx(top)


def test_best_static_tree_worked_example_and_bad_input() -> None:
    assert best_static_tree([[0.6, 0.2], [0.5, 0.1]], 4) == [(0,), (0, 0), (1,), (1, 0)]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        best_static_tree([[0.5, 1.5]], 2)


def test_dynamic_tree_select_worked_example_ties_and_padding() -> None:
    sel = dynamic_tree_select(torch.tensor([[-0.1, -0.5, -0.3, -0.9, -0.4]]), L([[-1, -1, 0, 0, 2]]), 3)
    assert sel.index.tolist() == [[0, 2, 4]]
    assert sel.parents.tolist() == [[-1, 0, 1]]
    assert sel.num_nodes.tolist() == [3]
    # A child tied with its parent (log q = 0) and with a sibling of the parent:
    # the earlier candidate (the parent) wins the tie; -inf candidates are padding.
    inf = float("-inf")
    sel = dynamic_tree_select(torch.tensor([[-1.0, -1.0, -1.0, inf], [-0.5, inf, inf, inf]]),
                              L([[-1, -1, 0, 2], [-1, -1, 0, 0]]), 2)
    assert sel.index.tolist()[0] == [0, 1] and sel.parents.tolist()[0] == [-1, -1]
    assert sel.num_nodes.tolist() == [2, 1]
    assert sel.index[1, 0].item() == 0 and sel.parents.tolist()[1] == [-1, -1]


def test_expand_topk_then_select_is_a_tree() -> None:
    torch.manual_seed(0)
    v, k, depth, b = 12, 3, 4, 5
    table = torch.log_softmax(torch.randn(v, v) * 2, -1)  # a toy drafter: log q(next | last token)
    root_tok = torch.randint(v, (b,))
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def draft_fn(tokens: torch.Tensor, parent_slot: torch.Tensor) -> torch.Tensor:
        calls.append((tokens.clone(), parent_slot.clone()))
        return table[tokens]  # [B, K, V]

    cand = expand_topk(table[root_tok], draft_fn, depth, k)
    m = k + (depth - 1) * k * k
    assert cand.tokens.shape == cand.parents.shape == cand.scores.shape == (b, m)
    assert len(calls) == depth - 1
    assert (cand.parents < torch.arange(m)).all()  # parents before children
    # Scores are cumulative: parent score + log q(token | parent token).
    par_tok = torch.where(cand.parents >= 0, cand.tokens.gather(1, cand.parents.clamp(min=0)), root_tok[:, None])
    par_score = torch.where(cand.parents >= 0, cand.scores.gather(1, cand.parents.clamp(min=0)), 0.0)
    assert torch.allclose(cand.scores, par_score + table[par_tok, cand.tokens])
    # Each call's frontier: the best k children recorded by the previous call, and
    # frontier_parent points into the previous call's frontier.
    assert calls[0][0].equal(cand.tokens[:, :k]) and (calls[0][1] == -1).all()
    for c in range(1, depth - 1):
        prev_tokens = calls[c - 1][0]
        lo = k + (c - 1) * k * k
        block = cand.scores[:, lo : lo + k * k]
        best = block.topk(k, -1).indices
        assert calls[c][0].equal(cand.tokens[:, lo:].gather(1, best))
        assert calls[c][1].equal(best // k)
        assert cand.tokens[:, lo:].gather(1, best).shape == prev_tokens.shape
    sel = dynamic_tree_select(cand.scores, cand.parents, 10)
    assert (sel.num_nodes == 10).all()
    assert (sel.parents < torch.arange(10)).all()
    kept = cand.scores.gather(1, sel.index)
    assert torch.allclose(kept.sort(1, descending=True).values, cand.scores.topk(10, -1).values)
    # Re-indexed parents are the original parents.
    orig_par = cand.parents.gather(1, sel.index)
    back = torch.where(sel.parents >= 0, sel.index.gather(1, sel.parents.clamp(min=0)), -1)
    assert back.equal(orig_par)


# -- greedy verification -----------------------------------------------------------------------


def test_greedy_worked_example() -> None:
    # The module docstring's example: a=1, c=2, b=3, d=4, e=5; root -> {a, c}, a -> {b, d}, b -> {e}.
    tokens, parents = L([[1, 2, 3, 4, 5]]), L([[-1, -1, 0, 0, 2]])
    # argmax per row: root wants c (2); row 2 (node 1 = c) wants d (4); others arbitrary.
    v = verify_tree_greedy(tokens=tokens, parents=parents, num_nodes=None,
                           target_logits=logits_with_argmax([[2, 6, 4, 7, 7, 7]]))
    assert v.path.tolist() == [[0, 2, -1, -1]]  # root, then node 1's row
    assert v.tokens.tolist() == [[2, 4, -1, -1]]  # c accepted, then bonus d (node 1 is a leaf)
    assert v.num_accepted.tolist() == [1]


def test_greedy_deep_path_and_recovered() -> None:
    tokens, parents = L([[1, 2, 3, 4, 5]]), L([[-1, -1, 0, 0, 2]])
    # root wants a (1) -> node 0; row 1 wants b (3) -> node 2; row 3 wants e (5) -> node 4; row 5 wants 9: bonus.
    v = verify_tree_greedy(tokens=tokens, parents=parents, num_nodes=None,
                           target_logits=logits_with_argmax([[1, 3, 0, 5, 0, 9]]))
    assert v.path.tolist() == [[0, 1, 3, 5]]
    assert v.tokens.tolist() == [[1, 3, 5, 9]]
    assert v.num_accepted.tolist() == [3]
    # row 1 wants 8: neither b nor d -> recovered 8 after a.
    v = verify_tree_greedy(tokens=tokens, parents=parents, num_nodes=None,
                           target_logits=logits_with_argmax([[1, 8, 0, 5, 0, 9]]))
    assert v.path.tolist() == [[0, 1, -1, -1]]
    assert v.tokens.tolist() == [[1, 8, -1, -1]]
    # root wants 7: nothing accepted, recovered 7.
    v = verify_tree_greedy(tokens=tokens, parents=parents, num_nodes=None,
                           target_logits=logits_with_argmax([[7, 8, 0, 5, 0, 9]]))
    assert v.path.tolist() == [[0, -1, -1, -1]] and v.tokens.tolist() == [[7, -1, -1, -1]]
    assert v.num_accepted.tolist() == [0]


def test_greedy_ragged_batch_ignores_padding() -> None:
    # Request 0: full tree; request 1: 2 real nodes (root -> {3, 4}), padding holds a
    # matching token under node 1 and NaN logits: neither may matter.
    tokens = L([[1, 2, 3, 4, 5], [3, 4, 6, 6, 6]])
    parents = L([[-1, -1, 0, 0, 2], [-1, -1, 1, 1, 1]])
    logits = logits_with_argmax([[1, 3, 0, 5, 0, 9], [4, 0, 6, 0, 0, 0]])
    logits[1, 3:] = float("nan")
    v = verify_tree_greedy(tokens=tokens, parents=parents, num_nodes=L([5, 2]), target_logits=logits)
    assert v.tokens.tolist() == [[1, 3, 5, 9], [4, 6, -1, -1]]  # request 1: 4 accepted (node 1), bonus 6
    assert v.path.tolist() == [[0, 1, 3, 5], [0, 2, -1, -1]]
    assert v.num_accepted.tolist() == [3, 1]
    # Alone, request 1 gives the same (max_depth fixed so the shapes agree).
    v1 = verify_tree_greedy(tokens=tokens[1:], parents=parents[1:], num_nodes=L([2]),
                            target_logits=logits[1:], max_depth=3)
    assert v1.tokens.equal(v.tokens[1:]) and v1.path.equal(v.path[1:])


def test_greedy_no_nodes_is_plain_decoding() -> None:
    args = dict(tokens=L([[5, 5]]), parents=L([[-1, 0]]), num_nodes=L([0]),
                target_logits=logits_with_argmax([[3, 5, 5]]))
    v = verify_tree_greedy(**args)  # D = the deepest real node = 0
    assert v.tokens.tolist() == [[3]] and v.path.tolist() == [[0]] and v.num_accepted.tolist() == [0]
    v = verify_tree_greedy(**args, max_depth=2)
    assert v.tokens.tolist() == [[3, -1, -1]] and v.num_accepted.tolist() == [0]


def test_greedy_chain_equals_verify_greedy() -> None:
    g = torch.Generator().manual_seed(1)
    b, gamma, vocab = 256, 5, 3  # small vocab: every acceptance length occurs
    logits = torch.randn(b, gamma + 1, vocab, generator=g)
    # Drafts that mostly match (every acceptance length occurs), else random.
    drafts = torch.where(torch.rand(b, gamma, generator=g) < 0.7, logits[:, :gamma].argmax(-1),
                         torch.randint(vocab, (b, gamma), generator=g))
    num_draft = torch.randint(gamma + 1, (b,), generator=g)
    out, acc = verify_greedy(draft_tokens=drafts, target_logits=logits, num_draft=num_draft)
    parents = (torch.arange(gamma) - 1).expand(b, gamma)
    v = verify_tree_greedy(tokens=drafts, parents=parents, num_nodes=num_draft, target_logits=logits,
                           max_depth=gamma)
    assert v.tokens.equal(out) and v.num_accepted.equal(acc)
    ar = torch.arange(gamma + 1)
    assert v.path.equal(torch.where(ar <= acc[:, None], ar, -1))
    assert len(set(acc.tolist())) == gamma + 1
    # num_draft None: every draft counts.
    out, acc = verify_greedy(draft_tokens=drafts, target_logits=logits, num_draft=None)
    v = verify_tree_greedy(tokens=drafts, parents=parents, num_nodes=None, target_logits=logits)
    assert v.tokens.equal(out) and v.num_accepted.equal(acc)


@pytest.mark.parametrize("max_depth", [None, 2])
def test_greedy_host_walk_equals_the_tensor_walk(monkeypatch, max_depth) -> None:
    # On the CPU a small batch is walked on host lists; both walks must agree on random
    # ragged trees whose siblings may repeat a token (the first matching child wins).
    from specdec.spec import tree as tree_mod

    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        b, n, vocab = 3, int(torch.randint(1, 9, (1,), generator=g)), 3
        parents = torch.stack([torch.randint(-1, max(i, 0), (b,), generator=g) if i else torch.full((b,), -1)
                               for i in range(n)], 1)
        tokens = torch.randint(vocab, (b, n), generator=g)
        logits = torch.randn(b, n + 1, vocab, generator=g)
        num_nodes = torch.randint(n + 1, (b,), generator=g)
        args = dict(tokens=tokens, parents=parents, num_nodes=num_nodes, target_logits=logits, max_depth=max_depth)
        host = verify_tree_greedy(**args)
        monkeypatch.setattr(tree_mod, "HOST_WALK_NODES", -1)
        dev = verify_tree_greedy(**args)
        monkeypatch.undo()
        assert host.path.equal(dev.path) and host.tokens.equal(dev.tokens), (parents, tokens, num_nodes)
        assert host.num_accepted.equal(dev.num_accepted)


# -- sampled verification: exact cases ---------------------------------------------------------


def test_sampled_worked_example_lanes() -> None:
    # parents [[-1, -1, 0]], deterministic: node 0 (token 1) has p = 0 (always rejected),
    # node 1 (token 2) has p = 1 after node 0's rejection... and before: p(2) = 1.
    v_ = 5
    tp = torch.zeros(1, 4, v_)
    tp[0, 0, 2] = 1.0  # root: certainly token 2 -> node 0 (token 1) rejected, node 1 accepted
    tp[0, 1:] = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])
    seeds, pos = L([7]), L([11])
    v = verify_tree_sampled(tokens=L([[1, 2, 3]]), parents=L([[-1, -1, 0]]), num_nodes=None,
                            target_probs=tp, draft_probs=None, seeds=seeds, positions=pos)
    bonus = sample_from(tp[:, 2], seeds, pos + 1, LANE_TARGET)  # leaf node 1 -> bonus from row 2 at depth 1
    assert v.path.tolist() == [[0, 2, -1]]
    assert v.tokens.tolist() == [[2, bonus.item(), -1]]
    # The second child's accept test uses its own lane: with p(token 2) = 0.5 after
    # renormalisation the decision is u(tree_lane(LANE_ACCEPT, 1)) <= 0.5.
    tp[0, 0] = torch.tensor([0.0, 0.5, 0.25, 0.25, 0.0])  # node 0 (1): accept iff u0 <= 0.5
    u0 = uniform(seeds, pos, LANE_ACCEPT).item()
    u1 = uniform(seeds, pos, tree_lane(LANE_ACCEPT, 1)).item()
    v = verify_tree_sampled(tokens=L([[1, 2, 3]]), parents=L([[-1, -1, 0]]), num_nodes=None,
                            target_probs=tp, draft_probs=None, seeds=seeds, positions=pos)
    if u0 <= 0.5:
        assert v.path.tolist()[0][:2] == [0, 1]
    elif u1 <= 0.5:  # after rejecting 1: p = [0, 0, .5, .5, 0]
        assert v.path.tolist()[0][:2] == [0, 2]
    else:
        assert v.tokens.tolist()[0][:2] == [3, -1]  # recovered: only token 3 left
    assert tree_lane(LANE_ACCEPT, 0) == LANE_ACCEPT and tree_lane(LANE_ACCEPT, 1) not in range(1, 16)


@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_sampled_chain_equals_verify_sampled(sampled_drafts: bool) -> None:
    g = torch.Generator().manual_seed(2)
    b, gamma, vocab = 512, 4, 6
    tp = torch.softmax(torch.randn(b, gamma + 1, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(b, gamma, vocab, generator=g) * 1.5, -1)
    q = 0.5 * q + 0.5 * tp[:, :gamma]  # drafts that are often accepted
    if sampled_drafts:
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(b, gamma)
        dp = q
    else:
        drafts = q.argmax(-1)
        dp = None
    num_draft = torch.randint(gamma + 1, (b,), generator=g)
    seeds = torch.randint(2**40, (b,), generator=g)
    first = torch.randint(1000, (b,), generator=g)
    out, acc = verify_sampled(draft_tokens=drafts, draft_probs=dp, target_probs=tp, num_draft=num_draft,
                              seeds=seeds, positions=first[:, None] + torch.arange(gamma + 1))
    v = verify_tree_sampled(tokens=drafts, parents=(torch.arange(gamma) - 1).expand(b, gamma),
                            num_nodes=num_draft, target_probs=tp, draft_probs=dp, seeds=seeds,
                            positions=first, max_depth=gamma)
    assert v.tokens.equal(out) and v.num_accepted.equal(acc)
    assert len(set(acc.tolist())) == gamma + 1


def test_sampled_request_alone_equals_in_batch_and_padding_is_inert() -> None:
    g = torch.Generator().manual_seed(3)
    b, n, vocab = 6, 6, 5
    parents = L([[-1, -1, 0, 0, 1, 2]] * 3 + [[-1, 0, 1, 2, 3, 4]] * 3)
    nn = L([6, 4, 2, 6, 3, 0])
    tp = torch.softmax(torch.randn(b, n + 1, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(b, n, vocab, generator=g), -1)
    tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(b, n)
    valid = torch.arange(n) < nn[:, None]
    tp_nan = tp.clone()
    tp_nan[:, 1:][~valid] = float("nan")  # padding rows are never read
    q_nan = q.clone()
    q_nan[~valid] = float("nan")
    seeds, pos = torch.arange(b) * 7919 + 5, torch.arange(b) + 40
    for dp in (None, q_nan):
        v = verify_tree_sampled(tokens=tokens, parents=parents, num_nodes=nn, target_probs=tp_nan,
                                draft_probs=dp, seeds=seeds, positions=pos, max_depth=n, max_children=2)
        assert (v.tokens[:, 0] >= 0).all()
        for i in range(b):
            one = verify_tree_sampled(tokens=tokens[i : i + 1], parents=parents[i : i + 1], num_nodes=nn[i : i + 1],
                                      target_probs=tp[i : i + 1], draft_probs=None if dp is None else q[i : i + 1],
                                      seeds=seeds[i : i + 1], positions=pos[i : i + 1], max_depth=n)
            assert one.tokens.equal(v.tokens[i : i + 1]) and one.path.equal(v.path[i : i + 1])


# -- sampled verification: distribution (chi-square) -------------------------------------------

V = 4  # vocabulary
EMIT = 3  # joint law of the first EMIT tokens
BASE = V + 1  # prefix code: code(prefix + [t]) = code(prefix) * BASE + t + 1; code([]) = 0
N_SAMPLES = 30_000


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Target p(. | prefix) and draft q(. | prefix) for every prefix of length <= 3."""
    g = torch.Generator().manual_seed(1234)
    rows = BASE**4
    p = torch.softmax(torch.randn(rows, V, generator=g) * 1.2, -1)
    r = torch.softmax(torch.randn(rows, V, generator=g) * 1.2, -1)
    return p, 0.5 * p + 0.5 * r  # a draft close to, but not equal to, the target


P_TAB, Q_TAB = _tables()


def _exact_joint() -> torch.Tensor:
    """[V ** EMIT] the target's joint law of EMIT tokens after the root."""
    out = torch.zeros(V**EMIT)
    for cell in range(V**EMIT):
        toks = [(cell // V ** (EMIT - 1 - k)) % V for k in range(EMIT)]
        prob, code = 1.0, 0
        for t in toks:
            prob *= P_TAB[code, t].item()
            code = code * BASE + t + 1
        out[cell] = prob
    return out


EXACT = _exact_joint()


def _sibling_rank(parents: list[int]) -> list[int]:
    return [sum(1 for j in range(i) if parents[j] == parents[i]) for i in range(len(parents))]


def _draft(parents: list[int], n: int, sampled: bool, seed: int) -> dict:
    """n requests drafting the tree ``parents`` from Q_TAB (top-k ranks, or i.i.d. samples)."""
    g = torch.Generator().manual_seed(seed)
    num = len(parents)
    rank = _sibling_rank(parents)
    codes = torch.zeros(n, num + 1, dtype=torch.long)  # [n, N+1] prefix code of each row
    tokens = torch.zeros(n, num, dtype=torch.long)
    q = torch.zeros(n, num, V)
    for i, par in enumerate(parents):
        qp = Q_TAB[codes[:, par + 1]]  # [n, V] the parent row's draft distribution
        if sampled:
            tok = torch.multinomial(qp, 1, generator=g).squeeze(1)
        else:
            tok = qp.argsort(-1, descending=True)[:, rank[i]]
        tokens[:, i], q[:, i] = tok, qp
        codes[:, i + 1] = codes[:, par + 1] * BASE + tok + 1
    return dict(
        tokens=tokens,
        parents=L(parents).expand(n, num),
        target_probs=P_TAB[codes],  # [n, N+1, V]
        draft_probs=q if sampled else None,
        seeds=torch.arange(n, dtype=torch.long) * 1_000_003 + seed,
        positions=torch.full((n,), 17, dtype=torch.long),
    )


def _complete(emitted: torch.Tensor, seed: int) -> torch.Tensor:
    """The first EMIT tokens: the step's emitted ones, then exact target draws -> [n] cell index."""
    g = torch.Generator().manual_seed(seed + 99)
    n = emitted.shape[0]
    code = torch.zeros(n, dtype=torch.long)
    cell = torch.zeros(n, dtype=torch.long)
    for k in range(EMIT):
        tok = emitted[:, k] if k < emitted.shape[1] else torch.full((n,), -1, dtype=torch.long)
        fresh = torch.multinomial(P_TAB[code], 1, generator=g).squeeze(1)
        tok = torch.where(tok >= 0, tok, fresh)
        cell = cell * V + tok
        code = code * BASE + tok + 1
    return cell


def _pvalue(cells: torch.Tensor) -> float:
    counts = torch.bincount(cells, minlength=V**EMIT).double()
    expected = EXACT.double() * cells.numel()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    return float(chi2.sf(stat, int(keep.sum()) - 1))


def _tree_cells(parents: list[int], sampled: bool, seed: int, num_nodes: torch.Tensor | None = None,
                **override) -> torch.Tensor:
    d = _draft(parents, N_SAMPLES, sampled, seed)
    d.update(override)
    v = verify_tree_sampled(num_nodes=num_nodes, **d)
    return _complete(v.tokens, seed)


def _longest_independent_path_cells(parents: list[int], sampled: bool, seed: int) -> torch.Tensor:
    """NEGATIVE CONTROL: verify each root-to-leaf path on its own as a chain (own coins),
    keep the longest acceptance. Not lossless (it favours tokens with more chances)."""
    d = _draft(parents, N_SAMPLES, sampled, seed)
    num = len(parents)
    leaves = [i for i in range(num) if i not in parents]
    best_out, best_acc = None, None
    for j, leaf in enumerate(leaves):
        chain = [leaf]
        while parents[chain[-1]] >= 0:
            chain.append(parents[chain[-1]])
        chain = chain[::-1]
        rows = [0] + [i + 1 for i in chain]
        out, acc = verify_sampled(
            draft_tokens=d["tokens"][:, chain],
            draft_probs=None if d["draft_probs"] is None else d["draft_probs"][:, chain],
            target_probs=d["target_probs"][:, rows],
            num_draft=torch.full((N_SAMPLES,), len(chain), dtype=torch.long),
            seeds=d["seeds"] + 7 * j,
            positions=d["positions"][:, None] + torch.arange(len(chain) + 1),
        )
        out = torch.nn.functional.pad(out, (0, EMIT), value=-1)[:, :EMIT]
        if best_out is None:
            best_out, best_acc = out, acc
        else:
            better = acc > best_acc
            best_out = torch.where(better[:, None], out, best_out)
            best_acc = torch.where(better, acc, best_acc)
    return _complete(best_out, seed)


TWO_AT_ROOT = [-1, -1]
CHAIN3 = [-1, 0, 1]
WIDE3_DEEP2 = [-1, -1, -1, 0, 0, 0, 1, 1, 2]  # 3 under the root; 3, 2, 1 under those

GOOD_P = 1e-3  # a lossless verifier (fixed seeds: the statistic is deterministic)
BAD_P = 1e-8  # a control must be rejected far beyond chance


@pytest.mark.parametrize("shape", [TWO_AT_ROOT, WIDE3_DEEP2], ids=["two_at_root", "wide3_deep2"])
def test_chi2_topk_drafts_branching(shape: list[int]) -> None:
    n = len(shape)
    # Ragged: a third of the requests verify only the first 2 nodes of the tree.
    nn = torch.where(torch.arange(N_SAMPLES) % 3 == 0, 2, n)
    assert _pvalue(_tree_cells(shape, False, seed=10, num_nodes=nn)) > GOOD_P
    assert _pvalue(_longest_independent_path_cells(shape, False, seed=10)) < BAD_P


def test_chi2_topk_drafts_one_coin_for_all_siblings_is_biased(monkeypatch: pytest.MonkeyPatch) -> None:
    # NEGATIVE CONTROL: every sibling's accept test reusing the first sibling's
    # uniform (given the first rejection, u is no longer uniform on (0, 1)).
    import specdec.spec.tree as tree

    monkeypatch.setattr(tree, "tree_lane", lambda lane, sibling: lane)
    assert _pvalue(_tree_cells(WIDE3_DEEP2, False, seed=30)) < BAD_P


def test_chi2_topk_drafts_chain() -> None:
    assert _pvalue(_tree_cells(CHAIN3, False, seed=11)) > GOOD_P
    # NEGATIVE CONTROL: top-k drafts verified as if drawn from a uniform q
    # (accept with min(1, V p(x))): the q correction is wrong.
    uniform_q = torch.full((N_SAMPLES, len(CHAIN3), V), 1.0 / V)
    assert _pvalue(_tree_cells(CHAIN3, False, seed=11, draft_probs=uniform_q)) < BAD_P


@pytest.mark.parametrize("shape", [TWO_AT_ROOT, CHAIN3, WIDE3_DEEP2], ids=["two_at_root", "chain3", "wide3_deep2"])
def test_chi2_sampled_drafts(shape: list[int]) -> None:
    assert _pvalue(_tree_cells(shape, True, seed=20)) > GOOD_P
    # Verifying sampled drafts as if deterministic (q ignored) is lossless too: the
    # tree is drawn independently of the verifier's coins, and the point-mass rule
    # is exact for every fixed tree (it only accepts less often).
    assert _pvalue(_tree_cells(shape, True, seed=20, draft_probs=None)) > GOOD_P
    # NEGATIVE CONTROL: the wrong q (uniform, not the distribution the drafts came from).
    uniform_q = torch.full((N_SAMPLES, len(shape), V), 1.0 / V)
    assert _pvalue(_tree_cells(shape, True, seed=20, draft_probs=uniform_q)) < BAD_P


def test_chi2_sampled_drafts_longest_path_control() -> None:
    # NEGATIVE CONTROL for sampled drafts: independent chain verification per path.
    assert _pvalue(_longest_independent_path_cells(WIDE3_DEEP2, True, seed=21)) < BAD_P


# -- KV moves ----------------------------------------------------------------------------------


def test_accepted_slot_moves_worked_example() -> None:
    src, dst = accepted_slot_moves(L([[0, 2, 4, -1], [0, -1, -1, -1]]), L([[40, 41, 42, 43, 44], [9, 3, 5, 6, 7]]))
    assert src.tolist() == [40, 42, 44, 40, 9, 9, 9, 9]
    assert dst.tolist() == [40, 41, 42, 40, 9, 9, 9, 9]
