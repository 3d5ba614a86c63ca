"""Verification rules on hand-built tensors, expected values written next to them.

Terms (see :mod:`specdec.spec.verify`): each step emits the accepted drafts
then one token: the *recovered* one in place of the first rejected draft, or
the *bonus* one after the last draft when all were accepted. Outputs are
``-1`` past the emitted tokens.
"""

from __future__ import annotations

import torch

from specdec.sampling import LANE_ACCEPT, LANE_RESIDUAL, LANE_TARGET, sample_from, uniform
from specdec.spec.verify import verify_greedy, verify_sampled

V = 10  # vocabulary of the hand-built examples


def logits_with_argmax(argmax: list[list[int]], vocab: int = V) -> torch.Tensor:
    """[B, n, V] logits whose argmax at [b, i] is ``argmax[b][i]`` (margin 5)."""
    a = torch.tensor(argmax, dtype=torch.long)
    x = torch.zeros(*a.shape, vocab)
    x.scatter_(-1, a.unsqueeze(-1), 5.0)
    return x


def onehot(tokens: list[list[int]], vocab: int = V) -> torch.Tensor:
    """[B, n, V] one-hot rows."""
    t = torch.tensor(tokens, dtype=torch.long)
    return torch.zeros(*t.shape, vocab).scatter_(-1, t.unsqueeze(-1), 1.0)


def L(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long)


# -- greedy ------------------------------------------------------------------------------------


def test_greedy_worked_example_partial_accept() -> None:
    # The docstring's example: γ = 3, drafts [5, 7, 9], target argmax [5, 7, 2, 4]
    # (after the prefix, after d1, after d2, after d3).
    out, acc = verify_greedy(
        draft_tokens=L([[5, 7, 9]]),
        target_logits=logits_with_argmax([[5, 7, 2, 4]]),
        num_draft=L([3]),
    )
    # d1 = 5 == 5 kept, d2 = 7 == 7 kept, d3 = 9 != 2 rejected -> 2 accepted,
    # then the recovered token argmax[2] = 2; nothing after it.
    assert acc.tolist() == [2]
    assert out.tolist() == [[5, 7, 2, -1]]


def test_greedy_all_accepted_gives_bonus() -> None:
    out, acc = verify_greedy(
        draft_tokens=L([[5, 7, 9]]),
        target_logits=logits_with_argmax([[5, 7, 9, 4]]),
        num_draft=L([3]),
    )
    # All three drafts match -> 3 accepted, then the bonus argmax[3] = 4.
    assert acc.tolist() == [3]
    assert out.tolist() == [[5, 7, 9, 4]]


def test_greedy_first_rejected_gives_recovered_only() -> None:
    out, acc = verify_greedy(
        draft_tokens=L([[5, 7, 9]]),
        target_logits=logits_with_argmax([[3, 7, 9, 4]]),
        num_draft=L([3]),
    )
    # d1 = 5 != 3: nothing accepted (later matches do not count), recovered 3.
    assert acc.tolist() == [0]
    assert out.tolist() == [[3, -1, -1, -1]]


def test_greedy_batch_rows_are_independent() -> None:
    out, acc = verify_greedy(
        draft_tokens=L([[5, 7, 9], [1, 2, 3], [4, 4, 4]]),
        target_logits=logits_with_argmax([[5, 7, 2, 4], [1, 2, 3, 8], [0, 4, 4, 4]]),
        num_draft=L([3, 3, 3]),
    )
    assert acc.tolist() == [2, 3, 0]
    assert out.tolist() == [
        [5, 7, 2, -1],  # 2 accepted, recovered 2
        [1, 2, 3, 8],  # all accepted, bonus 8
        [0, -1, -1, -1],  # first rejected, recovered 0
    ]


