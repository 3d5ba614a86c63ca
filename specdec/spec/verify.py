"""Verification: which draft tokens the target keeps, and the token it adds.

Terms (per request, one step, γ draft tokens ``d_1 … d_γ``):

- **accepted**: the longest prefix of the draft the target keeps;
- **recovered**: the token the target puts in place of the first rejected
  draft token, drawn from the residual ``norm(max(0, p - q))``;
- **bonus**: the target's token after the last draft token when *all* are
  accepted, drawn from ``p`` at position γ + 1.

Each step emits ``accepted + 1`` tokens: the accepted drafts then one
recovered or bonus token. Greedy is the case where ``p`` and ``q`` are one-hot
at the argmax: a draft token is accepted iff it equals the target's argmax.

Worked example (γ = 3, one request, greedy)::

    draft_tokens          = [[5, 7, 9]]          # [B=1, γ=3]
    target argmax at i    = [[5, 7, 2, 4]]       # [B, γ+1]: after prefix, after d1, after d2, after d3
    matches               = [[1, 1, 0]]          # d1, d2 kept; d3 rejected
    num_accepted          = [2]                  # cumprod(matches).sum()
    output_tokens         = [[5, 7, 2, -1]]      # accepted drafts, then argmax[2] (recovered)

Had all three matched, ``output_tokens = [[5, 7, 9, 4]]`` with 4 the bonus.
With per-request γ, rows with fewer drafts (``num_draft[b] < γ``) treat the
positions past ``num_draft[b]`` as rejected and take their bonus from ``p`` at
``num_draft[b]``. ``num_draft = 0`` is plain decoding.

Why sampling is lossless (Leviathan et al. 2023, Chen et al. 2023): a draft
token ``x ~ q`` is kept with probability ``min(1, p(x)/q(x))``, so it is
emitted with probability ``min(q(x), p(x))``; on rejection (probability
``1 - Σ min(p, q)``) the residual adds ``max(0, p(x) - q(x))`` — together
exactly ``p(x)``.

Faults (:func:`chain_fault`, :func:`tree_fault`): where verification used a
non-finite number, the step reports it per request, and that request alone fails.
"""

from __future__ import annotations

import torch

from specdec.sampling import LANE_ACCEPT, LANE_RESIDUAL, LANE_TARGET, finite_rows, greedy_tokens, sample_from, uniform


def _finish(
    draft_tokens: torch.Tensor,  # [B, γ]
    accept: torch.Tensor,  # [B, γ] bool
    fill: torch.Tensor,  # [B, γ+1] the token to emit if position i is the first not accepted
    num_draft: torch.Tensor,  # [B]
) -> tuple[torch.Tensor, torch.Tensor]:
    b, g = draft_tokens.shape
    ar = torch.arange(g, device=draft_tokens.device)
    accept = accept & (ar < num_draft.unsqueeze(1))  # positions past a request's γ are rejected
    num_accepted = torch.cumprod(accept.long(), dim=1).sum(dim=1)  # [B]
    out = torch.full((b, g + 1), -1, dtype=torch.long, device=draft_tokens.device)
    out[:, :g] = torch.where(ar < num_accepted.unsqueeze(1), draft_tokens, -1)
    out.scatter_(1, num_accepted.unsqueeze(1), fill.gather(1, num_accepted.unsqueeze(1)))
    return out, num_accepted


def verify_greedy(
    *,
    draft_tokens: torch.Tensor,  # [B, γ] int64
    target_logits: torch.Tensor,  # [B, γ+1, V]
    num_draft: torch.Tensor | None,  # [B] int64, each request's γ (<= the padded γ); None: all γ
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification -> ``(output_tokens [B, γ+1] (-1 past the end), num_accepted [B])``.

    An accepted draft token *is* the target's argmax there, so the output is
    the argmax row cut after the first mismatch: no gather or scatter needed.
    """
    argmax = greedy_tokens(target_logits)  # [B, γ+1]
    g = draft_tokens.shape[1]
    ar = torch.arange(g + 1, device=argmax.device)
    accept = draft_tokens == argmax[:, :g]  # [B, γ]
    if num_draft is not None:
        accept &= ar[:g] < num_draft.unsqueeze(1)
    num_accepted = accept.cumprod(dim=1).sum(dim=1)  # [B]
    return argmax.masked_fill(ar > num_accepted.unsqueeze(1), -1), num_accepted


def verify_sampled(
    *,
    draft_tokens: torch.Tensor,  # [B, γ] int64
    draft_probs: torch.Tensor | None,  # [B, γ, V], or None: drafts are deterministic (q one-hot)
    target_probs: torch.Tensor,  # [B, γ+1, V], after temperature / top-k / top-p
    num_draft: torch.Tensor,  # [B] int64
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, γ+1] int64, sequence position each emitted token takes
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling -> ``(output_tokens [B, γ+1], num_accepted [B])``."""
    b, g = draft_tokens.shape
    p_d = target_probs[:, :g].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, γ]
    if draft_probs is None:
        q = torch.zeros_like(target_probs[:, :g]).scatter_(-1, draft_tokens.unsqueeze(-1), 1.0)
    else:
        q = draft_probs
    q_d = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, γ]
    u = uniform(seeds.unsqueeze(1), positions[:, :g], LANE_ACCEPT)  # [B, γ]
    accept = u * q_d <= p_d  # u < p/q without dividing; q_d > 0 for a drawn token
    # Recovered token at each position, from norm(max(0, p - q)); if p == q
    # exactly the residual is empty and rejection cannot happen there anyway.
    residual = (target_probs[:, :g] - q).clamp(min=0)  # [B, γ, V]
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs[:, :g], residual)
    recovered = sample_from(residual, seeds.unsqueeze(1), positions[:, :g], LANE_RESIDUAL)  # [B, γ]
    bonus = sample_from(target_probs, seeds.unsqueeze(1), positions, LANE_TARGET)  # [B, γ+1]
    # Position i is the first not accepted: recovered if a draft stood there, else bonus.
    ar = torch.arange(g + 1, device=draft_tokens.device)
    recovered_ext = torch.cat([recovered, bonus[:, -1:]], dim=1)
    fill = torch.where(ar < num_draft.unsqueeze(1), recovered_ext, bonus)
    return _finish(draft_tokens, accept, fill, num_draft)


