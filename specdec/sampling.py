"""Per-request sampling that does not depend on batch-mates.

Randomness is *counter-based*: the noise for request ``r`` at sequence
position ``pos``, purpose ``lane`` and vocabulary entry ``j`` is a hash of
``(seed_r, pos, lane, j)``. A request therefore draws the same numbers alone
or in any batch, and a preempted request recomputes the same tokens.

Sampling from ``p`` uses the exponential race: ``argmax_j p_j / E_j`` with
``E_j = -log U_j`` i.i.d. Exp(1) picks ``j`` with probability ``p_j``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

M32 = 0xFFFFFFFF

# Lanes: independent noise streams for the different draws at one position.
LANE_ACCEPT = 1  # the uniform of the accept test
LANE_RESIDUAL = 2  # sampling the residual norm(max(0, p - q))
LANE_TARGET = 3  # sampling the target (plain decoding and the bonus token)
LANE_DRAFT = 4  # the drafter sampling its proposal


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32  # both factors < 2**32, 2**31: no int64 overflow
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & M32
    return x ^ (x >> 16)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, lane: int, width: int | None = None) -> torch.Tensor:
    """U(0, 1) noise, float32.

    ``seeds`` and ``positions`` broadcast together (e.g. ``[B, 1]`` and
    ``[B, n]``); with ``width`` a last dim of that many entries is added (one
    per vocabulary entry).
    """
    row = _mix32(seeds & M32) ^ _mix32((seeds >> 32) & M32 ^ 0x5BD1E995)
    row = _mix32(row ^ _mix32((positions & M32) ^ (lane * 0x9E3779B9 & M32)))
    if width is not None:
        j = torch.arange(width, device=seeds.device, dtype=torch.long)
        row = _mix32(row.unsqueeze(-1) ^ _mix32(j + 0x68E31DA4))
    # 23 bits: (k + 0.5) / 2**23 is exact in float32, so 0 < u < 1 strictly.
    return ((row >> 9).float() + 0.5) * (1.0 / (1 << 23))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``argmax`` over the last dim, ``[..., V] -> [...]`` int64.

    ``max(-1).indices`` picks the same index as ``torch.argmax`` (the first
    maximum on ties) and is about 2x faster on CPU for a few rows.
    """
    return logits.max(dim=-1).indices


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., V] -> [...]`` bool: every entry of the row is finite.

    NaN and ±inf survive a sum, so one float32 sum per row decides it (on CPU
    ``isfinite().all()`` is ~15x slower). Only a row of finite values summing
    past float32's range (~3e38) would be misread as non-finite.
    """
    return x.sum(-1, dtype=torch.float32).isfinite()


def sample_from(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, lane: int) -> torch.Tensor:
    """One draw from each row of ``probs`` [..., V] -> [...] int64 (exponential race)."""
    e = -torch.log(uniform(seeds, positions, lane, probs.shape[-1]))
    return greedy_tokens(probs / e)


@dataclass
class SamplingTensors:
    """Per-request sampling parameters for one batch, as tensors ``[B]``."""

    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float; 1 = off
    seeds: torch.Tensor  # [B] int64
    all_greedy: bool  # host flag: skip the sampling path entirely
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool


def slot_sampling(params: list, slots: torch.Tensor | None, gather: Callable[[str, torch.Tensor], torch.Tensor],
                  device: torch.device, greedy: dict[int, SamplingTensors]) -> SamplingTensors:
    """A batch's sampling tensors from the per-request state store (``gather(name, slots)``,
    written at admission), given each request's ``params`` (host flags). An all-greedy batch
    reads none of them: the zero tensors kept in ``greedy`` (by batch size; never written)
    serve every such batch of its size."""
    temps = [p.temperature for p in params]
    if all(t == 0 for t in temps):
        if len(params) not in greedy:
            z, zl = torch.zeros(len(params), device=device), torch.zeros(len(params), dtype=torch.long, device=device)
            greedy[len(params)] = SamplingTensors(temperature=z, top_k=zl, top_p=z, seeds=zl, all_greedy=True,
                                                  any_greedy=True, any_top_k=False, any_top_p=False)
        return greedy[len(params)]
    assert slots is not None
    return SamplingTensors(temperature=gather("temperature", slots), top_k=gather("top_k", slots),
                           top_p=gather("top_p", slots), seeds=gather("seed", slots), all_greedy=False,
                           any_greedy=any(t == 0 for t in temps), any_top_k=any(p.top_k > 0 for p in params),
                           any_top_p=any(p.top_p < 1.0 for p in params))


def probs_from_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Temperature, top-k, top-p, softmax. ``logits`` [B, n, V] -> probs [B, n, V].

    Greedy rows (temperature 0) become one-hot at the argmax, so one
    verification rule serves greedy and sampled requests alike.
    """
    greedy = (st.temperature == 0).view(-1, 1, 1)
    temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    x = logits.float()
    # Shifted so the largest is 0 first: a tiny (finite) temperature then sends
    # the others to -inf, never the largest to inf (inf - inf: NaN probabilities).
    x = (x - x.amax(-1, keepdim=True)) / temp.view(-1, 1, 1)
    if st.any_top_k:
        k = st.top_k.clamp(min=0, max=x.shape[-1]).view(-1, 1, 1)  # top_k >= vocab: no cut
        srt = torch.sort(x, dim=-1, descending=True).values
        kth = srt.gather(-1, (k - 1).clamp(min=0).expand(*x.shape[:-1], 1))
        x = torch.where((k > 0) & (x < kth), torch.full_like(x, float("-inf")), x)
    if st.any_top_p:
        srt, idx = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(srt, dim=-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (keep >= 1).
        drop_sorted = (cum - torch.softmax(srt, dim=-1)) >= st.top_p.view(-1, 1, 1)
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if st.any_greedy:
        onehot = torch.zeros_like(probs).scatter_(-1, greedy_tokens(logits).unsqueeze(-1), 1.0)
        probs = torch.where(greedy, onehot, probs)
    return probs


def draw_drafts(logits: torch.Tensor, st: SamplingTensors | None, positions: torch.Tensor,
                lane: int = LANE_DRAFT) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's tokens from its logits ``[B, V]`` or ``[B, n, V]``, drafts at sequence
    ``positions`` ``[B]`` or ``[B, n]`` -> (tokens ``[B]`` / ``[B, n]``, q or None).

    ``st`` None (an all-greedy batch): the argmax, no q. Else q =
    :func:`probs_from_logits` (each request's temperature / top-k / top-p;
    greedy rows one-hot) and a draw from it on ``lane`` at each position,
    which is what verification replays: the drafts' q must be kept.
    """
    if st is None:
        return greedy_tokens(logits), None
    row = logits.dim() == 2
    q = probs_from_logits(logits.unsqueeze(1) if row else logits, st)  # [B, n, V]
    tokens = sample_from(q, st.seeds.unsqueeze(1), positions.unsqueeze(1) if row else positions, lane)
    return (tokens.squeeze(1), q.squeeze(1)) if row else (tokens, q)


def sampling_tensors(params: list, seeds: list[int], device: torch.device | str = "cpu") -> SamplingTensors:
    """Packs per-request :class:`~specdec.core.context.SamplingParams` into tensors."""
    temps = [p.temperature for p in params]
    ks = [p.top_k for p in params]
    ps = [p.top_p for p in params]
    return SamplingTensors(
        temperature=torch.tensor(temps, dtype=torch.float32, device=device),
        top_k=torch.tensor(ks, dtype=torch.long, device=device),
        top_p=torch.tensor(ps, dtype=torch.float32, device=device),
        seeds=torch.tensor(seeds, dtype=torch.long, device=device),
        all_greedy=all(t == 0 for t in temps),
        any_greedy=any(t == 0 for t in temps),
        any_top_k=any(k > 0 for k in ks),
        any_top_p=any(p < 1.0 for p in ps),
    )
