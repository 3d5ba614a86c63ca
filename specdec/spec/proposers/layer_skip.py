"""Layer-skip self-speculation (LayerSkip, Draft & Verify, SWIFT): the target drafts for itself.

The draft is the target's own first ``k`` layers followed by its final norm and
``lm_head`` (``LlamaDecoder.first_layers``): the very same modules, so the same
weights, fused and packed projections and kernels, and no memory for weights of
its own. It runs through the target's backend (on a float32 CPU the native
backend: its forward is one C++ call over those ``k`` layers; one request's
greedy chain steps in one more, ``Backend.draft_chain``). No checkpoint and no
training: any target with at least two layers has it.

Drafting is the draft model's (``draft_model.py``: catch up on the unseen tokens,
then ``γ - 1`` one-token steps, verified losslessly; sampled drafts carry their
q), and so are its costs (a ``DrafterSpec.model``: the truncated decoder's bare
forwards).

**KV** (``shared_kv``, default true): layers ``0..k-1`` of the target's cache *are*
the draft's. Layer ``i``'s keys depend on layers ``< i`` only, so what the target
wrote for its committed tokens is exactly what the draft would; the draft's
catch-up is only the tokens the target has not read yet (one, after a decode
step), written at the target's slots, and its steps write the drafts' slots. The
target's verification forward writes every slot of its rows (the same tokens) in
each layer before it attends, so it never reads a value the draft wrote, and
rejected drafts need no rollback: no cache, blocks or bookkeeping of its own.
A padded draft step past the blocks a request holds in the target's cache (its
γ smaller than the step's) writes the request's own last reserved slot, which
nothing reads before the target writes it. ``shared_kv=false``: a cache of its
own (``k`` layers, sized like the target's), kept in step as a draft model's.

``num_layers`` (``k``): ``1 <= k <`` the target's layers; unset, half of them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from specdec.core.backend import load_backend
from specdec.core.batch_processor import BatchProcessorRuntime, DecoderBatchProcessor
from specdec.core.context import TextContext
from specdec.core.inputs import DecoderInputs, KVCacheTensors
from specdec.core.kv_cache import BlockTable, KVCacheParams, PagedKVCache
from specdec.core.pipeline_model import DecoderPipelineModel, RuntimeConfig
from specdec.spec.proposers.base import ProposerConfig, ProposerDeps, register_proposer
from specdec.spec.proposers.draft_model import DraftModelBatch, DraftModelDrafter, DraftModelProposer
from specdec.spec.tree import check_bool, check_int


@dataclass(frozen=True)
class LayerSkipConfig(ProposerConfig):
    """``num_layers``: the target layers the draft runs (``k``, its first ones); None: half
    the target's (at least 1), checked against the target when the proposer is built.
    ``shared_kv``: the draft reads and writes layers ``0..k-1`` of the target's KV cache
    (module doc); false: a cache of its own."""

    num_layers: Optional[int] = None  # noqa: UP045 (OmegaConf reads typing generics)
    shared_kv: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_layers is not None:
            check_int(self.key("num_layers"), self.num_layers, 1)
        check_bool(self.key("shared_kv"), self.shared_kv)

    def layers_for(self, target_layers: int, target: str = "the target") -> int:
        """``k`` for a target of ``target_layers`` layers; ``ValueError`` naming the key when
        it leaves no layer to skip."""
        if target_layers < 2:
            raise ValueError(f"{self.key('num_layers')}: {target} has {target_layers} layer; layer-skip "
                             "drafting needs a target of at least 2 layers")
        k = max(target_layers // 2, 1) if self.num_layers is None else self.num_layers
        if not 1 <= k < target_layers:
            raise ValueError(f"{self.key('num_layers')} must be in [1, {target_layers - 1}] ({target} has "
                             f"{target_layers} layers; the draft runs the first num_layers of them), got {k}")
        return k


class SharedWeightsPipelineModel(DecoderPipelineModel):
    """A pipeline model over a module built from an already prepared one's modules
    (``first_layers``): nothing to fuse or pack again (that would copy the weights), only
    its rope tables and backend to set; it is its own built module."""

    def _prepare(self, module: nn.Module) -> None:
        module.ensure_rope(self._max_positions, self.runtime.device)
        load_backend(module, compile=self.runtime.compile)


def layer_skip_pipeline(target: DecoderPipelineModel, k: int, runtime: RuntimeConfig, *, extra_tokens: int,
                        shared_kv: bool, cache_name: str = "draft") -> SharedWeightsPipelineModel:
    """The target's first ``k`` layers (its final norm and head after them, its weights) as a
    draft pipeline model. ``shared_kv``: its caches are the target's (tensors and
    allocator: timing's throwaway requests take the target's free blocks) under
    ``cache_name``; else caches of ``k`` layers of its own, as many blocks as the target's."""
    module = target.build_module().first_layers(k)  # (the target's module the step calls)
    if shared_kv:
        caches = []
        for c in target.caches:  # (the same allocator; layers 0..k-1 of the same storage)
            caches.append(copy.copy(c))
            caches[-1].name = cache_name
            caches[-1].tensors = KVCacheTensors(k=c.tensors.k[:k], v=c.tensors.v[:k])
    else:
        p = target.caches[0].params
        caches = [PagedKVCache(KVCacheParams(num_layers=k, num_kv_heads=p.num_kv_heads, head_dim=p.head_dim,
                                             block_size=runtime.block_size, num_blocks=runtime.blocks(extra_tokens),
                                             dtype=p.dtype, device=runtime.device), cache_name)
                  for _ in target.caches]
    rt = BatchProcessorRuntime(kv_caches=caches, max_batch_size=runtime.max_batch_size,
                               max_seq_len=runtime.max_seq_len + extra_tokens, device=runtime.device)
    # Replicas share the one module (stateless between steps); each has its own cache.
    return SharedWeightsPipelineModel([module] * len(caches), module.config, DecoderBatchProcessor(module.config, rt),
                                      runtime, path=target.path, max_seq_len=runtime.max_seq_len + extra_tokens)


