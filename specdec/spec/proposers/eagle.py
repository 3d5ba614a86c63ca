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
store for the next step.

**Token trees** (``tree=TreeConfig(kind=dynamic|static)``, specdec/spec/tree.py;
γ is then the node budget): after the catch-up, the head drafts a top-k tree
instead of γ - 1 steps — ``dynamic`` (EAGLE-2: ``depth - 1`` frontier
expansions of ``top_k`` nodes by cumulative log-probability, the best γ
nodes kept) or ``static`` (the ``choices`` paths, one forward per level).
Each frontier node runs as its own one-token row fed (its parent's ``h``,
its token) at position bonus + depth, whose keys are the request's committed
head keys, then its ancestors' rows, then its own (key index == position),
written to per-request scratch slots past everything the step fed. Under
``runtime.compile`` a tree of the method's whole budget drafts all its levels
(head forwards, expansion, selection) as one compiled graph, as a chain of the
method's γ runs its steps (:meth:`EagleDrafter._tree_drafts`). The tree
waits in the store (tokens, parents, node count: deterministic, no q). The
next step verifies it in one target forward; the catch-up then runs over
the root and *all* tree rows with the target's ``tree_mask`` and rope
positions, the token after each row of the accepted path being the next
path token (the bonus after the last), and the head's KV entries of the
accepted path are compacted into place exactly as the target's were. The head's paged KV cache (one layer) is rolled back
in step with the target's: it holds one entry per committed token but the
last, like the target's. Host work per step is one small packing
(:meth:`EagleProposer.prepare_after`): slots of every fed row and of the
positions the draft steps may write; which ones they write depends on how
many drafts were accepted, so the device picks them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, List, Optional

import numpy as np
import torch

from specdec.core.backend import backend_of, load_backend
from specdec.core.batch_processor import PackedBatch, StepBuffers, step_buffers_serve
from specdec.core.checkpoint import CheckpointError, load_decoder
from specdec.core.context import TextContext
from specdec.core.inputs import DecoderInputs, KVCacheTensors, MaskKind
from specdec.core.kv_cache import BlockTable, KVCacheParams, PagedKVCache, block_table_array
from specdec.core.pipeline_model import compile_method, pack_for_runtime
from specdec.core.registry import Role
from specdec.models.eagle import EagleHead, check_head_fits
from specdec.sampling import SamplingTensors, draw_drafts
from specdec.spec.forward_time import time_calls
from specdec.spec.tree import (
    StaticShape,
    StaticShapes,
    TreeConfig,
    accepted_slot_moves,
    check_tree_fits,
    compact_kv,
    draft_dynamic_tree,
    draft_static_tree,
    native_tree_serves,
    node_rows,
    short_repr,
    static_tree_shape,
)
from specdec.spec.proposers.base import (
    CheckpointProposerConfig,
    Drafter,
    DrafterSpec,
    DraftTree,
    Proposer,
    ProposerDeps,
    TargetStep,
    register_proposer,
)


@dataclass(frozen=True)
class EagleConfig(CheckpointProposerConfig):
    """``path``: the head (published EAGLE-1 layout); ``tree``: chain, or a static /
    dynamic top-k tree (CheckpointProposerConfig)."""

    path_is: ClassVar[str] = "the EAGLE head's checkpoint directory"


@dataclass(frozen=True)
class Eagle3Config(EagleConfig):
    # Target layers whose inputs are fused; None: the head's eagle_config, else (2, L//2, L-3).
    aux_layers: Optional[List[int]] = None  # noqa: UP006,UP007 (OmegaConf reads typing generics)

    def __post_init__(self) -> None:
        super().__post_init__()
        a = self.aux_layers
        if a is not None:  # (the target's layer count is checked at build)
            if isinstance(a, (str, bytes)) or not isinstance(a, Sequence) or len(a) != 3 or any(
                    isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in a):
                raise ValueError(f"{self.key('aux_layers')} must be three target layer ids (integers >= 0), "
                                 f"got {short_repr(a)}")
            object.__setattr__(self, "aux_layers", [int(i) for i in a])