def test_greedy_per_request_gamma() -> None:
    # Padded γ = 3; request 0 really proposes 3, request 1 only 1, request 2 none.
    # Every row's drafts *match* the argmax, so only num_draft limits acceptance.
    out, acc = verify_greedy(
        draft_tokens=L([[5, 7, 9], [1, 2, 3], [6, 0, 0]]),
        target_logits=logits_with_argmax([[5, 7, 9, 4], [1, 2, 3, 8], [6, 0, 0, 1]]),
        num_draft=L([3, 1, 0]),
    )
    assert acc.tolist() == [3, 1, 0]
    assert out.tolist() == [
        [5, 7, 9, 4],  # γ = 3: all accepted, bonus argmax[3] = 4
        [1, 2, -1, -1],  # γ = 1: d1 accepted, bonus argmax[1] = 2 (padding drafts ignored)
        [6, -1, -1, -1],  # γ = 0: plain decoding, argmax[0] = 6 (the padded draft 6 is not "accepted")
    ]


def test_greedy_num_draft_none_means_every_request_has_gamma() -> None:
    drafts = [[5, 7, 9], [1, 2, 3], [4, 4, 4]]
    logits = logits_with_argmax([[5, 7, 2, 4], [1, 2, 3, 8], [0, 4, 4, 4]])
    full = verify_greedy(draft_tokens=L(drafts), target_logits=logits, num_draft=L([3, 3, 3]))
    none = verify_greedy(draft_tokens=L(drafts), target_logits=logits, num_draft=None)
    assert none[1].tolist() == full[1].tolist() == [2, 3, 0]
    assert none[0].tolist() == full[0].tolist()


def test_greedy_zero_width_draft_is_plain_decoding() -> None:
    # No speculation in the whole batch: drafts [B, 0], one logit row per request.
    out, acc = verify_greedy(
        draft_tokens=torch.zeros(2, 0, dtype=torch.long),
        target_logits=logits_with_argmax([[3], [8]]),
        num_draft=L([0, 0]),
    )
    assert acc.tolist() == [0, 0]
    assert out.tolist() == [[3], [8]]


# -- sampled -----------------------------------------------------------------------------------


def _sampled(drafts, draft_probs, target_probs, num_draft, seeds=None, start=0):
    b, g = len(drafts), len(drafts[0])
    seeds = L(seeds if seeds is not None else list(range(b)))
    positions = torch.full((b, 1), start, dtype=torch.long) + torch.arange(g + 1)
    return verify_sampled(
        draft_tokens=L(drafts),
        draft_probs=draft_probs,
        target_probs=target_probs,
        num_draft=L(num_draft),
        seeds=seeds,
        positions=positions,
    )


def test_sampled_with_one_hot_p_and_q_reproduces_greedy() -> None:
    drafts = [[5, 7, 9], [1, 2, 3], [4, 4, 4], [6, 0, 0]]
    argmax = [[5, 7, 2, 4], [1, 2, 3, 8], [0, 4, 4, 4], [6, 0, 0, 1]]
    num_draft = [3, 3, 3, 0]
    want_out, want_acc = verify_greedy(
        draft_tokens=L(drafts), target_logits=logits_with_argmax(argmax), num_draft=L(num_draft)
    )
    for q in (onehot(drafts), None):  # explicit one-hot q, and q left implicit (deterministic drafts)
        for seed0 in (0, 123, 2**40 + 7):
            out, acc = _sampled(drafts, q, onehot(argmax), num_draft, seeds=[seed0 + i for i in range(4)], start=11)
            assert acc.tolist() == want_acc.tolist() == [2, 3, 0, 0]
            assert out.tolist() == want_out.tolist() == [
                [5, 7, 2, -1],
                [1, 2, 3, 8],
                [0, -1, -1, -1],
                [6, -1, -1, -1],
            ]


