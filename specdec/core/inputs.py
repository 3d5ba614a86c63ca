"""What a decoder module takes and returns: tensors only, in dataclasses.

A batch is *ragged and packed*: the new tokens of every request stand one
after another in ``tokens`` (no padding). Attention reads each request's whole
context from the paged KV cache through per-request slot lists. The index
tensors below are built once per step on the host by the batch processor.

Worked example (block size 4, two requests)::

    request a: 3 tokens cached, 1 new token (a decode step)
    request b: 0 tokens cached, 2 new tokens (a prefill)

    tokens        = [a3, b0, b1]                     # [T=3]
    positions     = [3, 0, 1]                        # [T]
    slot_mapping  = [a's slot 3, b's slot 0, b's slot 1]
    gather_slots  = [[a0, a1, a2, a3],               # [B=2, S=4]
                     [b0, b1, b2, b3]]               # padding: b's block, masked
    q_index       = [[0, 0], [1, 2]]                 # [B, Q=2] packed row of each query
    q_pos         = [[3, 0], [0, 1]]                 # [B, Q] its position (pad: 0)
    out_index     = [0, 2, 3]                        # [T] row in the flat [B*Q] output
    logit_index   = [0, 2]                           # [N] rows whose logits come back

A key ``j`` is visible to a query at position ``p`` iff ``j <= p``, so padded
keys (``j >= context length``) are never seen, and padded queries (``p = 0``)
see key 0 only and are dropped by ``out_index``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace
from enum import IntEnum
from collections.abc import Callable
from typing import TypeVar

import torch


@dataclass
class KVCacheTensors:
    """The paged cache storage of one decoder (one replica)."""

    k: torch.Tensor  # [layers, num_slots, kv_heads, head_dim]
    v: torch.Tensor  # [layers, num_slots, kv_heads, head_dim]


class MaskKind(IntEnum):
    """Which attention mask a batch needs (key ``j`` is visible at position ``p`` iff ``j <= p``)."""

    NONE = 0  # one request, one query, keys exactly its context: it sees them all
    # Every request fed from position 0 (prompts with nothing cached): query i of a request
    # sees its keys 0 … i, plain causal (keys past its context are read from its first slot).
    CAUSAL = 1
    EXPLICIT = 2  # anything else: the mask is built from ``q_pos``


@dataclass
class DecoderInputs:
    """One packed ragged batch for a decoder's ``forward``."""

    tokens: torch.Tensor  # [T] int64, the new tokens of every request, packed
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64, KV slot each new token writes
    gather_slots: torch.Tensor  # [B, S] int64, KV slots each request reads (padding masked)
    q_index: torch.Tensor  # [B, Q] int64, packed row of each padded query
    q_pos: torch.Tensor  # [B, Q] int64, position of each padded query (pad 0)
    out_index: torch.Tensor  # [T] int64, row of each token in the flat [B*Q] output
    logit_index: torch.Tensor  # [N] int64, packed rows whose logits are returned
    kv_cache: KVCacheTensors | None = None
    context_lengths: torch.Tensor | None = None  # [B] each request's length after this step
    # Host facts about the batch's shape, decided by the packer so the model
    # never branches on tensor sizes (a compiled model would guard on them):
    single_request: bool = False  # B == 1: the queries are the packed rows as they are
    mask: MaskKind = MaskKind.EXPLICIT
    # A compiled forward hides each row's non-finite new keys from the rows before it
    # (``PagedAttend``; 3-6% of a compiled CPU verification forward). False: it need not,
    # because its caller runs it again with True when any row it reads went non-finite
    # (a compiled CPU verification: ``DraftAndVerify``). An eager CPU forward decides
    # that itself (``LlamaDecoder.forward``).
    isolate_rows: bool = True
    # Layers whose *input* hidden states come back (``aux_hidden_states``) at
    # the logit rows: what a target-conditioned drafter reads (EAGLE-3 reads
    # three). Empty: none, and no cost.
    capture_layers: tuple[int, ...] = ()
    # Token-tree step (specdec/spec/tree.py): [B, Q, Q] bool, query i of request b
    # sees the request's new row j (its j-th query) iff tree_mask[b, i, j]; keys
    # before the request's first new row (its cached context) are seen by all.
    # Replaces the position-based mask (forces MaskKind.EXPLICIT's path), and then
    # ``positions`` (rope) may differ from the key index: a node sits at
    # root position + depth, while ``q_pos`` keeps each query's *key index*
    # (where its row was written in ``gather_slots``). Build it with
    # ``tree_attention_mask``: a chain's mask is the lower triangle.
    tree_mask: torch.Tensor | None = None
    # True: the final-norm hidden state (and captured layer inputs) of *every*
    # packed row comes back too (``DecoderOutputs.row_hidden_states``): an
    # EAGLE head catches up on all the rows the target was fed.
    all_hidden: bool = False
    # [B, 1, Q, S] bool, the position-based mask (key j visible at query q iff
    # j <= q_pos[b, q]) where the packer has it at hand, and with it the host fact that
    # every gathered key lies in its request's context (none read in place of padding):
    # a one-request step's view of a reused triangle (``StepBuffers``). None: built
    # from ``q_pos``. Read only for MaskKind.EXPLICIT, without a window or tree mask.
    key_mask: torch.Tensor | None = None
    # Where each data-parallel replica's requests start: [R + 1], host ints.
    data_parallel_splits: list[int] = field(default_factory=lambda: [0])
    # A batch whose requests feed very different row counts (a prompt beside
    # decoding requests) attends in groups: consecutive runs of requests, each
    # packed as its own batch over the same rows (rows re-based to the group's
    # first), so no request is padded to another group's ``Q`` and ``S``.
    # The packer decides (``_pack``); None: one group, the fields above.
    # Whoever changes a step's rows, slots or mask afterwards (a tree step, a
    # drafter's own cache) sets it to None.
    attention_groups: list[DecoderInputs] | None = None


