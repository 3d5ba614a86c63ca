"""``StepBuffers``: one request's step tensors packed into reused buffers give what the
general packer gives, and serve under one rule for plain and speculative steps."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from specdec.core.batch_processor import BatchProcessorRuntime, DecoderBatchProcessor, StepBuffers
from specdec.core.context import SamplingParams, TextContext
from specdec.core.inputs import MaskKind
from specdec.core.kv_cache import BlockTable, KVCacheParams, PagedKVCache
from specdec.models.llama import PagedAttend

FIELDS = ("tokens", "positions", "slot_mapping", "gather_slots", "q_index", "q_pos", "out_index", "logit_index",
          "context_lengths")


def _cache(bs: int = 4) -> PagedKVCache:
    return PagedKVCache(KVCacheParams(num_layers=1, num_kv_heads=1, head_dim=2, block_size=bs, num_blocks=64,
                                      dtype=torch.float32, device="cpu"), "t")


def _ctx(tokens: list[int], blocks: list[int], cached: int) -> TextContext:
    ctx = TextContext(request_id="r", tokens=list(tokens), prompt_len=len(tokens), sampling=SamplingParams())
    ctx.kv["t"] = BlockTable(blocks=list(blocks), num_tokens=cached)
    return ctx


def test_step_buffers_pack_what_the_packer_packs() -> None:
    """Reused buffers give prepare_initial_token_inputs' values, shapes and flags (and, where
    they hand over a mask, the one attention builds) step after step (the buffers rewritten
    between), blocks changing under them, placeholder rows or not, and advance the table as it does."""
    bs = 4
    cache = _cache(bs)
    proc = DecoderBatchProcessor(None, BatchProcessorRuntime(kv_caches=[cache], max_batch_size=1, max_seq_len=64))
    one = StepBuffers(cache, 8)  # small: it grows
    for start, num_new, look, n in [(0, 5, 0, 1), (5, 1, 4, 5), (9, 1, 4, 5), (9, 2, 0, 1), (17, 1, 2, 5),
                                    (30, 1, 0, 1), (31, 1, 0, 1), (3, 1, 1, 2)]:
        tokens = list(range(100, 100 + start + num_new))
        ctx = _ctx(tokens, [], start)
        table = ctx.kv["t"]
        cache.reserve(table, start + num_new + look)
        table.blocks.reverse()  # (any order of blocks)
        twin = _ctx(tokens, table.blocks, start)
        packed = one.pack(ctx, num_new, lookahead=look, return_n_logits=n, slot=3)
        ref = proc.prepare_initial_token_inputs([[twin]], n, num_tokens=[num_new], lookahead=look)
        got = packed.inputs
        for f in FIELDS:
            a, e = getattr(got, f), getattr(ref.inputs, f)
            assert a.shape == e.shape and a.dtype == e.dtype and a.equal(e), (start, f, a, e)
        assert (got.mask, got.single_request) == (ref.inputs.mask, ref.inputs.single_request)
        # A mask the buffers hand over is the one attention builds from q_pos, over the same slots.
        assert (got.key_mask is not None) == (got.mask == MaskKind.EXPLICIT)
        if got.key_mask is not None:
            own = PagedAttend(got, cache.tensors, None)
            built = PagedAttend(dataclasses.replace(got, key_mask=None), cache.tensors, None)
            assert own.mask.shape == built.mask.shape and own.mask.equal(built.mask), (start, own.mask, built.mask)
            assert own.slots.equal(built.slots)
        assert (ref.draft_index is None) == (packed.draft_index is None)
        if ref.draft_index is not None:
            assert packed.draft_index.equal(ref.draft_index)
        assert table.num_tokens == twin.kv["t"].num_tokens == start + num_new + look
        assert packed.state_slots.tolist() == [3]
        assert np.array_equal(one.slots_at(np.arange(start)), ref.inputs.gather_slots[0, :start].numpy())
        cache.free(table)


def test_step_buffers_serve_eager_cpu_runs_only() -> None:
    """A plain decode step takes the reused buffers on one eager CPU replica, and leaves a
    compiled run's step to the general packing (as the speculative steps do)."""
    def processor(compiled: bool) -> DecoderBatchProcessor:
        return DecoderBatchProcessor(None, BatchProcessorRuntime(kv_caches=[_cache()], max_batch_size=1,
                                                                 max_seq_len=16, compiled=compiled))

    for compiled in (False, True):
        p = processor(compiled)
        ctx = _ctx([5, 6, 7], [], 2)
        p.runtime.kv_caches[0].reserve(ctx.kv["t"], 3)
        got = p.pack_decode(ctx)
        assert (got is None) == compiled
        assert ctx.kv["t"].num_tokens == (2 if compiled else 3)