def test_sampled_outputs_minus_one_past_emitted_tokens() -> None:
    # Random p and q over V tokens: whatever is accepted, a row holds exactly
    # num_accepted + 1 tokens, then -1; the accepted ones are the drafts.
    g, b = 4, 64
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(b, g + 1, V, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(b, g, V, generator=gen) * 2, -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(b, g)
    num_draft = torch.randint(0, g + 1, (b,), generator=gen)
    out, acc = verify_sampled(
        draft_tokens=drafts,
        draft_probs=q,
        target_probs=p,
        num_draft=num_draft,
        seeds=torch.arange(b),
        positions=torch.arange(g + 1).expand(b, g + 1) + 3,
    )
    assert out.shape == (b, g + 1)
    for row, k, n, d in zip(out.tolist(), acc.tolist(), num_draft.tolist(), drafts.tolist()):
        assert 0 <= k <= n
        assert row[:k] == d[:k]
        assert 0 <= row[k] < V
        assert row[k + 1 :] == [-1] * (g - k)
    assert 0 < int(acc.sum()) < int(num_draft.sum())  # both branches happened


def test_sampled_reject_takes_residual_and_accept_keeps_draft() -> None:
    # One position, V = 3. p = [0.5, 0.5, 0], q = [0, 0, 1]: the draft 2 has
    # p(2) = 0, so it is always rejected; the residual max(0, p - q) = [0.5, 0.5, 0]
    # can never give 2.
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])  # [1, γ+1=2, 3]
    q = torch.tensor([[[0.0, 0.0, 1.0]]])  # [1, γ=1, 3]
    seen = set()
    for s in range(200):
        out, acc = _sampled([[2]], q, p, [1], seeds=[s])
        assert acc.tolist() == [0]
        assert out[0, 1].item() == -1
        seen.add(out[0, 0].item())
    assert seen == {0, 1}
    # q == p at the draft's position: min(1, p/q) = 1, always accepted, bonus from p[1].
    q_eq = p[:, :1].clone()
    for s in range(50):
        out, acc = _sampled([[1]], q_eq, p, [1], seeds=[s])
        assert acc.tolist() == [1]
        assert out[0, 0].item() == 1 and out[0, 1].item() in (0, 1, 2)


def test_sampled_per_request_gamma_takes_bonus_at_num_draft() -> None:
    # Padded γ = 2; row 0 proposes 2, row 1 one, row 2 none. p is one-hot and
    # every draft matches it, so acceptance is certain and the bonus is the
    # one-hot token at position num_draft.
    p = onehot([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    out, acc = _sampled([[1, 2], [4, 5], [7, 8]], None, p, [2, 1, 0], seeds=[5, 6, 7])
    assert acc.tolist() == [2, 1, 0]
    assert out.tolist() == [[1, 2, 3], [4, 5, -1], [7, -1, -1]]


def test_sampled_draws_are_the_documented_counter_based_ones() -> None:
    # The accept test and the two draws read fixed (seed, position, lane) noise:
    # rebuild them by hand for one request and compare.
    seed, start = 42, 7
    p = torch.tensor([[[0.1, 0.6, 0.3], [0.3, 0.3, 0.4]]])  # [1, 2, 3]
    q = torch.tensor([[[0.0, 0.2, 0.8]]])  # draft 2 with q(2) = 0.8 > p(2) = 0.3
    out, acc = _sampled([[2]], q, p, [1], seeds=[seed], start=start)
    u = uniform(torch.tensor([[seed]]), torch.tensor([[start]]), LANE_ACCEPT)[0, 0].item()
    accepted = u * 0.8 <= 0.3  # u < p(2) / q(2)
    if accepted:
        bonus = sample_from(p[:, 1], torch.tensor([seed]), torch.tensor([start + 1]), LANE_TARGET).item()
        assert out.tolist() == [[2, bonus]]
    else:
        residual = torch.tensor([[0.1, 0.4, 0.0]])  # max(0, p - q), sampled unnormalized (same race)
        rec = sample_from(residual, torch.tensor([seed]), torch.tensor([start]), LANE_RESIDUAL).item()
        assert rec in (0, 1)
        assert out.tolist() == [[rec, -1]]
    assert acc.tolist() == [int(accepted)]


def test_greedy_tokens_is_argmax_with_ties_first() -> None:
    from specdec.sampling import greedy_tokens

    g = torch.Generator().manual_seed(0)
    for n in (3, 4096):
        x = torch.randint(0, 3, (64, n), generator=g).float()  # many ties
        assert torch.equal(greedy_tokens(x), x.argmax(-1))
        assert torch.equal(greedy_tokens(x.view(8, 8, n)), x.view(8, 8, n).argmax(-1))
    assert greedy_tokens(torch.zeros(2, 5)).tolist() == [0, 0]