# -- faults: the first non-finite number a request's verification used ------------------
#
# A step reports one code per request: -1 (none), 2·i for the target's logits at row i,
# 2·i + 1 for the draft probabilities of draft i. Rows past the accepted drafts are not
# used: a draft that drove the target non-finite is just rejected (rows before it never
# saw it). A greedy drafter's tokens are only proposals (no probabilities to check).
#
# Example (γ = 3, num_accepted = [1]): rows 0 and 1 were used. Target logits non-finite
# at row 2 only -> -1 (that row was not used); at row 1 -> 2; draft 0's
# probabilities non-finite -> 1 (counted first: 1 < 2).


def describe_fault(code: int) -> tuple[str, int]:
    """A fault code -> (what held the non-finite number, its row in the step)."""
    return ("the drafter's probabilities" if code % 2 else "the target's logits"), code // 2


def chain_fault(logits: torch.Tensor, draft_probs: torch.Tensor | None, num_accepted: torch.Tensor,
                num_draft: torch.Tensor) -> torch.Tensor:
    """The fault code of each request of a chain step, [B] (``logits`` [B, γ+1, V],
    ``draft_probs`` [B, γ, V] or None)."""
    n = logits.shape[1]  # γ+1
    row = torch.arange(n, device=logits.device)
    used = row <= num_accepted.unsqueeze(1)  # [B, γ+1]
    code = torch.where(used & ~finite_rows(logits), 2 * row, 2 * n)  # [B, γ+1]
    if draft_probs is not None:
        g = draft_probs.shape[1]
        drafted = used[:, :g] & (row[:g] < num_draft.unsqueeze(1))  # [B, γ]
        code = torch.cat([code, torch.where(drafted & ~finite_rows(draft_probs), 2 * row[:g] + 1, 2 * n)], 1)
    first = code.amin(1)  # [B]
    return torch.where(first < 2 * n, first, -1)


def tree_fault(logits: torch.Tensor, draft_probs: torch.Tensor | None, path: torch.Tensor,
               num_accepted: torch.Tensor) -> torch.Tensor:
    """:func:`chain_fault` of a tree step: only the rows on each request's accepted path
    were used (``path [B, D+1]``, TreeVerdict.path), and the draft probabilities of its
    accepted nodes; ``i`` counts along the path."""
    d1 = path.shape[1]
    row = torch.arange(d1, device=logits.device)
    on = path.clamp(min=0)
    used = row <= num_accepted.unsqueeze(1)  # [B, D+1]
    bad = ~finite_rows(logits).gather(1, on)  # [B, D+1]
    code = torch.where(used & bad, 2 * row, 2 * d1)
    if draft_probs is not None and d1 > 1:
        node = (on[:, 1:] - 1).clamp(min=0)  # [B, D] accepted nodes
        bad_q = ~finite_rows(draft_probs).gather(1, node)
        acc = row[: d1 - 1] < num_accepted.unsqueeze(1)
        code = torch.cat([code, torch.where(acc & bad_q, 2 * row[: d1 - 1] + 1, 2 * d1)], 1)
    first = code.amin(1)
    return torch.where(first < 2 * d1, first, -1)


# -- a greedy chain verified on the host: the step's one read carries what it needs ------
#
# A greedy chain drafted before the step (nothing on the device waits for the verdict)
# needs three small rows per request, not the dozen small ops of verify_greedy and
# chain_fault: the target's argmax at each of its γ+1 rows, the γ drafts, and which rows
# were finite. The host then takes exactly what those two functions give.


def greedy_chain_readout(logits: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """``[B, 3γ + 2]`` int64 rows for :func:`accept_greedy_chain`: the argmax of each of the
    target's ``logits`` rows [B, γ+1, V], the drafts [B, γ], each logits row finite (1) or not."""
    return torch.cat([greedy_tokens(logits), draft_tokens, finite_rows(logits).long()], 1)


def accept_greedy_chain(row: list[int], gamma: int, num_draft: int) -> tuple[list[int], int, int]:
    """One request's row of :func:`greedy_chain_readout` (``gamma`` the step's γ, ``num_draft``
    its own) -> (emitted tokens, num_accepted, fault code): :func:`verify_greedy`'s accepted
    drafts and bonus, :func:`chain_fault`'s code (no draft probabilities)."""
    n = gamma + 1
    k = 0
    while k < num_draft and row[n + k] == row[k]:  # an accepted draft is the target's argmax there
        k += 1
    return row[: k + 1], k, greedy_fault(row[n + gamma:], k)


def greedy_fault(finite: list[int], num_accepted: int) -> int:
    """:func:`chain_fault`'s code of a chain without draft probabilities, on the host: the first
    used row (``<= num_accepted``) whose logits were not finite (``finite[i]`` 0), else -1."""
    return next((2 * i for i in range(num_accepted + 1) if not finite[i]), -1)
