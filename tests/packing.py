"""Test helper: a packed decoder batch from raw rows, through the public batch processor."""

from __future__ import annotations

from specdec.core.batch_processor import BatchProcessorRuntime, DecoderBatchProcessor
from specdec.core.context import SamplingParams, TextContext
from specdec.core.inputs import DecoderInputs
from specdec.core.kv_cache import BlockTable, KVCacheParams, PagedKVCache


def pack_rows(tokens: list[int], starts: list[int], lens: list[int], tables: list[list[int]],
              block_size: int) -> DecoderInputs:
    """The inputs of one step that feeds request ``i`` ``lens[i]`` tokens (taken in order
    from ``tokens``) after ``starts[i]`` cached ones, in the blocks ``tables[i]``; one logit
    row each. The caller sets ``kv_cache`` (its own tensors); the tables must already hold
    every row, so the packed slots are exactly theirs."""
    cache = PagedKVCache(KVCacheParams(num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_size, num_blocks=1))
    ctxs, at = [], 0
    for s, n, table in zip(starts, lens, tables):
        if -(-(s + n) // block_size) > len(table):
            raise ValueError(f"table {table} cannot hold {s + n} tokens of {block_size} a block")
        ctx = TextContext(request_id=f"r{len(ctxs)}", tokens=[0] * s + tokens[at : at + n], prompt_len=s + n,
                          sampling=SamplingParams())
        ctx.kv[cache.name] = BlockTable(blocks=list(table), num_tokens=s)
        ctxs.append(ctx)
        at += n
    if at != len(tokens):
        raise ValueError(f"lens {lens} feed {at} tokens, got {len(tokens)}")
    rt = BatchProcessorRuntime(kv_caches=[cache], max_batch_size=len(ctxs), max_seq_len=max(starts) + max(lens))
    return DecoderBatchProcessor(None, rt).prepare_initial_token_inputs([ctxs]).inputs
