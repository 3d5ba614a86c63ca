"""Attention over the paged cache through ``torch.nn.attention.flex_attention``.

``runtime.attention="flex"`` (chosen once, at load: :func:`use_flex_attention`).
The cache of a layer, ``[slots, Hkv, D]``, *is* the key sequence: every query of the
packed batch attends over all slots, and a ``mask_mod`` says which slots it may read
(its own request's, up to its key index, its tree ancestors in a token-tree step, its
window). No per-layer gather of a request's keys and values: flex reads the cache in
place, skipping every 128-slot tile no query of a 128-row tile may read. The tables
behind the ``mask_mod`` and the block mask are built once per forward and shared by
every layer.

Flex attention runs fused only compiled. Here the call itself is compiled with static
shapes (``dynamic=False``; torch 2.13's CPU flex template fails to build with symbolic
sizes), so the packed rows are padded to a power of two (at least :data:`MIN_ROWS`)
and each size compiles once. An eager model runs it as it is; a compiled model
(``runtime.compile``) breaks its graph around it (``torch.compiler.disable``), as it does
around the native CPU stack. A padded row reads nothing and its output is dropped.

Summation order: a row's keys sit at their slots whatever else is in the batch, and a
tile no query of it reads is skipped (in the tiles it reads, a masked key adds an exact
0), so a row gets the same bits alone, beside other requests or among the rows of a
verification (on torch 2.13's CPU kernel also across padded sizes 16, 32 and 64).
Non-finite values reach only the rows that read them, as on the gather paths. Inside a
tile it reads, a row weighs a masked key's value by an exact 0, and ``0 × NaN`` is NaN,
so a non-finite value is never stored: a forward stores a slot whose new key or value
is not finite (any head) as key NaN, value 0 (:func:`_stored`). A masked NaN score is
``-inf`` (weight exactly 0), so rows that do not read the slot keep their bits; a row
that reads it (found from the same mask, not from the kernel: torch 2.13's CPU kernel
turns a visible NaN score into a 0 row) is made NaN, as the gather path makes it, so
the request that made it still fails. The cache starts zeroed (``PagedKVCache``).

The block mask is built by evaluating the ``mask_mod`` over ``[rows, slots]`` once per
forward (eager); a long prefill over a large cache pays for that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from specdec.core.inputs import DecoderInputs, KVCacheTensors

MIN_ROWS = 16  # the smallest padded query count (a decode step of up to 16 requests)
_compiled: Callable[..., torch.Tensor] | None = None


def use_flex_attention(module: nn.Module) -> int:
    """Has every submodule of ``module`` that attends over a paged cache (declares
    ``attention_kernel``) do so through flex attention; the number set. Call after packing
    (which sets ``attention_kernel`` for our CPU kernel) and before choosing the backend:
    a decoder on flex attention never takes the native C++ forward."""
    n = 0
    for m in module.modules():
        if hasattr(type(m), "attention_kernel"):
            m.attention_kernel = "flex"
            n += 1
    return n


def _flex() -> Callable[..., torch.Tensor]:
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        import torch._dynamo

        # A graph per padded row count, mask kind (plain, tree, window) and cache size: past
        # dynamo's default limit of 8, later ones would silently run unfused.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def padded_rows(t: int) -> int:
    """The query count a forward of ``t`` packed rows runs at: a power of two >= MIN_ROWS."""
    return max(MIN_ROWS, 1 << max(t - 1, 0).bit_length())


@torch.compiler.disable
def _tables(inputs: DecoderInputs, num_slots: int, window: int | None) -> tuple[Any, int, torch.Tensor]:
    """The block mask of one forward (every layer's), its padded row count, and which of its
    request's slots (``gather_slots``) each row reads."""
    from torch.nn.attention.flex_attention import create_block_mask

    dev = inputs.tokens.device
    t = inputs.tokens.shape[0]
    rows = padded_rows(t)
    b, q = inputs.q_index.shape
    s = inputs.gather_slots.shape[1]
    # Each slot's owner request and key index within it (-1: no request of this batch
    # reads it). Keys past a request's context (padding) go to a dropped extra slot.
    key_pos = torch.arange(s, device=dev)
    in_ctx = key_pos <= inputs.q_pos.amax(1, keepdim=True)  # [B, S]
    where = torch.where(in_ctx, inputs.gather_slots, num_slots).reshape(-1)
    req = torch.arange(b, device=dev).unsqueeze(1).expand(b, s).reshape(-1)
    slot_req = torch.full((num_slots + 1,), -1, dtype=torch.long, device=dev).index_put_((where,), req)[:-1]
    slot_key = torch.zeros(num_slots + 1, dtype=torch.long, device=dev).index_put_(
        (where,), key_pos.expand(b, s).reshape(-1))[:-1]

    def pad(x: torch.Tensor, fill: int) -> torch.Tensor:  # [T] -> [rows]
        return torch.cat([x, x.new_full((rows - t,), fill)])

    # Each packed row's request (pad: -2, which owns no slot) and key index.
    q_req = pad(inputs.out_index // q, -2)
    q_key = pad(inputs.q_pos.reshape(-1).index_select(0, inputs.out_index), -1)
    tree = inputs.tree_mask
    if tree is not None:
        # Row p1 sees new row p2 of this step iff both are request r's and tree[r, i1, i2]
        # ([rows, rows]: its size depends on the padded row count only, so no recompiles).
        r, i = inputs.out_index // q, inputs.out_index % q
        sees = (r[:, None] == r[None, :]) & tree[r[:, None], i[:, None], i[None, :]]  # [T, T]
        tree_rows = torch.zeros(rows, rows, dtype=torch.bool, device=dev)
        tree_rows[:t, :t] = sees
        slot_row = torch.full((num_slots,), -1, dtype=torch.long, device=dev).index_put_(
            (inputs.slot_mapping,), torch.arange(t, device=dev))  # the row that wrote each slot now
    if window is not None:  # the window counts rope positions (a tree node's: root + depth)
        slot_rope = slot_key.clone().index_put_((inputs.slot_mapping,), inputs.positions)
        q_rope = pad(inputs.positions, 0)

    def mask_mod(_b: Any, _h: Any, qi: Any, kv: Any) -> Any:
        key = slot_key[kv]
        seen = (slot_req[kv] == q_req[qi]) & (key <= q_key[qi])
        if tree is not None:
            row = slot_row[kv]
            seen = seen & ((row < 0) | tree_rows[qi, row.clamp(min=0)])
        if window is not None:
            seen = seen & (slot_rope[kv] > q_rope[qi] - window)
        return seen

    block_mask = create_block_mask(mask_mod, 1, None, rows, num_slots, device=dev, _compile=False)
    # Which of its request's slots each packed row reads: [T, S] (marked slots, module doc).
    reads = mask_mod(None, None, torch.arange(t, device=dev)[:, None], inputs.gather_slots[q_req[:t]])
    return block_mask, rows, reads


def _stored(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache keeps of new keys and values ``[T, Hkv, D]``: a row with a non-finite
    key or value as key NaN and value 0 (module doc); the others as they are, bit for bit."""
    bad = ~(torch.isfinite(k).all(2).all(1) & torch.isfinite(v).all(2).all(1))[:, None, None]  # [T, 1, 1]
    return k.masked_fill(bad, float("nan")), v.masked_fill(bad, 0.0)


class FlexAttend:
    """:class:`~specdec.models.llama.Attend` over the paged cache by flex attention
    (module doc): one call per layer over the whole packed batch, no gathered copies."""

    rows_meet = False  # nothing hidden per row, so nothing to rerun (module doc)

    def __init__(self, inputs: DecoderInputs, cache: KVCacheTensors, window: int | None) -> None:
        self.inputs = inputs
        self.cache = cache
        self.block_mask, self.rows, self.reads = _tables(inputs, cache.k.shape[1], window)
        self.row_req = inputs.out_index // inputs.q_index.shape[1]

    @torch.compiler.disable
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        slots = self.inputs.slot_mapping
        k, v = _stored(k, v)
        self.cache.k[layer].index_copy_(0, slots, k)
        self.cache.v[layer].index_copy_(0, slots, v)
        t, h, d = q.shape
        qp = torch.cat([q, q.new_zeros(self.rows - t, h, d)]).unsqueeze(0).transpose(1, 2)  # [1, H, rows, D]
        kc = self.cache.k[layer].unsqueeze(0).transpose(1, 2)  # [1, Hkv, slots, D]: a view
        vc = self.cache.v[layer].unsqueeze(0).transpose(1, 2)
        out = _flex()(qp, kc, vc, block_mask=self.block_mask, enable_gqa=True)  # [1, H, rows, D]
        out = out[0, :, :t].transpose(0, 1).reshape(t, h * d)
        # A row that reads a slot stored as not finite is NaN, as on the gather path (module doc).
        marked = self.cache.k[layer, :, 0, 0][self.inputs.gather_slots].isnan()  # [B, S]
        return out.masked_fill((marked[self.row_req] & self.reads).any(1, keepdim=True), float("nan"))