@register_proposer("layer_skip", LayerSkipConfig)
class LayerSkipProposer(DraftModelProposer):
    """Host half: a draft model's (chains), its decoder the target's first ``k`` layers; with
    ``shared_kv``, over the target's cache (module doc)."""

    def __init__(self, config: LayerSkipConfig, deps: ProposerDeps) -> None:
        self.config = config  # type: ignore[assignment]
        self.tree = None
        self.target = deps.target
        if not callable(getattr(deps.target.build_module(), "first_layers", None)):
            raise ValueError(f"method layer_skip: the target {type(deps.target.module).__name__} at "
                             f"{deps.target.path} has no first_layers(k) to draft with")
        self.num_layers = config.layers_for(deps.target.config.num_hidden_layers, f"the target at {deps.target.path}")
        self.shared_kv = config.shared_kv
        self.pipeline = layer_skip_pipeline(deps.target, self.num_layers, deps.runtime,
                                            extra_tokens=config.num_speculative_tokens + 1, shared_kv=config.shared_kv)
        self._tree_base: dict[int, int] = {}
        self._compiled: set[bool] = set()
        self.drafter = DraftModelDrafter(self.pipeline, None, config.num_speculative_tokens)
        self._one = self._step_buffers()  # (its draft slots always in the blocks held: _pack_chain's fix a no-op)

    # -- shared KV: the target's tables, under the draft's cache name for one step -------------
    def prepare(self, batch: list[TextContext], gamma: int, num_draft: list[int]) -> DraftModelBatch:
        if self.shared_kv:
            for c in batch:  # the target's blocks (the same list); the catch-up: what it has not read
                t = c.kv[self.target.cache_name]
                c.kv[self.cache_name] = BlockTable(blocks=t.blocks, num_tokens=t.num_tokens)
        return super().prepare(batch, gamma, num_draft)

    def _pack_chain(self, batch: list[TextContext], catch_up: DecoderInputs, gamma: int,
                    num_draft: list[int]) -> DraftModelBatch:
        out = super()._pack_chain(batch, catch_up, gamma, num_draft)
        if self.shared_kv and gamma > 1:
            # Past the blocks a request holds (a padded step: its γ below the step's), its own
            # last reserved slot, not another request's block (module doc).
            bs = self.pipeline.block_size
            cap = torch.tensor([len(c.kv[self.cache_name].blocks) * bs for c in batch], device=out.gather_slots.device)
            last = out.gather_slots.gather(1, (cap - 1).clamp(max=out.gather_slots.shape[1] - 1).unsqueeze(1))  # [B, 1]
            pos = torch.arange(out.gather_slots.shape[1], device=cap.device)
            out.gather_slots = torch.where(pos < cap.unsqueeze(1), out.gather_slots, last)
            out.step_slots = torch.where(out.step_positions < cap, out.step_slots, last.squeeze(1))
        return out

    def reserve(self, ctx: TextContext, gamma: int) -> None:
        if not self.shared_kv:
            super().reserve(ctx, gamma)

    def kv_tokens(self, num_tokens: int, gamma: int) -> int:
        return 0 if self.shared_kv else super().kv_tokens(num_tokens, gamma)

    def unseen_tokens(self, ctx: TextContext) -> int:
        if self.shared_kv:  # the catch-up: the tokens the target has not read yet
            return len(ctx.tokens) - ctx.processed(self.target.cache_name)
        return super().unseen_tokens(ctx)

    def commit(self, ctx: TextContext, num_committed: int) -> None:
        if self.shared_kv:  # (never the cache's truncate or free: the blocks are the target's)
            ctx.kv.pop(self.cache_name, None)
        else:
            super().commit(ctx, num_committed)

    def free(self, ctx: TextContext) -> None:
        if self.shared_kv:
            ctx.kv.pop(self.cache_name, None)
        else:
            super().free(ctx)
