"""Reused index tensors for one request's speculative steps (a batch of one on a CPU).

Each speculative step packs inputs of the same few shapes again: the target's γ+1
verified rows, a draft model's catch-up and its γ - 1 step slots, an EAGLE head's
rows. Host work between two forwards runs on caches the forwards left cold, so each
tensor a step creates costs tens of microseconds (:class:`~specdec.core.batch_processor.
DecodeBuffers`, the plain step's version of this). :class:`OneRequestBuffers` allocates
each shape once and rewrites it in place through numpy views of the same memory.

The values, shapes and flags are those of ``DecoderBatchProcessor``'s packing of one
request (``_pack_one``), so outputs stay bit for bit; what a step gets is valid until
the same buffers pack the next step: run it at once and keep nothing of it.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.core.batch_processor import PackedBatch
from specdec.core.context import TextContext
from specdec.core.inputs import DecoderInputs, MaskKind
from specdec.core.kv_cache import PagedKVCache


def serves(device: torch.device | str, compiled: bool, data_parallel_degree: int = 1) -> bool:
    """Where reused buffers serve: a CPU run (no copy to a device), not compiled (a compiled
    graph guards on its inputs' strides and aliasing), one replica."""
    return torch.device(device).type == "cpu" and not compiled and data_parallel_degree == 1


class _Rows:
    """The row tensors of steps feeding ``ln`` rows: written in place each step."""

    def __init__(self, ln: int) -> None:
        self.tokens, self.positions, self.slot = (torch.zeros(ln, dtype=torch.long) for _ in range(3))
        self.q_pos = torch.zeros(1, ln, dtype=torch.long)
        self.np = [t.numpy().reshape(-1) for t in (self.tokens, self.positions, self.slot, self.q_pos)]
        # Constant: one request's rows are its queries, in order.
        self.q_index = torch.arange(ln).view(1, ln)
        self.out_index = torch.arange(ln)
        self.steps = np.arange(ln)


class OneRequestBuffers:
    """Step tensors of one request over one paged ``cache`` (module doc): :meth:`pack`
    (a forward's inputs), :meth:`gather` (its slot list through a width), :meth:`small`
    (any other small int64 tensor a step rewrites, by name)."""

    def __init__(self, cache: PagedKVCache, max_seq_len: int) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self._rows: dict[int, _Rows] = {}
        self._logits: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._small: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, np.ndarray]] = {}
        self._slots: dict[int, torch.Tensor] = {}  # state-store slot -> its [1] tensor (read-only)
        self.context_lengths = torch.zeros(1, dtype=torch.long)
        self._ctx_np = self.context_lengths.numpy()
        self._grow(max_seq_len)

    def _grow(self, num_tokens: int) -> None:
        cap = -(-num_tokens // self.block_size) * self.block_size
        self._gather = torch.zeros(1, cap, dtype=torch.long)
        self._gather_np = self._gather.numpy()[0]
        self._views: dict[int, torch.Tensor] = {}  # width -> gather[:, :width]
        self._held: list[int] = []  # block ids whose slots the buffer holds, in order, whole

    def gather(self, blocks: list[int], width: int) -> torch.Tensor:
        """``[1, width]`` KV slot of each position 0 … width - 1 for a request holding ``blocks``;
        a position past them takes its last block's (as ``block_table_array``'s clamped
        packing does: a padded draft step's, never read)."""
        bs = self.block_size
        if width > self._gather_np.shape[0]:
            self._grow(width)
        if len(blocks) * bs < width:  # positions past the blocks held: clamped, written whole
            p = np.arange(width)
            held = np.asarray(blocks, dtype=np.int64)
            self._gather_np[:width] = held[np.minimum(p // bs, len(blocks) - 1)] * bs + p % bs
            self._held = list(blocks)
        else:  # whole blocks, only those not written yet (all of them for another request)
            nb, k = -(-width // bs), len(self._held)
            if blocks[:k] != self._held:
                k = 0
            if k < nb:
                new = np.asarray(blocks[k:nb], dtype=np.int64)
                self._gather_np[k * bs: nb * bs] = (new[:, None] * bs + np.arange(bs)).reshape(-1)
                self._held = blocks[:nb]
        view = self._views.get(width)
        if view is None:
            view = self._views[width] = self._gather[:, :width]
        return view

    def slots_at(self, positions: np.ndarray) -> np.ndarray:
        """The slots of ``positions`` in the last :meth:`gather` (host values, no tensor op)."""
        return self._gather_np[positions]

    def small(self, name: str, values: list[int] | np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
        """A reused int64 tensor of ``shape`` holding ``values`` (one per name and shape)."""
        entry = self._small.get((name, shape))
        if entry is None:
            t = torch.zeros(shape, dtype=torch.long)
            entry = self._small[(name, shape)] = (t, t.numpy().reshape(-1))
        entry[1][:] = values
        return entry[0]

    def rows(self, ln: int) -> _Rows:
        r = self._rows.get(ln)
        if r is None:
            r = self._rows[ln] = _Rows(ln)
        return r

    def slot_tensor(self, slot: int) -> torch.Tensor:
        t = self._slots.get(slot)
        if t is None:
            t = self._slots[slot] = torch.tensor([slot], dtype=torch.long)
        return t

    def pack(self, ctx: TextContext, num_new: int, *, lookahead: int = 0, return_n_logits: int = 1,
             slot: int | None = None) -> PackedBatch:
        """``DecoderBatchProcessor.prepare_initial_token_inputs`` of ``ctx`` alone: its next
        ``num_new`` tokens, then ``lookahead`` placeholder rows; reserves and advances its
        table in this cache as that does. ``slot``: its state-store slot (``state_slots``)."""
        table = ctx.kv[self.cache.name]
        start = table.num_tokens
        ln = num_new + lookahead
        if num_new < 1 or start + num_new > len(ctx.tokens):
            raise ValueError(f"request {ctx.request_id!r}: cannot feed {num_new} tokens from position {start}")
        end = start + ln
        if len(table.blocks) * self.block_size < end:  # (the scheduler reserved it: a no-op then)
            self.cache.reserve(table, end)
        r = self.rows(ln)
        tok, pos, slot_np, q_pos = r.np
        tok[:num_new] = ctx.tokens[start:start + num_new]
        tok[num_new:] = 0
        pos[:] = r.steps + start
        q_pos[:] = pos
        gather = self.gather(table.blocks, end)
        slot_np[:] = self._gather_np[start:end]
        self._ctx_np[0] = end
        n = return_n_logits
        logit_index, draft_index = self._logit_rows(ln, n, lookahead)
        table.num_tokens = end
        inputs = DecoderInputs(
            tokens=r.tokens, positions=r.positions, slot_mapping=r.slot, gather_slots=gather, q_index=r.q_index,
            q_pos=r.q_pos, out_index=r.out_index, logit_index=logit_index, context_lengths=self.context_lengths,
            single_request=True,
            mask=MaskKind.NONE if ln == 1 else MaskKind.CAUSAL if start == 0 else MaskKind.EXPLICIT,
            data_parallel_splits=[0, 1], kv_cache=self.cache.tensors,
        )
        return PackedBatch(inputs, [ctx], [num_new], [lookahead], draft_index, n,
                           self.slot_tensor(slot) if slot is not None else None)

    def _logit_rows(self, ln: int, n: int, look: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logit_index [n], draft_index [1, look] or None), constant per shape (``_pack_one``'s)."""
        key = (ln, n, look)
        out = self._logits.get(key)
        if out is None:
            r = np.arange(max(ln, n, look + 1))
            if look:
                first = ln - look - 1  # the last real row
                out = (torch.from_numpy(np.minimum(first + r[:n], ln - 1)),
                       torch.from_numpy((first + 1 + r[:look]).reshape(1, look)))
            else:
                out = (torch.from_numpy(np.maximum(ln - n + r[:n], 0)), None)
            self._logits[key] = out
        return out
