"""EAGLE-1 and EAGLE-3 drafting: a head over the target's features, after verification.

Each step, inside the draft-and-verify module and after the target verified:

1. **catch-up**: the head runs over every row the target was fed this step
   (a prompt, prefill chunks, a request's last token and drafts), each row
   ``t`` as the pair (target feature at ``t``, the token at ``t + 1``). The
   token after a request's bonus row is its bonus token; rows past it held
   rejected drafts and only leave KV entries that later steps overwrite
   (no row reads a key past its own position). Its output at the bonus row
   gives the first draft.
2. **draft steps**: γ - 1 one-token steps, each feeding back the head's own
   state with the token just drafted, at positions bonus + 1, bonus + 2, …

The drafts (and their distribution, when sampling) wait in the shared state
store for the next step. The head's paged KV cache (one layer) is rolled back
in step with the target's: it holds one entry per committed token but the
last, like the target's. Host work per step is one small packing
(:meth:`EagleProposer.prepare_after`): slots of every fed row and of the
positions the draft steps may write; which ones they write depends on how
many drafts were accepted, so the device picks them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import List, Optional

import numpy as np
import torch

from specdec.core.batch_processor import PackedBatch
from specdec.core.checkpoint import load_decoder
from specdec.core.context import TextContext
from specdec.core.inputs import DecoderInputs, KVCacheTensors, MaskKind
from specdec.core.kv_cache import BlockTable, KVCacheParams, PagedKVCache, block_table_array
from specdec.core.pipeline_model import compile_decoder
from specdec.core.registry import Role
from specdec.models.eagle import EagleHead, check_head_fits
from specdec.sampling import LANE_DRAFT, SamplingTensors, greedy_tokens, probs_from_logits, sample_from
from specdec.spec.proposers.base import (
    Drafter,
    DraftTree,
    Proposer,
    ProposerConfig,
    ProposerDeps,
    TargetStep,
    register_proposer,
)


@dataclass(frozen=True)
class EagleConfig(ProposerConfig):
    path: str = ""  # the head's checkpoint directory (published EAGLE-1 layout)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.path:
            raise ValueError("path (the EAGLE head's checkpoint directory) is required")


@dataclass(frozen=True)
class Eagle3Config(EagleConfig):
    # Target layers whose inputs are fused; None: the head's eagle_config, else (2, L//2, L-3).
    aux_layers: Optional[List[int]] = None  # noqa: UP006,UP007 (OmegaConf reads typing generics)


@dataclass
class EagleStepInputs:
    """Host packing of one step for the head (shapes for B fed requests, T packed rows)."""

    kv: KVCacheTensors  # the head's cache
    slot_mapping: torch.Tensor  # [T] head slot of each packed row's position
    gather_slots: torch.Tensor  # [B, S] head slot of every position a request may touch this step
    catch_keys: int  # host: keys the catch-up reads (the target's gather width)
    fix_rows: torch.Tensor | None  # [C] last packed row of each non-final prefill chunk
    fix_tokens: torch.Tensor | None  # [C] the prompt token after it
    rows: torch.Tensor  # [B] 0..B-1 (the one-token steps' index tensors)
    q_index: torch.Tensor  # [B, 1]


class EagleDrafter(Drafter):
    """Device half: the head as a submodule (target embedding / lm_head borrowed)."""

    def __init__(self, head: EagleHead) -> None:
        super().__init__()
        self.head = head

    def _pick(self, logits: torch.Tensor, sampling: SamplingTensors, pos: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if sampling.all_greedy:
            return greedy_tokens(logits), None
        p = probs_from_logits(logits.unsqueeze(1), sampling).squeeze(1)  # [B, V]
        return sample_from(p, sampling.seeds, pos, LANE_DRAFT), p

    def draft_after(self, step: TargetStep, gamma: int, sampling: SamplingTensors) -> DraftTree:
        host: EagleStepInputs = step.host
        inp, bonus_row = step.inputs, step.bonus_row
        assert inp is not None and bonus_row is not None and step.rows is not None
        b = bonus_row.shape[0]
        # (1) catch-up: row t pairs the target's feature at t with the token at t + 1.
        bonus = step.tokens.gather(1, step.num_accepted.unsqueeze(1)).squeeze(1)  # [B]
        nxt = torch.roll(inp.tokens, -1).index_put((bonus_row,), bonus)  # [T]
        if host.fix_rows is not None:
            nxt = nxt.index_put((host.fix_rows,), host.fix_tokens)
        catch = replace(inp, tokens=nxt, slot_mapping=host.slot_mapping,
                        gather_slots=host.gather_slots[:, : host.catch_keys].contiguous(),
                        logit_index=bonus_row, kv_cache=host.kv, capture_layers=(), all_hidden=False)
        h, logits = self.head(catch, self.head.project(step.rows, step.aux_rows))  # [B, H], [B, V]
        pos0 = inp.positions.index_select(0, bonus_row)  # [B] position of each bonus row
        toks, probs = [], []
        for j in range(gamma):
            t, p = self._pick(logits, sampling, pos0 + 2 + j)  # draft j takes position pos0 + 2 + j
            toks.append(t)
            if p is not None:
                probs.append(p)
            if j + 1 < gamma:
                # (2) the pair (own state, draft j) at position pos0 + 1 + j; keys
                # through the bound any request may reach, masked past its own.
                pos = pos0 + 1 + j
                n_keys = host.catch_keys + j + 1
                one = DecoderInputs(
                    tokens=t, positions=pos,
                    slot_mapping=host.gather_slots.gather(1, pos.unsqueeze(1)).squeeze(1),
                    gather_slots=host.gather_slots[:, :n_keys].contiguous(),
                    q_index=host.q_index, q_pos=pos.unsqueeze(1), out_index=host.rows, logit_index=host.rows,
                    kv_cache=host.kv, single_request=b == 1, mask=MaskKind.EXPLICIT,
                )
                h, logits = self.head(one, h)
        return DraftTree.chain(torch.stack(toks, 1), torch.stack(probs, 1) if probs else None)


@register_proposer("eagle", EagleConfig)
class EagleProposer(Proposer):
    """Host half: loads the head, keeps its paged KV cache in step with the target's."""

    drafts_after_verify = True
    samples_drafts = True
    needs_all_rows = True
    kind = "eagle"

    def __init__(self, config: EagleConfig, deps: ProposerDeps) -> None:
        self.config = config
        target, rt = deps.target, deps.runtime
        tcfg = target.config
        dtype = getattr(torch, rt.dtype) if rt.dtype else None
        loaded = load_decoder(config.path, role=Role.DRAFT_HEAD, dtype=dtype, device=rt.device,
                              check=lambda c: check_head_fits(c, tcfg, repr(config.path)))
        head: EagleHead = loaded.module  # type: ignore[assignment]
        if head.config.kind != self.kind:
            raise ValueError(f"{config.path!r} holds an {head.config.kind!r} head; method {self.name!r} "
                             f"needs an {self.kind!r} head (use method={head.config.kind})")
        aux = getattr(config, "aux_layers", None)
        layers = tuple(aux) if aux is not None else head.config.fused_layers(tcfg.num_hidden_layers)
        if self.kind == "eagle3":
            bad = [i for i in layers if not 0 <= i < tcfg.num_hidden_layers]
            if len(layers) != 3 or bad:
                raise ValueError(f"method.eagle3.aux_layers={list(layers)}: need three layers of the target "
                                 f"(0..{tcfg.num_hidden_layers - 1})")
        self.target_layers = layers
        built = target.build_module()  # the target module the step calls: borrow its embedding and head
        head.attach_target(built.model.embed_tokens, built.lm_head)
        head.prepare_for_inference()
        self.max_positions = rt.max_seq_len + 2 * config.num_speculative_tokens + 2
        head.ensure_rope(self.max_positions, rt.device)
        if rt.compile:
            compile_decoder(head)
        self.head = head
        g = config.num_speculative_tokens
        # Room for everything the target holds plus each request's 2γ+1 lookahead.
        per_req = -(-(2 * g + 1) // rt.block_size)
        blocks = target.num_blocks + rt.max_batch_size * per_req
        lc = head.config.layer
        self.cache = PagedKVCache(KVCacheParams(num_layers=1, num_kv_heads=lc.num_key_value_heads,
                                                head_dim=lc.head_dim, block_size=rt.block_size,
                                                num_blocks=blocks, dtype=next(head.parameters()).dtype,
                                                device=rt.device), "eagle")
        self.device = torch.device(rt.device)
        self.target_cache = target.cache_name
        self.drafter = EagleDrafter(head)
        self._index: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- KV bookkeeping ----------------------------------------------------------------
    def _table(self, ctx: TextContext) -> BlockTable:
        table = ctx.kv.get(self.cache.name)
        if table is None:
            table = ctx.kv[self.cache.name] = BlockTable()
        return table

    def kv_tokens(self, num_tokens: int, gamma: int) -> int:
        return num_tokens + 2 * gamma + 1  # rows fed (≤ tokens + γ) and γ - 1 draft steps past them

    def reserve(self, ctx: TextContext, gamma: int) -> None:
        self.cache.reserve(self._table(ctx), self.kv_tokens(len(ctx.tokens), gamma))

    def commit(self, ctx: TextContext, num_committed: int) -> None:
        table = self._table(ctx)
        if table.num_tokens > num_committed - 1:  # like the target: every committed token but the last
            self.cache.truncate(table, num_committed - 1)

    def free(self, ctx: TextContext) -> None:
        table = ctx.kv.pop(self.cache.name, None)
        if table is not None:
            self.cache.free(table)

    # -- host packing --------------------------------------------------------------------
    def prepare_after(self, batch: list[TextContext], packed: PackedBatch, gamma: int) -> EagleStepInputs:
        ln = np.asarray([n + a for n, a in zip(packed.num_new, packed.lookahead)], dtype=np.int64)  # [B] rows fed
        tables = [self._table(c) for c in batch]
        # Row 0 of request r sits where the target's cache ended before this step
        # (the head holds the same positions: commit keeps them in step).
        starts = np.asarray([c.kv[self.target_cache].num_tokens for c in batch], dtype=np.int64) - ln
        ctx_len = starts + ln  # [B]
        bs = self.cache.block_size
        tbl = block_table_array([t.blocks for t in tables])  # [B, max_blocks]
        width = int(ctx_len.max()) + max(gamma, 1)  # catch-up keys, then up to γ - 1 draft positions
        p = np.arange(width)
        gather = tbl[:, np.minimum(p // bs, tbl.shape[1] - 1)] * bs + p % bs  # [B, S]
        req = np.repeat(np.arange(len(batch)), ln)
        positions = starts[req] + (np.arange(int(ln.sum())) - np.repeat(np.cumsum(ln) - ln, ln))
        slot_mapping = gather[req, positions]  # [T]
        for t, n in zip(tables, ctx_len):
            t.num_tokens = int(n)  # rows past a request's bonus row are dropped by commit
        # A prefill chunk that stops short of its prompt's end: its last row pairs with the next prompt token.
        fix_rows, fix_tokens = [], []
        end = np.cumsum(ln)
        for i, (c, s, n) in enumerate(zip(batch, starts, packed.num_new)):
            if s + n < len(c.tokens) and not packed.lookahead[i]:
                fix_rows.append(int(end[i]) - 1)
                fix_tokens.append(c.tokens[s + n])
        b = len(batch)
        rows, q_index = self._index.get(b) or self._index.setdefault(
            b, (torch.arange(b, device=self.device), torch.arange(b, device=self.device).unsqueeze(1)))
        dev = self.device
        return EagleStepInputs(
            kv=self.cache.tensors,
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            gather_slots=torch.from_numpy(np.ascontiguousarray(gather)).to(dev),
            catch_keys=int(packed.inputs.gather_slots.shape[1]),
            fix_rows=torch.tensor(fix_rows, dtype=torch.long, device=dev) if fix_rows else None,
            fix_tokens=torch.tensor(fix_tokens, dtype=torch.long, device=dev) if fix_rows else None,
            rows=rows, q_index=q_index,
        )

    # -- cost ------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft_forward_time(self, ctx_len: int, repeats: int = 10) -> float:
        """A bare one-token draft step of the head at context ``ctx_len`` (median)."""
        table = BlockTable()
        self.cache.reserve(table, ctx_len)
        try:
            bs = self.cache.block_size
            p = torch.arange(ctx_len)
            blocks = torch.tensor(table.blocks)
            gather = (blocks[p // bs] * bs + p % bs).unsqueeze(0).to(self.device)  # [1, S]
            pos = torch.tensor([ctx_len - 1], device=self.device)
            one = torch.zeros(1, dtype=torch.long, device=self.device)
            inp = DecoderInputs(tokens=one, positions=pos, slot_mapping=gather[:, -1], gather_slots=gather,
                                q_index=one.unsqueeze(1), q_pos=pos.unsqueeze(1), out_index=one, logit_index=one,
                                kv_cache=self.cache.tensors, single_request=True, mask=MaskKind.EXPLICIT)
            feat = torch.zeros(1, self.head.config.hidden_size, device=self.device,
                               dtype=next(self.head.parameters()).dtype)
            for _ in range(3):
                self.head(inp, feat)
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                self.head(inp, feat)
                times.append(time.perf_counter() - t)
            return statistics.median(times)
        finally:
            self.cache.free(table)

    def draft_cost(self, batch_size: int, context_len: int) -> float:
        return self.draft_forward_time(max(context_len, 1), repeats=7)


@register_proposer("eagle3", Eagle3Config)
class Eagle3Proposer(EagleProposer):
    """EAGLE-3: the same drafting, a head that fuses three target layers."""

    kind = "eagle3"
