"""Speculative decoding's pipeline: the engine's side of a draft-and-verify step.

One step, for a ragged batch of requests (:meth:`SpecDecodePipelineModel._spec_step`;
docs/architecture.md)::

    policy   each request's γ: its cap (gamma_for), adaptive γ's choice (spec/gamma.py),
             or 0 for all: a step of plain decoding
    drafts   proposer.prepare -> DraftBatch (a drafter that drafts after verification
             needs none: its drafts wait in the state store)
    pack     target.prepare -> DecoderInputs with each request's draft rows, sampling tensors
    device   DraftAndVerify (spec/draft_and_verify.py), one module call: drafts, target
             forward, verify/accept, and the next step's drafts (draft-after)
    commit   the one host sync (tokens, accepted, fault; a greedy chain drafted before the
             step: the target's argmax, the drafts and which rows were finite, verified on
             the host); roll both KV caches back past rejected drafts, hand the new tokens
             to the engine

Every device-to-host read of a step goes through :meth:`SpecDecodePipelineModel._read`,
which counts them (``RunStats.host_syncs``): one per step (tests/spec/test_host_syncs.py).
A step of one request packs into reused buffers where they serve (core ``StepBuffers``).

The draft and target batch processors share one :class:`RequestStateStore`
(sampling parameters and seed, drafts waiting for the next step, the proposer's
own state), addressed by slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specdec.core.batch_processor import StepBuffers, step_buffers_serve
from specdec.core.context import RequestFailure, TextContext
from specdec.core.pipeline_model import DecoderPipelineModel, PlainGeneration, non_finite
from specdec.core.state_store import RequestStateStore, StateSpec
from specdec.sampling import slot_sampling
from specdec.spec.draft_and_verify import DraftAndVerify, StepOutput
from specdec.spec.gamma import AdaptiveGamma, GammaPolicyConfig
from specdec.spec.metrics import RunStats, SpecCounts
from specdec.spec.proposers.base import DraftBatch, Proposer
from specdec.spec.verify import describe_fault

__all__ = ["DraftAndVerify", "SpecConfig", "SpecDecodePipelineModel", "StepOutput", "state_specs"]


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings shared by every proposer (from its ProposerConfig)."""

    num_speculative_tokens: int  # γ (the most per step; the method's ProposerConfig); 0 is plain decoding
    gamma_policy: GammaPolicyConfig = GammaPolicyConfig()  # adaptive: pick γ per step


SAMPLING_STATE = (  # written at admission, gathered by slot each sampled step
    StateSpec("seed", torch.long),
    StateSpec("temperature", torch.float32),
    StateSpec("top_k", torch.long),
    StateSpec("top_p", torch.float32, fill=1.0),
)


def state_specs(proposer: Proposer, vocab_size: int) -> list[StateSpec]:
    """Everything the draft and target processors share per request: sampling
    parameters; for a drafter that drafts after verification the drafts waiting
    for the next step (and their distribution, if it samples them); the
    proposer's own state."""
    specs, spec = list(SAMPLING_STATE), proposer.spec
    if spec.drafts_after_verify:
        specs.append(StateSpec("draft_tokens", torch.long, ("max_draft",)))
        if spec.samples_drafts:
            specs.append(StateSpec("draft_probs", torch.float32, ("max_draft", vocab_size)))
        if spec.drafts_trees:  # the trees' shapes too (tokens alone are a chain)
            specs.append(StateSpec("draft_parents", torch.long, ("max_draft",), fill=-1))
            specs.append(StateSpec("draft_num_nodes", torch.long))
    own = proposer.state_specs()
    clash = {s.name for s in own} & {s.name for s in specs}
    if clash:
        raise ValueError(f"proposer {proposer.name!r} declares state the pipeline keeps already: {sorted(clash)}")
    return specs + own


