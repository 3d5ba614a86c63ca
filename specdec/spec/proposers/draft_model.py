"""Independent draft model: any registered decoder sharing the target's vocabulary.

Each step the drafter (1) catches up on the request's tokens it has not seen
(the whole prompt at first, then the tokens the last step committed), which
yields the first draft token, then (2) runs ``γ - 1`` one-token steps, each
feeding the previous draft token. All positions and KV slots are packed on the
host beforehand, so the loop runs inside the draft-and-verify module without a
host round trip. Its paged KV cache is rolled back in step with the target's.
Compiled (``runtime.compile``), a step of the method's γ, greedy or sampled, runs
its catch-up and its γ - 1 one-token steps as *one* compiled graph
(``_draft_chain``): each separate call of a compiled decoder pays dynamo's
guards and wrappers, about a third of a small drafter's forward on CPU.

**Token trees** (``tree=TreeConfig(kind=...)``, specdec/spec/tree.py): after
the catch-up (the root's distribution), a top-k tree is drafted level by level:

- ``dynamic`` (EAGLE-2): the root's ``top_k`` tokens are the first frontier;
  ``depth - 1`` times the frontier's ``top_k`` nodes run in *one* batched
  forward, each proposing its ``top_k`` best children, and the ``top_k`` best
  children by cumulative log-probability form the next frontier; then each
  request keeps its best ``num_draft[b]`` nodes (tree.dynamic_tree_select);
- ``static``: the ``choices`` tree; node ``i``'s token is the ``ranks[i]``-th
  top token of the distribution drafted at its parent (one forward per level).

A node runs as its own one-token "request" over the draft's paged cache: its
gathered keys are the request's context (through the root), then its
ancestors' rows, then its own row, so its key index equals its position
(root position + depth) and no tree mask is needed. Tree rows are written
after the context (``kv_tokens``: context + tree rows). Trees are top-k,
hence deterministic (``probs = None``): sampled verification uses the
point-mass rule, lossless. After verification the draft cache is simply
**truncated** to the context before the tree (no compaction): the next
step's catch-up recomputes the accepted tokens' entries — exact, and the
simplest (the accepted path is short next to the rows a tree writes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from specdec.core.backend import backend_of
from specdec.core.batch_processor import StepBuffers, step_buffers_serve
from specdec.core.context import TextContext
from specdec.core.inputs import DecoderInputs, KVCacheTensors, MaskKind, move_tensors
from specdec.core.kv_cache import OutOfBlocks, block_table_array
from specdec.core.pipeline_model import DecoderPipelineModel, compile_method, registered_pipeline_model
from specdec.sampling import SamplingTensors, draw_drafts
from specdec.spec.forward_time import bare_batch, forward_time, time_calls
from specdec.spec.tree import (
    StaticShape,
    StaticShapes,
    TreeConfig,
    check_tree_fits,
    draft_dynamic_tree,
    draft_static_tree,
    native_tree_serves,
    node_rows,
)
from specdec.spec.proposers.base import (
    CheckpointProposerConfig,
    DraftBatch,
    Drafter,
    DrafterSpec,
    DraftTree,
    Proposer,
    ProposerDeps,
    register_proposer,
)


@dataclass(frozen=True)
class DraftModelConfig(CheckpointProposerConfig):
    """``path``: the draft checkpoint (Hugging Face format, the target's vocabulary);
    ``tree``: chain, or a static / dynamic top-k tree (CheckpointProposerConfig)."""

    path_is: ClassVar[str] = "the draft checkpoint directory"
    zoo_dir: ClassVar[str] = "code-draft"
    any_target: ClassVar[bool] = True  # a whole model: any target of its vocabulary


@dataclass
class DraftModelBatch(DraftBatch):
    catch_up: DecoderInputs | None = None  # the unseen tokens of each request, logits of the last
    step_positions: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [γ-1, B] int64
    step_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [γ-1, B] int64
    gather_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [B, S] through the last draft
    max_len: int = 0  # host: the longest request's length before drafting (S = max_len + γ - 1)
    # A tree step: draft KV slot of each tree row [B, R] (rows after the context;
    # gather_slots then covers the context only, S = max_len).
    tree_slots: torch.Tensor | None = None


class DraftModelDrafter(Drafter):
    """Device half: the draft decoder as a submodule, sampling ``γ`` tokens."""

    def __init__(self, pipeline: DecoderPipelineModel, tree: TreeConfig | None = None, max_gamma: int = 0) -> None:
        super().__init__()
        self.decoder = pipeline.build_module()
        self._row_cache: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}
        self.tree = tree if tree is not None and tree.is_tree else None
        self.max_gamma = max_gamma
        # Compiled: a chain of the method's γ, greedy or sampled, runs its catch-up and
        # γ - 1 one-token steps in one graph (one call, not γ calls each paying dynamo's
        # guards and wrappers); other γ (adaptive γ's smaller ones) step by step.
        # A decoder whose backend is native (one C++ call) has no per-call dynamo cost to
        # save, and its forwards would break such a graph: none (Backend.compile_around).
        backend = backend_of(self.decoder)
        # One request's greedy chain after its catch-up, as one call where the backend has it.
        self._native_chain = backend.draft_chain
        # A dynamic tree's whole expansion as one call, where the backend has it (Backend.draft_tree).
        self._native_tree = backend.draft_tree if self.tree is not None and self.tree.kind == "dynamic" else None
        fuse = pipeline.runtime.compile and backend.compile_around
        self._fused = (compile_method(self, type(self)._draft_chain, pipeline.device)
                       if fuse and self.tree is None else None)
        # ... and a tree of the method's budget its catch-up and every level (forwards, top-k
        # expansion, selection).
        self._fused_tree = (compile_method(self, type(self)._draft_tree, pipeline.device)
                            if fuse and self.tree is not None else None)
        self.static_shapes = (StaticShapes(self.tree.choices, pipeline.device)
                              if self.tree is not None and self.tree.kind == "static" else None)

    def _rows(self, b: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The one-token steps' row indices for ``b`` requests (read-only, made once per size):
        ``out_index`` [B], ``logit_index`` [B], ``q_index`` [B, 1]. Distinct
        tensors: a compiled decoder guards on inputs aliasing each other."""
        rows = self._row_cache.get((b, device))
        if rows is None:
            rows = self._row_cache[(b, device)] = (
                torch.arange(b, device=device), torch.arange(b, device=device),
                torch.arange(b, device=device).unsqueeze(1))
        return rows

    def forward(self, batch: DraftModelBatch, sampling: SamplingTensors) -> DraftTree:  # type: ignore[override]
        assert batch.catch_up is not None and batch.catch_up.kv_cache is not None
        kv = batch.catch_up.kv_cache
        rows = self._rows(batch.first_position.shape[0], kv.k.device)
        samp = None if sampling.all_greedy else sampling
        if self._fused is not None and batch.tree_slots is None and batch.gamma == self.max_gamma > 1:
            # Compiled, the method's γ runs catch-up and steps as one graph (module doc).
            tokens, probs = self._fused(batch.catch_up, batch.step_positions, batch.step_slots,
                                        batch.gather_slots, *rows, samp, batch.first_position)
            return DraftTree.chain(tokens, probs)  # greedy: probs None (q one-hot, left implicit)
        if batch.tree_slots is not None:
            assert self.tree is not None
            static = self.static_shapes(batch.gamma) if self.static_shapes is not None else None
            args = (batch.tree_slots, batch.gather_slots, batch.first_position, batch.num_draft, kv,
                    batch.max_len, batch.gamma, static)
            if self._fused_tree is not None and batch.gamma == self.max_gamma:
                tokens, parents, num_nodes = self._fused_tree(batch.catch_up, *args)
            else:
                logits = self.decoder(batch.catch_up).logits  # [B, V]
                self.caught_up()
                tokens, parents, num_nodes = self._tree_drafts(logits, *args)
            depth, kids = ((self.tree.depth, self.tree.top_k) if static is None
                           else (static.max_depth, static.max_children))
            return DraftTree(tokens=tokens, parents=parents, is_chain=False, num_nodes=num_nodes,
                             max_depth=depth, max_children=kids)
        logits = self.decoder(batch.catch_up).logits  # [B, V]
        self.caught_up()
        if samp is None and logits.shape[0] == 1 and batch.step_positions.shape[0] and self._native_chain:
            # One request, greedy, on a native decoder: its γ - 1 steps (and their argmax) in
            # one more call (Backend.draft_chain: _chain_steps' bits).
            tokens = self._native_chain(logits, batch.step_positions, batch.step_slots, batch.gather_slots, kv)
            return DraftTree.chain(tokens, None)
        tokens, probs = self._chain_steps(logits, batch.step_positions, batch.step_slots, batch.gather_slots, kv,
                                          *rows, samp, batch.first_position)
        return DraftTree.chain(tokens, probs)

    def _draft_chain(self, catch_up: DecoderInputs, step_positions: torch.Tensor, step_slots: torch.Tensor,
                     gather_slots: torch.Tensor, out_rows: torch.Tensor, logit_rows: torch.Tensor,
                     q_index: torch.Tensor, sampling: SamplingTensors | None,
                     first_position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The catch-up forward, then :meth:`_chain_steps`: a chain's whole drafting, for
        ``torch.compile`` to take as one graph."""
        assert catch_up.kv_cache is not None
        logits = self.decoder(catch_up).logits  # [B, V]
        return self._chain_steps(logits, step_positions, step_slots, gather_slots, catch_up.kv_cache, out_rows,
                                 logit_rows, q_index, sampling, first_position)

    def _chain_steps(self, logits: torch.Tensor, step_positions: torch.Tensor, step_slots: torch.Tensor,
                     gather_slots: torch.Tensor, kv: KVCacheTensors, out_rows: torch.Tensor,
                     logit_rows: torch.Tensor, q_index: torch.Tensor, sampling: SamplingTensors | None,
                     first_position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """γ drafts [B, γ] (γ = 1 + len(step_positions)) from the catch-up's ``logits`` [B, V]:
        greedy (``sampling`` None), or sampled, draft j at position ``first_position + j``,
        with their distributions q [B, γ, V]. Written for ``torch.compile`` to take whole:
        tensors in (and the sampling flags), no host facts (step j reads the first
        ``S - γ + j + 2`` keys of ``gather_slots`` [B, S])."""
        steps = step_positions.shape[0]
        keys = gather_slots.shape[1] - steps  # keys through the first draft
        toks, probs = [], []
        for j in range(steps + 1):
            t, q = draw_drafts(logits, sampling, first_position + j)  # [B], q [B, V] when sampled
            toks.append(t)
            if q is not None:
                probs.append(q)
            if j < steps:
                step = _one_token_step(t, step_positions[j], step_slots[j], gather_slots[:, : keys + j + 1], kv,
                                       out_rows, logit_rows, q_index)
                logits = self.decoder(step).logits
        return torch.stack(toks, dim=1), (torch.stack(probs, dim=1) if probs else None)

    # -- token trees ----------------------------------------------------------------
    def _draft_tree(self, catch_up: DecoderInputs, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The catch-up forward, then :meth:`_tree_drafts`: a tree's whole drafting, for
        ``torch.compile`` to take as one graph."""
        return self._tree_drafts(self.decoder(catch_up).logits, *args)

    def _tree_drafts(self, logits: torch.Tensor, tree_slots: torch.Tensor, gather_slots: torch.Tensor,
                     first_position: torch.Tensor, num_draft: torch.Tensor, kv: KVCacheTensors, max_len: int,
                     n: int, static: StaticShape | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A tree of ``n`` nodes per request (each request's best ``num_draft[b]``) from the
        catch-up's ``logits`` [B, V] -> (tokens [B, n], parents [B, n], num_nodes [B]).
        ``tree_slots`` [B, R]: draft KV slot of each tree row; ``gather_slots`` [B, S] /
        ``max_len``: each request's context (the root is its last key, ``first_position``
        keys); ``static``: the static tree's shape (``static_shapes``), None for a
        dynamic tree."""

        def step(tokens: torch.Tensor, state: torch.Tensor | None, own: torch.Tensor,
                 anc: torch.Tensor) -> tuple[None, torch.Tensor]:
            """The draft decoder's :data:`~specdec.spec.tree.NodeStep` (no state): each node
            fed as a one-token request whose keys are exactly its request's context, its
            ancestors' rows and its own, so its key index is its position."""
            b, m = tokens.shape
            rows = node_rows(tokens, own, anc, first_position, gather_slots, max_len, kv, exact_context=True)
            return None, self.decoder(rows).logits.view(b, m, -1)

        if static is not None:
            return draft_static_tree(step, logits, None, tree_slots, static, num_draft)
        assert self.tree is not None
        native = None
        if self._native_tree is not None and native_tree_serves(kv, self.decoder, max_len + self.tree.depth):
            draft_tree = self._native_tree

            def native(lg: torch.Tensor, h: torch.Tensor | None, slots: torch.Tensor, depth: int,
                       k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                return draft_tree(lg, slots, gather_slots, first_position, max_len, depth, k, True, kv)
        return draft_dynamic_tree(step, logits, None, tree_slots, self.tree, n, num_draft, native=native)


@register_proposer("draft_model", DraftModelConfig)
class DraftModelProposer(Proposer):
    """Host half: the draft's batch processor and KV bookkeeping."""

    def __init__(self, config: DraftModelConfig, deps: ProposerDeps) -> None:
        self.config = config
        self.tree = config.tree if config.tree.is_tree else None
        self.pipeline = registered_pipeline_model(
            config.path, deps.runtime, cache_name="draft",
            extra_tokens=max(g := config.num_speculative_tokens, config.tree.scratch_rows(g)) + 1,
        )
        self._tree_base: dict[int, int] = {}  # TextContext.key -> its draft cache length before this step's tree
        self._compiled: set[bool] = set()  # batch kinds (several requests or one) whose drafting graphs compiled
        self.pipeline.build_module()  # the module the drafter calls is the one timed and executed
        vocab = self.pipeline.config.vocab_size
        target_vocab_size = deps.target.config.vocab_size
        target_tokenizer = deps.target.path / "tokenizer.json" if deps.target.path else None
        if vocab != target_vocab_size:
            raise ValueError(
                f"draft {config.path!r} has vocab_size {vocab}, the target has {target_vocab_size}: "
                "a draft model must share the target's vocabulary"
            )
        if target_tokenizer is not None:
            _check_same_tokenizer(Path(config.path), target_tokenizer)
        if self.tree is not None:
            check_tree_fits(config.key("tree"), self.tree, config.num_speculative_tokens, vocab,
                            f"the draft's vocabulary at {config.path!r}")
        self.drafter = DraftModelDrafter(self.pipeline, self.tree, config.num_speculative_tokens)
        self._one = self._step_buffers()

    def _step_buffers(self) -> StepBuffers | None:
        """A one-request chain step's packing in reused buffers, where they serve (core ``StepBuffers``)."""
        p = self.pipeline
        if self.tree is not None or not step_buffers_serve(p.device, p.runtime.compile, p.runtime.data_parallel_degree):
            return None
        return StepBuffers(p.caches[0], p.runtime.max_seq_len + self.config.num_speculative_tokens + 1)

    def drafter_spec(self) -> DrafterSpec:
        """Its draft decoder (costs, catch-up derived from it); a tree: γ is its node budget,
        a dynamic tree runs ``depth`` forwards a step."""
        t = self.tree
        return DrafterSpec(model=self.pipeline, node_budget=t is not None,
                           depth=t.depth if t is not None and t.kind == "dynamic" else None)

    @property
    def cache_name(self) -> str:
        return self.pipeline.cache_name

    def reserve(self, ctx: TextContext, gamma: int) -> None:
        self.pipeline.reserve(ctx, self.kv_tokens(len(ctx.tokens), gamma))

    def kv_tokens(self, num_tokens: int, gamma: int) -> int:
        if self.tree is not None:
            return num_tokens + self.tree.scratch_rows(gamma)
        return num_tokens + max(gamma - 1, 0)  # catch up on every unseen token, then γ - 1 drafts

    def _prepare_tree(self, batch: list[TextContext], gamma: int, num_draft: list[int]) -> DraftModelBatch:
        packed = self.pipeline.prepare(batch)  # the catch-up: the root's distribution
        bs = self.pipeline.caches[0].block_size
        rows = self.tree.scratch_rows(gamma)
        lens = np.asarray([len(c.tokens) for c in batch], dtype=np.int64)  # [B] the first tree row's key index
        tbl = block_table_array([c.kv[self.cache_name].blocks for c in batch])  # [B, max_blocks]
        p = np.arange(int(lens.max()) + rows)
        gather = tbl[:, np.minimum(p // bs, tbl.shape[1] - 1)] * bs + p % bs  # [B, S + rows]
        tree_slots = gather[np.arange(len(batch))[:, None], lens[:, None] + np.arange(rows)[None, :]]  # [B, rows]
        for c in batch:
            self._tree_base[c.key] = c.kv[self.cache_name].num_tokens
            c.kv[self.cache_name].num_tokens += rows
        return move_tensors(DraftModelBatch(
            gamma=gamma,
            num_draft=torch.tensor(num_draft, dtype=torch.long),
            first_position=torch.from_numpy(lens),
            catch_up=packed.inputs,
            gather_slots=torch.from_numpy(np.ascontiguousarray(gather[:, : int(lens.max())])),
            max_len=int(lens.max()),
            tree_slots=torch.from_numpy(np.ascontiguousarray(tree_slots)),
            num_draft_host=num_draft,
        ), self.pipeline.device)

    def prepare(self, batch: list[TextContext], gamma: int, num_draft: list[int]) -> DraftModelBatch:
        if self.tree is not None:
            return self._prepare_tree(batch, gamma, num_draft)
        if self.drafter._fused is not None and gamma == self.config.num_speculative_tokens > 1 \
                and (len(batch) > 1) not in self._compiled:
            self._precompile(len(batch) > 1)
        one = self._one if len(batch) == 1 else None
        if one is not None:
            c = batch[0]
            table = c.kv[self.cache_name]
            unseen, steps = len(c.tokens) - table.num_tokens, max(gamma - 1, 0)
            # A decode step's catch-up, every draft slot in the blocks the request holds.
            if 1 <= unseen <= gamma + 1 and len(table.blocks) * one.block_size >= len(c.tokens) + steps:
                return self._pack_chain_one(c, one.pack(c, unseen).inputs, gamma, num_draft, one)
        return self._pack_chain(batch, self.pipeline.prepare(batch).inputs, gamma, num_draft)

    def _pack_chain_one(self, ctx: TextContext, catch_up: DecoderInputs, gamma: int, num_draft: list[int],
                        one: StepBuffers) -> DraftModelBatch:
        """:meth:`_pack_chain` of one request in the reused buffers ``one``: the same values."""
        steps = max(gamma - 1, 0)
        n = len(ctx.tokens)
        table = ctx.kv[self.cache_name]
        gather = one.gather(table.blocks, n + steps)  # [1, S] (the catch-up's slots, then the steps')
        pos = np.arange(n, n + steps)
        table.num_tokens += steps
        return DraftModelBatch(
            gamma=gamma, num_draft=one.small("num_draft", num_draft, (1,)),
            first_position=one.small("first_position", [n], (1,)), catch_up=catch_up,
            step_positions=one.small("step_positions", pos, (steps, 1)),
            step_slots=one.small("step_slots", one.slots_at(pos), (steps, 1)),
            gather_slots=gather, max_len=n, num_draft_host=num_draft,
        )

    def _pack_chain(self, batch: list[TextContext], catch_up: DecoderInputs, gamma: int,
                    num_draft: list[int]) -> DraftModelBatch:
        """A chain step: the ``catch_up`` inputs (its KV cache serves every step), then the
        positions and KV slots of the γ - 1 one-token steps, packed on the host (numpy)."""
        bs = self.pipeline.caches[0].block_size
        steps = max(gamma - 1, 0)
        # Positions and KV slots of the γ-1 one-token steps, on the host (numpy).
        lens = np.asarray([len(c.tokens) for c in batch], dtype=np.int64)  # [B] first draft position
        tbl = block_table_array([c.kv[self.cache_name].blocks for c in batch])  # [B, max_blocks]
        p = np.arange(int(lens.max()) + steps)
        gather = tbl[:, np.minimum(p // bs, tbl.shape[1] - 1)] * bs + p % bs  # [B, S] slot of each position
        pos = lens[None, :] + np.arange(steps)[:, None]  # [γ-1, B]
        slots = gather[np.arange(len(batch))[None, :], pos]  # [γ-1, B]
        for c in batch:
            c.kv[self.cache_name].num_tokens += steps
        return move_tensors(DraftModelBatch(
            gamma=gamma,
            num_draft=torch.tensor(num_draft, dtype=torch.long),
            first_position=torch.from_numpy(lens),
            catch_up=catch_up,
            step_positions=torch.from_numpy(pos),
            step_slots=torch.from_numpy(slots),
            gather_slots=torch.from_numpy(np.ascontiguousarray(gather)),  # fancy indexing may give F order
            max_len=int(lens.max()),
            num_draft_host=num_draft,
        ), self.pipeline.device)

    def draft_forward_time(self, ctx_len: int, repeats: int = 10, *,
                           between: Callable[[], object] | None = None, warmup: int = 3,
                           requests: int = 1) -> float:
        """T_draft(1) of the analytic limit for ``requests`` requests at once: one bare
        one-token forward, or, where the method's γ drafts in one compiled graph, what a
        draft costs that way: that graph (a one-token catch-up + γ - 1 steps) / γ, as the
        limit charges γ · T_draft(1). ``between`` runs before each timed first forward
        only: in a step the other γ - 1 follow the drafter's own."""
        g, b = self.config.num_speculative_tokens, requests
        if self.drafter._fused is None or g < 2:
            first = forward_time(self.pipeline, 1, ctx_len, repeats=repeats, between=between, warmup=warmup,
                                 requests=b)
            if between is None or g < 2:
                return first
            rest = forward_time(self.pipeline, 1, ctx_len, repeats=repeats, warmup=warmup, requests=b)
            return (first + (g - 1) * rest) / g
        return self._fused_time(ctx_len, g, repeats, requests=b, between=between, warmup=warmup) / g

    def fused_draft_cost(self, batch_size: int, context_len: int) -> float | None:
        g = self.config.num_speculative_tokens
        if self.drafter._fused is None or g < 2:
            return None
        return self._fused_time(context_len, g, 7, requests=batch_size, stat="min")

    @torch.inference_mode()
    def _fused_time(self, ctx_len: int, gamma: int, repeats: int, *, requests: int = 1,
                    stat: str = "median", between: Callable[[], object] | None = None, warmup: int = 3) -> float:
        """Seconds of the compiled drafting of ``gamma`` tokens (a one-token catch-up, then
        γ - 1 steps) for ``requests`` requests at context ``ctx_len``."""
        with self._fused_args(ctx_len, gamma, requests, unseen=1) as args:
            return time_calls(lambda: self.drafter._fused(*args), self.pipeline.device, repeats=repeats, stat=stat,
                              between=between, warmup=warmup)

    @contextmanager
    def _fused_args(self, ctx_len: int, gamma: int, requests: int, unseen: int) -> Iterator[tuple[Any, ...]]:
        """The compiled drafting's arguments (greedy) for ``requests`` throwaway requests of
        ``ctx_len`` tokens, ``unseen`` of them not yet in the draft cache; freed on exit."""
        # (Its catch-up: the last token's logits only, as the loop's.)
        with bare_batch(self.pipeline, unseen, ctx_len, requests=requests, extra_tokens=gamma - 1,
                        return_n_logits=1) as (ctxs, catch_up):
            b = self._pack_chain(ctxs, catch_up, gamma, [gamma] * requests)
            yield (b.catch_up, b.step_positions, b.step_slots, b.gather_slots,
                   *self.drafter._rows(requests, self.pipeline.device), None, b.first_position)

    @torch.inference_mode()
    def _precompile(self, batched: bool) -> None:
        """Compiles the drafting graphs of one request (``batched``: of several) for every
        kind of catch-up — a whole prompt, one token (after a rejection), several (after
        a full acceptance): each is its own graph, and one compiled in the middle of a
        run would count its compile time as drafting."""
        self._compiled.add(batched)
        g, n = self.config.num_speculative_tokens, 2 if batched else 1
        ctx = min(16, self.pipeline.runtime.max_seq_len)
        try:
            for unseen in (1, 2, ctx):
                with self._fused_args(ctx, g, n, unseen) as args:
                    self.drafter._fused(*args)
        except OutOfBlocks:  # no room for throwaway requests now: the graphs compile when first met
            pass

    def commit(self, ctx: TextContext, num_committed: int) -> None:
        # Keep the fed draft tokens that were accepted (they equal committed tokens);
        # the last committed token is fed next step. A tree's rows are dropped
        # whole: the next catch-up recomputes the accepted path.
        keep = min(ctx.processed(self.cache_name), num_committed - 1)
        base = self._tree_base.pop(ctx.key, None)
        self.pipeline.truncate(ctx, keep if base is None else min(keep, base))

    def free(self, ctx: TextContext) -> None:
        self._tree_base.pop(ctx.key, None)
        self.pipeline.free(ctx)


def _one_token_step(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, gather: torch.Tensor,
                    kv: KVCacheTensors, out_rows: torch.Tensor, logit_rows: torch.Tensor,
                    q_index: torch.Tensor) -> DecoderInputs:
    """One draft token [B] per request at ``positions`` [B], written to KV ``slots`` [B], its
    keys the ``gather`` [B, S] slots through its own: for one request exactly its
    context (no mask needed); a batch masks each request's keys past its own position."""
    b = tokens.shape[0]
    return DecoderInputs(
        tokens=tokens,
        positions=positions,
        slot_mapping=slots,
        # A fresh [B, S] copy: a view's strides (even one `contiguous()` keeps, at B = 1) recompile.
        gather_slots=gather.clone(memory_format=torch.contiguous_format),
        q_index=q_index,
        q_pos=positions.unsqueeze(1),
        out_index=out_rows,
        logit_index=logit_rows,
        kv_cache=kv,
        single_request=b == 1,
        mask=MaskKind.NONE if b == 1 else MaskKind.EXPLICIT,
    )


def _check_same_tokenizer(draft_dir: Path, target_tok: Path) -> None:
    draft_tok = draft_dir / "tokenizer.json"
    if not (draft_tok.is_file() and target_tok.is_file()):
        return
    import json

    dv = json.loads(draft_tok.read_text()).get("model", {}).get("vocab")
    tv = json.loads(target_tok.read_text()).get("model", {}).get("vocab")
    if dv != tv:
        raise ValueError(f"draft tokenizer {draft_tok} differs from the target's {target_tok}")