D = TypeVar("D")


def map_tensors(obj: D, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> D:
    """``obj`` (a tensor, a dataclass, a list, or anything else, kept) with each tensor ``t``
    in it, nested dataclasses and lists included, replaced by ``fn(t)`` (kept where that is
    None or ``t``); a copy where anything changed, ``obj`` itself where nothing did. A KV
    cache's tensors are left alone (the cache stays where it is)."""
    if isinstance(obj, torch.Tensor):
        new = fn(obj)
        return obj if new is None else new  # type: ignore[return-value]
    if isinstance(obj, list):
        items = [map_tensors(x, fn) for x in obj]
        return items if any(a is not b for a, b in zip(items, obj)) else obj  # type: ignore[return-value]
    if is_dataclass(obj) and not isinstance(obj, (type, KVCacheTensors)):
        changes = {}
        for f in fields(obj):
            v = getattr(obj, f.name)
            nv = map_tensors(v, fn)
            if nv is not v:
                changes[f.name] = nv
        return replace(obj, **changes) if changes else obj  # type: ignore[type-var]
    return obj


def move_tensors(obj: D, device: torch.device | str) -> D:
    """A copy of host-built dataclass ``obj`` with its tensors (and those of nested
    dataclasses and lists: :func:`map_tensors`) on ``device``; ``obj`` itself when nothing
    moves. The packers build a step's index tensors on the host; this puts them where
    the model is. For a CPU model it returns at once (nothing to move)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return obj
    return map_tensors(obj, lambda t: None if t.device == dev else t.to(dev, non_blocking=True))


@dataclass
class DecoderOutputs:
    """What a decoder's ``forward`` returns."""

    logits: torch.Tensor  # [N, vocab] float, rows picked by logit_index
    hidden_states: torch.Tensor  # [N, hidden] final-norm hidden states of those rows
    aux_hidden_states: torch.Tensor | None = None  # [N, len(capture_layers) * hidden], in capture order
    # With ``DecoderInputs.all_hidden``: the same for every packed row.
    row_hidden_states: torch.Tensor | None = None  # [T, hidden]
    row_aux_hidden_states: torch.Tensor | None = None  # [T, len(capture_layers) * hidden]


@dataclass
class ModelOutputs:
    """A step's outputs after ``process_outputs``: per-request views."""

    logits: torch.Tensor  # [N, vocab]
    hidden_states: torch.Tensor | None  # [N, hidden]
    # Row range of each request in ``logits``: request i owns rows
    # logit_offsets[i]:logit_offsets[i+1].  [B + 1]
    logit_offsets: torch.Tensor