class SpecDecodePipelineModel:
    """Links the draft and target batch processors; the engine's speculative pipeline."""

    def __init__(
        self,
        target: DecoderPipelineModel,
        proposer: Proposer,
        config: SpecConfig,
        *,
        max_seq_len: int,
    ) -> None:
        if target.runtime.data_parallel_degree != 1:
            raise ValueError("speculative decoding runs one replica (data_parallel_degree=1)")
        spec = self.spec = proposer.spec  # read once: a drafter whose cost cannot be derived fails here
        bad = [i for i in spec.target_layers if not 0 <= i <= target.config.num_hidden_layers]
        if bad:
            raise ValueError(f"proposer {proposer.name!r} asks for target layers {bad}; the target has "
                             f"{target.config.num_hidden_layers} (0..{target.config.num_hidden_layers})")
        self.target = target
        self.proposer = proposer
        self.config = config
        self.max_seq_len = max_seq_len
        self.vocab_size = target.config.vocab_size
        self.max_batch_size = target.runtime.max_batch_size  # one state slot each
        self.device = target.device
        self.state = RequestStateStore(
            state_specs(proposer, self.vocab_size),
            max_batch_size=self.max_batch_size,
            dims={"max_draft": max(config.num_speculative_tokens, 1)},
            device=self.device,
        )
        target.attach_state_store(self.state)
        if spec.model is not None:
            spec.model.attach_state_store(self.state)
        # The target decoder class builds the module we call as a submodule.
        self.module = DraftAndVerify(target.build_module(), proposer.drafter,
                                     drafts_after_verify=spec.drafts_after_verify, state=self.state,
                                     tree_facts=spec.tree_facts if spec.drafts_trees else None,
                                     compile_on=self.device if target.runtime.compile else None)
        self.plain = PlainGeneration(target, max_seq_len)  # what a step that drafts nothing runs
        # Per-request bookkeeping is keyed by TextContext.key, unique to each request (request
        # ids are unique only within one engine, and several engines may share this pipeline).
        self.counts: dict[int, tuple[str, SpecCounts]] = {}  # each request's figures since reset_stats
        self.num_target_forwards = 0
        self.num_spec_steps = 0  # _spec_step calls (the step-time breakdown's steps)
        self.num_host_syncs = 0  # device-to-host reads of the draft-and-verify steps (_read)
        # A one-request step's target packing, in reused buffers where they serve.
        rt = target.runtime
        self._one = (StepBuffers(target.caches[0], max_seq_len + config.num_speculative_tokens + 1)
                     if step_buffers_serve(self.device, rt.compile, rt.data_parallel_degree) else None)
        # Drafts waiting in the state store per request (a drafter that drafts after
        # verification): 0 until its first step, and again after a preemption.
        self._ready: dict[int, int] = {}
        self._greedy: dict = {}  # all-greedy sampling tensors per batch size (slot_sampling)
        self.adaptive: AdaptiveGamma | None = None
        if config.gamma_policy.adaptive:
            from specdec.dist.group import current

            # Not measuring steps under torchrun: each rank could then choose another γ.
            self.adaptive = AdaptiveGamma(config.gamma_policy, config.num_speculative_tokens, target=target,
                                          proposer=proposer, measure_steps=not current().distributed)
            self.adaptive.calibrate()  # now, while the KV cache is empty

    # -- statistics ------------------------------------------------------------------
    def stats(self) -> RunStats:
        """Figures since the last :meth:`reset_stats` (definitions: spec/metrics.py)."""
        total = SpecCounts()
        per: dict[str, SpecCounts] = {}
        for rid, c in self.counts.values():
            total.merge(c)
            if rid in per:  # (requests of two engines with one id since reset_stats: merged)
                merged = SpecCounts()
                merged.merge(per[rid])
                merged.merge(c)
                per[rid] = merged
            else:
                per[rid] = c
        ph = dict(self.module.times.seconds)
        return RunStats(counts=total, per_request=per,
                        target_forwards=self.num_target_forwards,
                        draft_time_s=ph["draft_catch_up"] + ph["draft_steps"], target_time_s=ph["target_forward"],
                        phase_s=ph, spec_steps=self.num_spec_steps, host_syncs=self.num_host_syncs)

    def reset_stats(self) -> None:
        self.counts = {}
        self.num_target_forwards = 0
        self.num_spec_steps = 0
        self.num_host_syncs = 0
        self.module.times.reset()

    # -- engine protocol -------------------------------------------------------------
    def unprocessed(self, ctx: TextContext) -> int:
        return len(ctx.tokens) - ctx.processed(self.target.cache_name)

    def gamma_for(self, ctx: TextContext) -> int:
        """γ for this request now: its own or the method's, never past its limits."""
        g = self.config.num_speculative_tokens
        if ctx.num_speculative_tokens is not None:
            g = min(g, ctx.num_speculative_tokens)
        left = ctx.sampling.max_new_tokens - ctx.num_generated - 1  # the bonus token is free
        room = self.max_seq_len - len(ctx.tokens) - 1  # KV slots for the drafts
        if self.spec.node_budget and left > 0:
            # A tree's nodes sit side by side: only its depth adds tokens, so the tokens still
            # wanted bound the depth, not the size (TextContext.append drops any past them).
            return max(0, min(g, room))
        return max(0, min(g, left, room))

    def claim_slot(self, ctx: TextContext) -> bool:
        """Gives ``ctx`` a state slot, if it has none, at its admission; False when none is
        free (every engine on this pipeline draws from them: Engine._admit)."""
        if ctx.slot is None:
            if not self.state.num_free:
                return False
            ctx.slot = self.state.allocate(ctx.request_id)
            sp = ctx.sampling
            for name, value in (("seed", ctx.seed), ("temperature", sp.temperature), ("top_k", sp.top_k), ("top_p", sp.top_p)):
                self.state.tensors[name][ctx.slot] = value
        return True

    def reserve(self, ctx: TextContext, num_new: int) -> None:
        if ctx.slot is None and not self.claim_slot(ctx):  # (admitted by a caller that claims none)
            raise RuntimeError(f"state store full ({self.max_batch_size} slots); cannot admit {ctx.request_id!r}")
        processed = ctx.processed(self.target.cache_name)
        full = processed + num_new == len(ctx.tokens)
        # The target verifies at most the request's own γ drafts; a drafting model drafts
        # the step's largest γ for every request, so its cache needs room for the method's γ.
        g = self.config.num_speculative_tokens if full else 0
        self.target.reserve(ctx, processed + num_new + (self.gamma_for(ctx) if full else 0))
        if self.spec.needs_all_rows:  # it catches up on prefill chunks too, and drafts after each
            self.proposer.reserve(ctx, self.config.num_speculative_tokens)
        elif g:
            self.proposer.reserve(ctx, g)

    def free(self, ctx: TextContext) -> None:
        self.target.free(ctx)
        self.proposer.free(ctx)
        if ctx.done and self.adaptive is not None:
            self.adaptive.forget(ctx.key)
        self._ready.pop(ctx.key, None)  # its drafts go with its slot
        if ctx.slot is not None:
            slot, ctx.slot = ctx.slot, None  # (cleared first: an interrupt here must not release it twice)
            self.state.release(slot)

    # -- capacity, per cache (see GenerationPipeline) ---------------------------------
    def _per_cache(self, target: int, draft: Callable[[DecoderPipelineModel], int]) -> dict[str, int]:
        """``{cache name: blocks}``: ``target`` for the target's cache, ``draft(model)`` for the
        draft model's where a request fills one (a draft model, γ > 0). A draft model's cache
        holds ``proposer.kv_tokens(n, γ)`` for ``n`` tokens: it drafts the method's γ every step."""
        out = {self.target.cache_name: target}
        model = self.spec.model if self.config.num_speculative_tokens > 0 else None
        if model is not None:
            out[model.cache_name] = draft(model)
        return out

    def max_blocks(self, ctx: TextContext) -> dict[str, int]:
        # The target is fed every token but the last, lookahead included (gamma_for).
        last = ctx.max_length(self.max_seq_len) - 1
        if self.spec.node_budget:  # a tree's nodes may run past max_new_tokens (gamma_for)
            last = min(last - 1 + self.config.num_speculative_tokens, self.max_seq_len - 1)
        return self._per_cache(self.target.blocks_for(max(last, 0)), lambda d: d.blocks_for(
            self.proposer.kv_tokens(last, self.config.num_speculative_tokens)))

    def blocks_needed(self, ctx: TextContext) -> dict[str, int]:
        n = len(ctx.tokens)
        return self._per_cache(self.target.blocks_needed(ctx, n + self.gamma_for(ctx)), lambda d: d.blocks_needed(
            ctx, self.proposer.kv_tokens(n, self.config.num_speculative_tokens)))

    def free_blocks(self, replica: int) -> dict[str, int]:
        return self._per_cache(self.target.num_free_blocks(), lambda d: d.num_free_blocks())  # (one replica)

    def total_blocks(self) -> dict[str, int]:
        return self._per_cache(self.target.num_blocks, lambda d: d.num_blocks)

    # -- the step ----------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, batch: list[TextContext], num_new: list[int]) -> list[list[int] | RequestFailure]:
        unprocessed = [self.unprocessed(c) for c in batch]
        if unprocessed == num_new:  # (the usual step: no partial prefill chunk)
            a = self.adaptive
            if a is None or a.step_times is None or max(unprocessed) > 1:
                return self._spec_step(batch, [], unprocessed)
            t = time.perf_counter()  # a decode step: measured for adaptive γ, whole
            out = self._spec_step(batch, [], unprocessed)
            a.record_step(len(batch), time.perf_counter() - t)
            return out
        result: dict[int, list[int] | RequestFailure] = {}
        # Partial prefill chunks: the target sees them, nothing is emitted.
        chunks = [(c, n) for c, n, u in zip(batch, num_new, unprocessed) if n != u]
        spec = [(c, u) for c, n, u in zip(batch, num_new, unprocessed) if n == u]
        for c, _ in chunks:
            result[id(c)] = []
        if spec:
            for (c, _), toks in zip(spec, self._spec_step([c for c, _ in spec], chunks, [u for _, u in spec])):
                result[id(c)] = toks
        elif chunks:
            self._prefill_chunks(chunks)
        return [result[id(c)] for c in batch]

    def _spec_step(self, batch: list[TextContext], chunks: list[tuple[TextContext, int]],
                   unprocessed: list[int]) -> list[list[int] | RequestFailure]:
        """One draft-and-verify step for ``batch`` (``unprocessed``: each request's tokens the
        target has not seen); runs the prefill ``chunks`` too (in the same target forward
        when nothing is drafted, as plain decoding would)."""
        times = self.module.times
        t = time.perf_counter()
        times.prefilling = bool(chunks) or max(unprocessed) > 1  # a step with prompt rows: prefill, whole
        self.num_spec_steps += not times.prefilling
        gammas = self._policy(batch, chunks, times.prefilling)
        gamma, draft = self._drafts(batch, gammas) if gammas is not None else (0, None)
        t = times.lap("draft_prepare", t)
        if gammas is None or (gamma == 0 and not self.spec.drafts_after_verify):
            return self._plain_step(batch, chunks, unprocessed, t)
        args, look, lens = self._pack(batch, chunks, unprocessed, gammas, gamma, draft, t)
        out = self.module(**args)
        self.num_target_forwards += 1
        new = self._commit(batch, out, look, lens, gammas, gamma)
        times.prefilling = False
        return new

    def _policy(self, batch: list[TextContext], chunks: list[tuple[TextContext, int]],
                prefilling: bool) -> list[int] | None:
        """Each request's γ this step; None: adaptive γ runs this batch plain, as it chose to
        last step (AdaptiveGamma.still_plain: neither the model nor the caps are worked out)."""
        a, after = self.adaptive, self.spec.drafts_after_verify
        if a is not None:
            a.step_gamma = 0
            if not chunks and not after and a.still_plain(batch):
                return None
        gammas = [self.gamma_for(c) for c in batch]
        if a is not None and max(gammas) > 0:
            g = a.choose(batch, gammas, prefilling)
            gammas = [min(x, g) for x in gammas]
        if after:  # the drafts the last step left in the store, as many as each request may verify
            gammas = [min(g, self._ready.get(c.key, 0)) for c, g in zip(batch, gammas)]
        return gammas

    def _drafts(self, batch: list[TextContext], gammas: list[int]) -> tuple[int, DraftBatch | None]:
        """The step's γ and draft inputs (a drafter that drafts after verification: none yet)."""
        gamma = max(gammas)
        if gamma == 0 or self.spec.drafts_after_verify:
            return gamma, None
        draft = self.proposer.prepare(batch, gamma, gammas)
        # The proposer may find fewer drafts than asked (n-gram lookups that miss): verify only those.
        gamma = min(gamma, draft.gamma)
        return gamma, draft if gamma else None

    def _pack(self, batch: list[TextContext], chunks: list[tuple[TextContext, int]], unprocessed: list[int],
              gammas: list[int], gamma: int, draft: DraftBatch | None, t: float
              ) -> tuple[dict[str, Any], list[int], list[int]]:
        """The module call's arguments, each request's drafts to verify and its length."""
        times, after = self.module.times, self.spec.drafts_after_verify
        fed, num_tokens, lens = batch, None, [len(c.tokens) for c in batch]
        if chunks and after:  # one forward: the drafter catches up on the chunks' rows too (dropped)
            fed = batch + [c for c, _ in chunks]
            num_tokens = unprocessed + [n for _, n in chunks]
            lens = lens + [c.processed(self.target.cache_name) + n for c, n in chunks]
        elif chunks:
            self._prefill_chunks(chunks)
            t = time.perf_counter()
        one = self._one if len(fed) == 1 and unprocessed[0] == 1 else None  # (a decode step)
        look = [0] * len(fed)
        if gamma and after:
            look = gammas + [0] * (len(fed) - len(batch))
            if one is not None:
                draft = DraftBatch(gamma=gamma, num_draft=one.small("num_draft", look, (1,)),
                                   first_position=one.small("first_position", lens, (1,)))
            else:
                draft = DraftBatch(gamma=gamma, num_draft=torch.tensor(look, device=self.device),
                                   first_position=torch.tensor(lens, device=self.device))
        elif gamma:  # (a proposer's batch carries its drafts' counts on the host, or they are read)
            assert draft is not None
            host = draft.num_draft_host
            look = list(host) if host is not None else self._read(draft.num_draft)
        num_draft = draft.num_draft if draft is not None else torch.zeros(len(fed), dtype=torch.long, device=self.device)
        # Each request verifies only its own drafts (no placeholder rows up to the step's γ).
        if one is not None:
            packed = one.pack(fed[0], 1, lookahead=look[0], return_n_logits=gamma + 1, slot=fed[0].slot)
        else:  # pad: to a CUDA graph's batch size and key width where the runtime records them (not
            # trees, nor a drafter reading every row); DraftAndVerify drops the pad requests' rows
            pad = not (self.spec.node_budget or self.spec.needs_all_rows)
            packed = self.target.prepare(fed, return_n_logits=gamma + 1, lookahead=look, num_tokens=num_tokens,
                                         pad=pad)
        inputs = packed.inputs
        inputs.capture_layers = self.spec.target_layers
        draft_host = None
        if after and self.spec.needs_all_rows:
            inputs.all_hidden = True
            t = times.lap("target_prepare", t)
            draft_host = self.proposer.prepare_after(fed, packed, self.config.num_speculative_tokens)
            t = times.lap("draft_prepare", t)
        sampling = slot_sampling([c.sampling for c in fed], packed.state_slots, self.state.gather, self.device,
                                 self._greedy)
        positions = None
        if not sampling.all_greedy:
            positions = torch.tensor(lens, dtype=torch.long, device=self.device).unsqueeze(1) + torch.arange(
                gamma + 1, device=self.device
            )
        times.lap("target_prepare", t)
        return dict(target_inputs=inputs, draft_index=packed.draft_index, draft=draft, sampling=sampling,
                    num_draft=num_draft, ragged=min(look) < gamma, positions=positions, slots=packed.state_slots,
                    next_gamma=self._next_gamma() if after else 0, draft_host=draft_host), look, lens

    def _commit(self, batch: list[TextContext], out: StepOutput, look: list[int], lens: list[int],
                gammas: list[int], gamma: int) -> list[list[int] | RequestFailure]:
        """The step's one host sync, then per request: its failure (a fault) or its new
        tokens; its counts and adaptive γ's; both KV caches rolled back past rejected drafts."""
        times, after, a = self.module.times, self.spec.drafts_after_verify, self.adaptive
        t = time.perf_counter()
        rows = self._read(out.readout())
        t = times.lap("sync", t)
        new: list[list[int] | RequestFailure] = []
        for c, row, n, ln, g in zip(batch, rows, look, lens, gammas):
            toks, k, fault, depth = out.verdict(row, gamma, n)
            if fault >= 0:  # this request only: the engine ends it and frees what it holds
                what, at = describe_fault(fault)
                new.append(non_finite(c, what, ln + at))
                continue
            self._counts(c).record(n, k, depth=depth)
            new.append(toks[: k + 1])
            if g and a is not None:  # drafts were asked for (found or not); a tree accepted to its depth rejected none
                a.record(c.key, k, k + (k < (g if depth is None else depth)), size=g if self.spec.node_budget else 0)
            # The target was fed through ln + n and keeps the committed tokens but the last
            # (fed next step): only rejected drafts (n > k) roll back.
            if n > k:
                self.target.truncate(c, ln + k)
            if gamma or after:  # (a step that drafted nothing leaves the proposer nothing to forget)
                self.proposer.commit(c, ln + k + 1)
            if after:
                self._ready[c.key] = self._next_gamma()
        times.lap("commit", t)
        return new

    def _next_gamma(self) -> int:
        """Drafts a drafter that drafts after verification leaves for the next step: the
        method's γ, or under adaptive γ the γ chosen for this step (at least 1: the drafter
        still catches up), so a step adaptive γ runs plain does not draft the full γ too."""
        g, a = self.config.num_speculative_tokens, self.adaptive
        return g if a is None else max(1, min(g, a.step_gamma))

    def _read(self, t: torch.Tensor) -> list[Any]:
        """``t.tolist()``: every device-to-host read of a speculative step comes through here,
        counted (``RunStats.host_syncs``; one per step)."""
        self.num_host_syncs += 1
        return t.tolist()

    def _plain_step(self, batch: list[TextContext], chunks: list[tuple[TextContext, int]], unprocessed: list[int],
                    t: float) -> list[list[int] | RequestFailure]:
        """A step that drafts nothing is a step of plain decoding (:class:`PlainGeneration`),
        the batch's and the prefill chunks' rows in one forward: where adaptive γ turns
        speculation off, it costs what plain decoding costs. Timed as ``target_forward``."""
        fed = batch + [c for c, _ in chunks]
        out = self.plain.decode(fed, unprocessed + [n for _, n in chunks])[: len(batch)]
        self.num_target_forwards += 1
        for c, toks in zip(batch, out):
            if not isinstance(toks, RequestFailure):
                self._counts(c).record_plain()
        self.module.times.lap("target_forward", t)
        self.module.times.prefilling = False
        return out

    def _prefill_chunks(self, chunks: list[tuple[TextContext, int]]) -> None:
        t = time.perf_counter()
        self.target.execute(self.target.prepare([c for c, _ in chunks], num_tokens=[n for _, n in chunks]))
        self.num_target_forwards += 1
        self.module.times.lap("prefill", t)

    def _counts(self, ctx: TextContext) -> SpecCounts:
        entry = self.counts.get(ctx.key)
        if entry is None:
            entry = self.counts[ctx.key] = (ctx.request_id, SpecCounts())
        return entry[1]