@dataclass
class EagleStepInputs:
    """Host packing of one step for the head (shapes for B fed requests, T packed rows)."""

    kv: KVCacheTensors  # the head's cache
    slot_mapping: torch.Tensor  # [T] head slot of each packed row's position
    gather_slots: torch.Tensor  # [B, S] head slot of every position a request may touch this step
    catch_keys: int  # host: keys the catch-up reads (the target's gather width)
    fix_rows: torch.Tensor | None  # [C] last packed row of each non-final prefill chunk
    fix_tokens: torch.Tensor | None  # [C] the prompt token after it
    # The one-token steps' index tensors, 0..B-1 each, distinct (a compiled head guards on
    # its inputs aliasing each other: calls that alias differently compile again).
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # out_index [B], logit_index [B], q_index [B, 1]
    tree_slots: torch.Tensor | None = None  # [B, R] a tree's scratch slots, past every fed row (trees only)
    max_ctx: int = 0  # host: the most keys a request holds after the catch-up (trees)


class EagleDrafter(Drafter):
    """Device half: the head as a submodule (target embedding / lm_head borrowed)."""

    def __init__(self, head: EagleHead, tree: TreeConfig | None = None, *, max_gamma: int = 0,
                 fuse_on: torch.device | None = None) -> None:
        super().__init__()
        self.head = head
        self.tree = tree if tree is not None and tree.is_tree else None
        self.max_gamma = max_gamma
        backend = backend_of(head)
        # A native head (one C++ call a forward) runs a greedy one-request chain's γ - 1 steps
        # as one more call (Backend.head_chain: _chain_steps' bits). It has no per-call dynamo
        # cost to save, and its calls would break a compiled graph: nothing compiled around it.
        self._native_chain = backend.head_chain if self.tree is None else None
        # ... and a dynamic tree's whole expansion as one call (Backend.head_tree: the bits of
        # draft_dynamic_tree's loop of head forwards, without its host work per frontier).
        self._native_tree = backend.head_tree if self.tree is not None and self.tree.kind == "dynamic" else None
        fuse_on = fuse_on if backend.compile_around else None
        # A compiled head guards on its inputs' strides: it gets fresh contiguous copies (_fresh).
        self._copy = _fresh if backend.kind == "compiled" else (lambda t: t)
        # ``fuse_on`` (compiled heads): a chain of the method's γ, greedy or sampled, runs
        # its γ - 1 one-token steps as one compiled graph, as a draft model's does (draft_model.py).
        self._fused = (compile_method(self, type(self)._chain_steps, fuse_on)
                       if fuse_on is not None and self.tree is None else None)
        # ... and a tree of the method's budget drafts its levels (every head forward, the
        # top-k expansion, the selection) as one compiled graph too.
        self._fused_tree = (compile_method(self, type(self)._tree_drafts, fuse_on)
                            if fuse_on is not None and self.tree is not None else None)
        self.static_shapes = (StaticShapes(self.tree.choices, next(head.parameters()).device)
                              if self.tree is not None and self.tree.kind == "static" else None)

    @property
    def native_chain(self) -> bool:
        """Whether a greedy one-request chain drafts its γ - 1 steps as one native call."""
        return self._native_chain is not None

    def draft_after(self, step: TargetStep, gamma: int, sampling: SamplingTensors) -> DraftTree:
        host: EagleStepInputs = step.host
        inp, bonus_row = step.inputs, step.bonus_row
        assert inp is not None and bonus_row is not None and step.rows is not None
        b = bonus_row.shape[0]
        # (1) catch-up: row t pairs the target's feature at t with the token at t + 1.
        bonus = step.tokens.gather(1, step.num_accepted.unsqueeze(1)).squeeze(1)  # [B]
        nxt = torch.roll(inp.tokens, -1)
        if step.path is None:
            nxt = nxt.index_put((bonus_row,), bonus)  # [T]
        else:  # a tree step: along the accepted path, the next path token; the bonus after the last
            on = step.path >= 0
            at = torch.where(on, step.path, bonus_row.unsqueeze(1))  # (past the path: the bonus row again)
            nxt = nxt.index_put((at.reshape(-1),), torch.where(on, step.tokens, bonus.unsqueeze(1)).reshape(-1))
        if host.fix_rows is not None:
            nxt = nxt.index_put((host.fix_rows,), host.fix_tokens)
        # (A tree step keeps the target's tree_mask, rope positions and q_pos (key indices).)
        catch = replace(inp, tokens=nxt, slot_mapping=host.slot_mapping,
                        gather_slots=self._copy(host.gather_slots[:, : host.catch_keys]),
                        logit_index=bonus_row, kv_cache=host.kv, capture_layers=(), all_hidden=False,
                        attention_groups=None)  # (the groups hold the target's slots)
        h, logits = self.head(catch, self.head.project(step.rows, step.aux_rows))  # [B, H], [B, V]
        self.caught_up()
        if step.path is not None:  # the accepted path's head KV into place, as the target's
            logit_rows = inp.logit_index.view(b, -1)  # [B, N+1] rows of the verified tree (0: root)
            rel = torch.where(step.path >= 0, step.path - logit_rows[:, :1], -1)
            src, dst = accepted_slot_moves(rel, host.slot_mapping.index_select(0, inp.logit_index).view(b, -1))
            compact_kv(host.kv, src, dst)
        pos0 = inp.positions.index_select(0, bonus_row)  # [B] position of each bonus row
        if self.tree is not None:
            assert host.tree_slots is not None
            fused = self._fused_tree is not None and gamma == self.max_gamma
            shape = self.static_shapes(gamma) if self.static_shapes is not None else None
            tokens, parents, num_nodes = (self._fused_tree if fused else self._tree_drafts)(
                logits, h, pos0, host.tree_slots, host.gather_slots, host.kv, host.max_ctx, gamma, shape)
            depth, kids = ((self.tree.depth, self.tree.top_k) if shape is None
                           else (shape.max_depth, shape.max_children))
            return DraftTree(tokens=tokens, parents=parents, is_chain=False, num_nodes=num_nodes,
                             max_depth=depth, max_children=kids)
        # Step j feeds the pair (own state, draft j) at position pos0 + 1 + j; its keys run
        # through the bound any request may reach, masked past its own.
        gather = host.gather_slots[:, : host.catch_keys + max(gamma - 1, 0)]
        assert gather.shape[1] == host.catch_keys + max(gamma - 1, 0), "prepare_after packs γ - 1 draft positions"
        fused = self._fused is not None and gamma == self.max_gamma > 1
        if self._native_chain is not None and not fused and sampling.all_greedy and b == 1 and gamma > 1:
            return DraftTree.chain(self._native_chain(logits, h, pos0, gamma - 1, gather, host.kv), None)
        steps = self._fused if fused else self._chain_steps
        tokens, probs = steps(logits, h, pos0, _fresh(gather), host.kv, *host.rows, gamma,
                              None if sampling.all_greedy else sampling)
        return DraftTree.chain(tokens, probs)  # greedy: probs None

    def _chain_steps(self, logits: torch.Tensor, h: torch.Tensor, pos0: torch.Tensor, gather: torch.Tensor,
                     kv: KVCacheTensors, rows: torch.Tensor, logit_rows: torch.Tensor, q_index: torch.Tensor,
                     gamma: int, sampling: SamplingTensors | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """γ drafts [B, γ] from the catch-up's ``logits`` [B, V] and state ``h`` [B, H], the
        bonus rows at ``pos0`` [B]: greedy (``sampling`` None), or sampled (draft j takes
        position pos0 + 2 + j) with their distributions q [B, γ, V]. ``gather`` [B, K + γ - 1]:
        head slots through the last step's keys (K: the catch-up's). Tensors in but γ and
        the sampling flags, for ``torch.compile`` to take whole."""
        keys = gather.shape[1] - (gamma - 1)
        toks, probs = [], []
        for j in range(gamma):
            t, q = draw_drafts(logits, sampling, pos0 + 2 + j)  # [B], q [B, V] when sampled
            toks.append(t)
            if q is not None:
                probs.append(q)
            if j + 1 < gamma:
                h, logits = self.head(_one_token_step(t, pos0 + 1 + j, gather, keys + j + 1, kv, rows, logit_rows,
                                                       q_index), h)
        return torch.stack(toks, 1), (torch.stack(probs, 1) if probs else None)

    # -- token trees ----------------------------------------------------------------
    def _tree_drafts(self, logits: torch.Tensor, h0: torch.Tensor, pos0: torch.Tensor, tree_slots: torch.Tensor,
                     gather_slots: torch.Tensor, kv: KVCacheTensors, max_ctx: int, n: int,
                     static: StaticShape | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A tree of ``n`` nodes per request from the catch-up's ``logits`` [B, V] and
        state ``h0`` [B, H] at the bonus rows' positions ``pos0`` [B] -> (tokens [B, n],
        parents [B, n], num_nodes [B]). ``tree_slots`` [B, R]: each request's scratch
        head slots; ``gather_slots`` [B, S] / ``max_ctx``: its committed head keys (host
        packing); ``static``: the static tree's shape (``static_shapes``), None for a
        dynamic tree. Tensors in but the sizes, for ``torch.compile`` to take whole."""

        def step(tokens: torch.Tensor, feature: torch.Tensor | None, own: torch.Tensor,
                 anc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """The head's :data:`~specdec.spec.tree.NodeStep`: node ``(b, m)`` is the pair (its
            parent's h ``feature[b, m]``, its token) at position ``pos0[b] + 1 + A``; its keys
            are its request's committed ones (positions ``0 … pos0[b]``; a request's may end
            before ``max_ctx``: always masked), its ancestors', then its own."""
            assert feature is not None
            b, m = tokens.shape
            one = node_rows(tokens, own, anc, pos0 + 1, gather_slots, max_ctx, kv, exact_context=False)
            h, lg = self.head(one, feature.reshape(b * m, -1))
            return h.view(b, m, -1), lg.view(b, m, -1)

        if static is not None:
            return draft_static_tree(step, logits, h0, tree_slots, static)
        assert self.tree is not None
        native = None
        if self._native_tree is not None and native_tree_serves(kv, self.head, max_ctx + self.tree.depth):
            head_tree = self._native_tree

            def native(lg: torch.Tensor, h: torch.Tensor | None, slots: torch.Tensor, depth: int,
                       k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                return head_tree(lg, h, slots, gather_slots, pos0 + 1, max_ctx, depth, k, kv)
        return draft_dynamic_tree(step, logits, h0, tree_slots, self.tree, n, native=native)


@register_proposer("eagle", EagleConfig)
class EagleProposer(Proposer):
    """Host half: loads the head, keeps its paged KV cache in step with the target's."""

    kind = "eagle"

    def __init__(self, config: EagleConfig, deps: ProposerDeps) -> None:
        self.config = config
        self.tree = config.tree if config.tree.is_tree else None
        target, rt = deps.target, deps.runtime
        tcfg = target.config
        self.vocab_size = tcfg.vocab_size
        dtype = rt.torch_dtype
        loaded = load_decoder(config.path, role=Role.DRAFT_HEAD, dtype=dtype, device=rt.device,
                              check=lambda c: check_head_fits(c, tcfg, repr(config.path)))
        head: EagleHead = loaded.module  # type: ignore[assignment]
        if head.config.kind != self.kind:
            raise ValueError(f"{config.path!r} holds an {head.config.kind!r} head; method {self.name!r} "
                             f"needs an {self.kind!r} head (use method={head.config.kind})")
        bad_map = head.check_vocab_map()
        if bad_map:
            raise CheckpointError(f"{config.key('path')}={config.path!r}: {bad_map}")
        check_tree_fits(config.key("tree"), config.tree, config.num_speculative_tokens,
                        head.config.num_draft_vocab, f"the head's vocabulary at {config.path!r}")
        aux = getattr(config, "aux_layers", None)
        layers = tuple(aux) if aux is not None else head.config.fused_layers(tcfg.num_hidden_layers)
        if self.kind == "eagle3":
            # (id L, one past the last layer, is the last layer's output before the final norm)
            bad = [i for i in layers if not 0 <= i <= tcfg.num_hidden_layers]
            if len(layers) != 3 or bad:
                raise ValueError(f"method.eagle3.aux_layers={list(layers)}: need three layers of the target "
                                 f"(0..{tcfg.num_hidden_layers}; {tcfg.num_hidden_layers}: the last one's output)")
        self._target_layers = layers
        built = target.build_module()  # the target module the step calls: borrow its embedding and head
        head.attach_target(built.model.embed_tokens, built.lm_head)
        head.prepare_for_inference()
        pack_for_runtime(head, rt)
        self.max_positions = rt.max_seq_len + 2 * config.num_speculative_tokens + 2
        head.ensure_rope(self.max_positions, rt.device)
        load_backend(head, compile=rt.compile)  # native, compiled or eager: once, here
        self.head = head
        g = config.num_speculative_tokens
        # Room for everything the target holds plus each request's 2γ+1 lookahead (and tree rows).
        per_req = -(-(2 * g + 1 + config.tree.scratch_rows(g)) // rt.block_size)
        blocks = target.num_blocks + rt.max_batch_size * per_req
        lc = head.config.layer
        self.cache = PagedKVCache(KVCacheParams(num_layers=1, num_kv_heads=lc.num_key_value_heads,
                                                head_dim=lc.head_dim, block_size=rt.block_size,
                                                num_blocks=blocks, dtype=next(head.parameters()).dtype,
                                                device=rt.device), "eagle")
        self.device = torch.device(rt.device)
        self.target_cache = target.cache_name
        self.drafter = EagleDrafter(head, self.tree, max_gamma=g, fuse_on=self.device if rt.compile else None)
        self._index: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # A one-request chain step's packing in reused buffers, where they serve (core StepBuffers).
        self._one = (StepBuffers(self.cache, self.max_positions)
                     if self.tree is None and step_buffers_serve(rt.device, rt.compile, rt.data_parallel_degree)
                     else None)

    def drafter_spec(self) -> DrafterSpec:
        """Drafts after verification from the target's features (every packed row, and the
        inputs of its fused layers); sampled chains, or top-k trees (deterministic, no q)
        whose shapes the store keeps. Its head times itself (draft_cost …)."""
        tree, g = self.tree, self.config.num_speculative_tokens
        after = DrafterSpec(drafts_after_verify=True, needs_all_rows=True, target_layers=self._target_layers)
        if tree is None:
            return replace(after, samples_drafts=True)
        facts: tuple[int | None, int | None] = (None, None)
        depth = None
        if tree.kind == "dynamic":
            facts, depth = (tree.depth, tree.top_k), tree.depth
        elif g:
            shape = static_tree_shape(tree.choices, g)
            facts = (shape.max_depth, shape.max_children)
        return replace(after, drafts_trees=True, node_budget=True, tree_facts=facts, depth=depth)

    # -- KV bookkeeping ----------------------------------------------------------------
    def _table(self, ctx: TextContext) -> BlockTable:
        table = ctx.kv.get(self.cache.name)
        if table is None:
            table = ctx.kv[self.cache.name] = BlockTable()
        return table

    def kv_tokens(self, num_tokens: int, gamma: int) -> int:
        # rows fed (≤ tokens + γ) and γ - 1 draft steps past them, or a tree's scratch rows
        return num_tokens + 2 * gamma + 1 + self.config.tree.scratch_rows(gamma)

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
    def _rows(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EagleStepInputs.rows for ``b`` requests (made once per size)."""
        if b not in self._index:
            self._index[b] = (torch.arange(b, device=self.device), torch.arange(b, device=self.device),
                              torch.arange(b, device=self.device).unsqueeze(1))
        return self._index[b]

    def prepare_after(self, batch: list[TextContext], packed: PackedBatch, gamma: int) -> EagleStepInputs:
        if self._one is not None and len(batch) == 1 and packed.lookahead[0]:  # a decode step (no prompt row to fix)
            return self._prepare_one(batch[0], packed, gamma, self._one)
        ln = np.asarray([n + a for n, a in zip(packed.num_new, packed.lookahead)], dtype=np.int64)  # [B] rows fed
        tables = [self._table(c) for c in batch]
        # Row 0 of request r sits where the target's cache ended before this step
        # (the head holds the same positions: commit keeps them in step).
        starts = np.asarray([c.kv[self.target_cache].num_tokens for c in batch], dtype=np.int64) - ln
        ctx_len = starts + ln  # [B]
        bs = self.cache.block_size
        tbl = block_table_array([t.blocks for t in tables])  # [B, max_blocks]
        rows = self.config.tree.scratch_rows(gamma)  # a tree's scratch rows (0: a chain)
        width = int(ctx_len.max()) + max(gamma, 1, rows)  # catch-up keys, then γ - 1 draft positions / tree rows
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
        index = self._rows(b)
        dev = self.device
        tree_slots = None
        if self.tree is not None:  # a tree's scratch rows: past every row fed this step (never a committed key)
            ts = gather[np.arange(len(batch))[:, None], ctx_len[:, None] + np.arange(rows)[None, :]].reshape(b, rows)
            tree_slots = torch.from_numpy(np.ascontiguousarray(ts)).to(dev)
        return EagleStepInputs(
            kv=self.cache.tensors,
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            gather_slots=torch.from_numpy(np.ascontiguousarray(gather)).to(dev),
            catch_keys=int(packed.inputs.gather_slots.shape[1]),
            fix_rows=torch.tensor(fix_rows, dtype=torch.long, device=dev) if fix_rows else None,
            fix_tokens=torch.tensor(fix_tokens, dtype=torch.long, device=dev) if fix_rows else None,
            rows=index, tree_slots=tree_slots, max_ctx=int(ctx_len.max()),
        )

    def _prepare_one(self, ctx: TextContext, packed: PackedBatch, gamma: int,
                     one: StepBuffers) -> EagleStepInputs:
        """:meth:`prepare_after` of one request's chain step in the reused buffers ``one``: the same values."""
        ln = packed.num_new[0] + packed.lookahead[0]
        ctx_len = ctx.kv[self.target_cache].num_tokens
        table = self._table(ctx)
        gather = one.gather(table.blocks, ctx_len + max(gamma, 1))  # [1, S]
        slot_mapping = one.small("slot_mapping", one.slots_at(np.arange(ctx_len - ln, ctx_len)), (ln,))
        table.num_tokens = ctx_len
        return EagleStepInputs(kv=self.cache.tensors, slot_mapping=slot_mapping, gather_slots=gather,
                               catch_keys=int(packed.inputs.gather_slots.shape[1]), fix_rows=None, fix_tokens=None,
                               rows=self._rows(1), max_ctx=ctx_len)

    # -- cost ------------------------------------------------------------------------------
    def draft_forward_time(self, ctx_len: int, repeats: int = 10, *,
                           between: Callable[[], object] | None = None, warmup: int = 3,
                           requests: int = 1) -> float:
        """T_draft(1) of the analytic limit for ``requests`` requests at once: a bare
        one-token step of the head, or, where the method's γ drafts its steps in one
        compiled graph (a native chain: of one request only), what a draft costs that way:
        (one step + the fused γ - 1 steps) / γ (the limit charges γ · T_draft(1)).
        ``between`` runs before each timed first step only: in a step the other γ - 1
        follow that one, not the target's forward."""
        b = requests
        first = self._step_time(ctx_len, repeats, requests=b, between=between, warmup=warmup)
        g = self.config.num_speculative_tokens
        if g < 2:
            return first
        if not (self.drafter.compiled_chain or self.drafter.native_chain and b == 1):
            rest = self._step_time(ctx_len, repeats, requests=b, warmup=warmup) if between is not None else first
            return (first + (g - 1) * rest) / g
        return (first + self._step_time(ctx_len, repeats, requests=b, fused=g, warmup=warmup)) / g

    def draft_cost(self, batch_size: int, context_len: int) -> float:
        return self._step_time(max(context_len, 1), repeats=7, requests=max(batch_size, 1), stat="min")

    def fused_draft_cost(self, batch_size: int, context_len: int) -> float | None:
        g = self.config.num_speculative_tokens
        if g < 2 or not (self.drafter.compiled_chain or self.drafter.native_chain and batch_size <= 1):
            return None
        ctx, b = max(context_len, 1), max(batch_size, 1)  # the first step, then the fused γ - 1
        return (self._step_time(ctx, repeats=7, requests=b, stat="min")
                + self._step_time(ctx, repeats=7, requests=b, stat="min", fused=g))

    @torch.inference_mode()
    def _step_time(self, ctx_len: int, repeats: int, *, requests: int = 1, stat: str = "median",
                   fused: int = 0, between: Callable[[], object] | None = None, warmup: int = 3) -> float:
        """Seconds of a bare one-token step of the head for ``requests`` requests at context
        ``ctx_len``; ``fused=γ``: of the γ - 1 steps as one compiled graph (EagleDrafter._chain_steps)
        or, a native head's greedy chain of one request, one native call, instead."""
        with self.cache.scratch(requests, ctx_len + max(fused - 1, 0)) as gather:  # [B, S]
            b = requests
            rows = self._rows(b)  # the loop's own index tensors (as distinct as there)
            pos = torch.full((b,), ctx_len - 1, device=self.device)
            dtype = next(self.head.parameters()).dtype
            feat = torch.zeros(b, self.head.config.hidden_size, device=self.device, dtype=dtype)
            if fused:
                logits = torch.zeros(b, self.vocab_size, device=self.device, dtype=dtype)
                if not self.drafter.compiled_chain:  # a native chain (one request, greedy)
                    chain = backend_of(self.head).head_chain
                    assert chain is not None and b == 1
                    return time_calls(lambda: chain(logits, feat, pos, fused - 1, gather, self.cache.tensors),
                                      self.device, repeats=repeats, stat=stat, between=between, warmup=warmup)
                args = (logits, feat, pos, gather, self.cache.tensors, *rows, fused, None)  # greedy
                return time_calls(lambda: self.drafter._fused(*args), self.device, repeats=repeats, stat=stat,
                                  between=between, warmup=warmup)
            inp = _one_token_step(torch.zeros(b, dtype=torch.long, device=self.device), pos, gather, ctx_len,
                                  self.cache.tensors, *rows)
            return time_calls(lambda: self.head(inp, feat), self.device, repeats=repeats, stat=stat,
                              between=between, warmup=warmup)


@register_proposer("eagle3", Eagle3Config)
class Eagle3Proposer(EagleProposer):
    """EAGLE-3: the same drafting, a head that fuses three target layers."""

    kind = "eagle3"


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy: a compiled head guards on strides, and a view's (even one
    ``contiguous()`` keeps, at B = 1) would compile another graph."""
    return t.clone(memory_format=torch.contiguous_format)


def _one_token_step(tokens: torch.Tensor, pos: torch.Tensor, gather: torch.Tensor, n_keys: Any,
                    kv: KVCacheTensors, rows: torch.Tensor, logit_rows: torch.Tensor,
                    q_index: torch.Tensor) -> DecoderInputs:
    """The head's one-token step: ``tokens`` [B] at ``pos`` [B], written to their head slot
    in ``gather`` [B, S], reading its first ``n_keys`` keys (masked past each request's own)."""
    return DecoderInputs(
        tokens=tokens, positions=pos, slot_mapping=gather.gather(1, pos.unsqueeze(1)).squeeze(1),
        gather_slots=_fresh(gather[:, :n_keys]), q_index=q_index, q_pos=pos.unsqueeze(1), out_index=rows,
        logit_index=logit_rows, kv_cache=kv, single_request=tokens.shape[0] == 1, mask=MaskKind.EXPLICIT,
    )
