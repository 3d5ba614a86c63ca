"""Speculative decoding: the draft-and-verify module and its pipeline model.

One step, for a ragged batch of requests (see docs/architecture.md)::

    host:   proposer.prepare   -> DraftBatch   (draft inputs: positions, KV slots …;
                                                 a drafter that drafts after verification
                                                 needs none: its drafts wait in the store)
            target model       -> DecoderInputs with each request's draft rows, state slots
    device: DraftAndVerify(...)                 one module call
              drafts    -> tree tokens [B, γ] (q [B, γ, V]): drafted now, or read by slot
              target    -> logits (+ hidden states) of the last γ+1 rows of each request
              verify    -> output tokens [B, γ+1], num_accepted [B]
              draft_after (if the drafter drafts after verification) -> next step's
                           drafts, from the target's hidden states, into the store
    host:   read tokens, counts and faults (the one sync), roll both KV caches back
            past rejected tokens, hand the new tokens to the engine

A branching draft tree (``DraftTree.is_chain`` False; specdec/spec/tree.py)
takes the same step: its nodes fill request b's ``num_draft[b]`` placeholder
rows, which then sit at rope position root + depth under
``DecoderInputs.tree_mask``; the tree verifiers pick the accepted path, the
path's target KV entries are compacted into place (so the usual truncation
keeps exactly the committed tokens), and a drafter drafting after
verification reads the path's rows. Chains keep the chain verifiers.

The target module is built by the target decoder class's ``build_module``
and called as a submodule; the draft and target batch processors share one
:class:`RequestStateStore` (sampling parameters and seed, drafts waiting for
the next step, the proposer's own state), addressed by slot.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specdec.core.context import RequestFailure, TextContext
from specdec.core.inputs import DecoderInputs
from specdec.core.pipeline_model import (
    DecoderPipelineModel,
    PlainGeneration,
    compile_function,
    compile_method,
    non_finite,
)
from specdec.core.state_store import RequestStateStore, StateSpec
from specdec.sampling import SamplingTensors, finite_rows, probs_from_logits
from specdec.spec.forward_time import forward_time
from specdec.spec.gamma import CostCurve, GammaPolicyConfig, StepTimes, TargetCost, choose_gamma
from specdec.spec.metrics import PhaseTimes, RunStats, SpecCounts
from specdec.spec.proposers.base import DraftBatch, Drafter, DraftTree, Proposer, TargetStep
from specdec.spec.tree import (
    accepted_slot_moves,
    compact_kv,
    depths,
    packed_tree_mask,
    verify_tree_greedy,
    verify_tree_sampled,
)
from specdec.spec.verify import verify_greedy, verify_sampled


@dataclass
class StepOutput:
    tokens: torch.Tensor  # [B, γ+1] accepted drafts then the recovered/bonus token; -1 past it (tree: [B, D+1])
    num_accepted: torch.Tensor  # [B]
    # [B] -1, or where verification met a non-finite number: 2·i for the target's
    # logits at row i, 2·i + 1 for the draft probabilities of draft i (see _fault;
    # a tree step counts i along the accepted path).
    fault: torch.Tensor
    depth: torch.Tensor | None = None  # [B] a tree step: the depth of each request's tree (None: chains)


def _fault(logits: torch.Tensor, draft_probs: torch.Tensor | None, num_accepted: torch.Tensor,
           num_draft: torch.Tensor) -> torch.Tensor:
    """The first non-finite number verification *used*, per request: -1, 2·i
    (target logits at row i) or 2·i + 1 (draft i's probabilities), [B].

    Rows past the accepted drafts are not used: a draft that drove the target
    non-finite is just rejected (the rows before it never saw it: PagedAttend).
    A greedy drafter's tokens are only proposals (no probabilities to check).
    """
    n = logits.shape[1]  # γ+1
    row = torch.arange(n, device=logits.device)
    used = row <= num_accepted.unsqueeze(1)  # [B, γ+1]
    code = torch.where(used & ~finite_rows(logits), 2 * row, 2 * n)  # [B, γ+1]
    if draft_probs is not None:
        g = draft_probs.shape[1]
        drafted = used[:, :g] & (row[:g] < num_draft.unsqueeze(1))  # [B, γ]
        code = torch.cat([code, torch.where(drafted & ~finite_rows(draft_probs), 2 * row[:g] + 1, 2 * n)], 1)
    first = code.amin(1)  # [B]
    return torch.where(first < 2 * n, first, -1)


def _tree_fault(logits: torch.Tensor, draft_probs: torch.Tensor | None, path: torch.Tensor,
                num_accepted: torch.Tensor) -> torch.Tensor:
    """:func:`_fault` of a tree step: only the rows on each request's accepted
    path were used (``path [B, D+1]``, TreeVerdict.path), and the draft
    probabilities of its accepted nodes; ``i`` counts along the path."""
    d1 = path.shape[1]
    row = torch.arange(d1, device=logits.device)
    on = path.clamp(min=0)
    used = row <= num_accepted.unsqueeze(1)  # [B, D+1]
    bad = ~finite_rows(logits).gather(1, on)  # [B, D+1]
    code = torch.where(used & bad, 2 * row, 2 * d1)
    if draft_probs is not None and d1 > 1:
        node = (on[:, 1:] - 1).clamp(min=0)  # [B, D] accepted nodes
        bad_q = ~finite_rows(draft_probs).gather(1, node)
        acc = row[: d1 - 1] < num_accepted.unsqueeze(1)
        code = torch.cat([code, torch.where(acc & bad_q, 2 * row[: d1 - 1] + 1, 2 * d1)], 1)
    first = code.amin(1)
    return torch.where(first < 2 * d1, first, -1)


def _verify_sampled_chain(logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                          sampling: SamplingTensors, num_draft: torch.Tensor, positions: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sampled chain's verification from the target's ``logits`` [B, γ+1, V] ->
    (tokens [B, γ+1], num_accepted [B], fault [B]): the target's distribution, the accept
    tests, the recovered and bonus draws (verify.verify_sampled) and :func:`_fault`.
    Tensors in (and the sampling flags): compiled, a few dozen eager ops over [B, γ+1, V]
    become one graph (built-in pair, batch 1, γ = 4: 2.3 ms a step eager)."""
    out, acc = verify_sampled(draft_tokens=draft_tokens, draft_probs=draft_probs,
                              target_probs=probs_from_logits(logits, sampling), num_draft=num_draft,
                              seeds=sampling.seeds, positions=positions)
    return out, acc, _fault(logits, draft_probs, acc, num_draft)


def _verify_greedy_chain(logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                         num_draft: torch.Tensor, ragged: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy chain's verification (verify.verify_greedy; ``ragged``: requests have fewer
    drafts than the step's γ) and :func:`_fault`, as :func:`_verify_sampled_chain`. Compiled,
    its ~15 small eager ops are one graph: they took 0.41 ms of a 7.9 ms compiled step
    (built-in pair, batch 1, γ = 4)."""
    out, acc = verify_greedy(draft_tokens=draft_tokens, target_logits=logits, num_draft=num_draft if ragged else None)
    return out, acc, _fault(logits, draft_probs, acc, num_draft)


def _verify_chain(logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                  sampling: SamplingTensors, num_draft: torch.Tensor, ragged: bool, positions: torch.Tensor | None,
                  *, greedy: Callable[..., Any] = _verify_greedy_chain,
                  sampled: Callable[..., Any] = _verify_sampled_chain
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chain's verification, greedy or sampled (``greedy`` / ``sampled``: those
    functions, or their compiled graphs) -> (tokens [B, γ+1], num_accepted [B], fault [B])."""
    if sampling.all_greedy:  # (not ragged: every request has the step's γ drafts, no per-request cut)
        return greedy(logits, draft_tokens, draft_probs, num_draft, ragged)
    assert positions is not None
    return sampled(logits, draft_tokens, draft_probs, sampling, num_draft, positions)


class DraftAndVerify(nn.Module):
    """One speculative step in one call. ``target`` and ``drafter`` are submodules.

    Order: (1) this step's drafts — drafted now from tokens, or, for a drafter
    that drafts after verification, read from the state store where the last
    step left them; (2) the target verifies them; (3) accept on the device;
    (4) a drafter that drafts after verification drafts the next step's tree
    from the target's hidden states of this forward and leaves it in the store.
    """

    def __init__(self, target: nn.Module, drafter: Drafter, *, drafts_after_verify: bool,
                 state: RequestStateStore, tree_facts: tuple[int | None, int | None] | None = None,
                 compile_on: torch.device | None = None) -> None:
        super().__init__()
        # ``compile_on`` (runtime.compile): a chain's verification runs as one compiled graph,
        # unless the target's forward is one C++ call (LlamaDecoder.runs_natively): then the
        # call's dynamo guards and wrappers cost more than the few eager ops they replace
        # (built-in pair, batch 1: 0.63 ms a step compiled).
        native = getattr(target, "runs_natively", False)
        compile_verify = compile_on if not native else None
        self.verify_sampled_chain = (compile_function(_verify_sampled_chain, compile_verify)
                                     if compile_verify is not None else _verify_sampled_chain)
        self.verify_greedy_chain = (compile_function(_verify_greedy_chain, compile_verify)
                                    if compile_verify is not None else _verify_greedy_chain)
        self.target = target
        self.drafter = drafter
        self.drafts_after_verify = drafts_after_verify
        # ... and a one-request step verifying a chain drafted before it (nothing reads the
        # target's hidden states after the forward) runs the target's forward and that
        # verification as one graph: one compiled call, not two. (Built-in pair, batch 1,
        # γ = 4: the separate verification call took 0.35 ms of a 7-9 ms step, 0.13 when
        # repeated at once: most of it was the call itself, run cold after the forward.)
        # One request only: each graph of this function holds the whole target, compiled
        # again for every shape kind a batch meets (mask kinds, attention groups, ragged
        # drafts), which the target's own graphs share with plain and prefill steps. Fused
        # at every batch size, an n-gram's first batch-4 pass compiled for 385 s, not 101.
        # (Not for a target whose layers run as one C++ call: see LlamaDecoder.runs_natively.)
        self.target_verify_chain = (compile_method(self, type(self)._target_verify_chain, compile_on)
                                    if compile_on is not None and not drafts_after_verify and not native else None)
        # Compiled on a CPU, a chain drafted before the step is verified by a target forward
        # that does not hide each row's non-finite new keys from the rows before it
        # (DecoderInputs.isolate_rows: the built-in target's bare 5-token compiled forward
        # took 1.98 ms without it against 2.11 with it at batch 1, 5.35 against 5.54 for 4
        # requests; medians of 14 paired rounds), and again with it when any request's verification
        # read a non-finite number (its fault): where none did, every row a request uses is
        # bit for bit the hidden one (a masked key that is finite adds an exact zero; one that
        # is not either leaves a row it reaches non-finite, which its verification reads as a
        # fault if the row is used, or is not read at all). Nothing else reads that forward:
        # the drafter drafted before it, rejected rows' keys are rolled back. (An eager CPU
        # forward checks its own final states.)
        self.recheck_rows = (compile_on is not None and compile_on.type == "cpu" and not drafts_after_verify)
        # A drafter that drafts trees after verification: (max_depth, max_children)
        # of its trees (host facts); the store keeps their parents and node counts.
        self.tree_facts = tree_facts
        self.state = state
        self.times = PhaseTimes()  # host clock per step phase (spec/metrics.py); the pipeline laps its own

    def _target_verify_chain(self, inputs: DecoderInputs, draft_tokens: torch.Tensor,
                             draft_probs: torch.Tensor | None, sampling: SamplingTensors, num_draft: torch.Tensor,
                             ragged: bool, positions: torch.Tensor | None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The target's forward on ``inputs``, then a chain's verification (as
        :meth:`forward`'s unfused path): written for ``torch.compile`` to take whole."""
        out = self.target(inputs)
        logits = out.logits.view(num_draft.shape[0], -1, out.logits.shape[-1])  # [B, γ+1, V]
        return _verify_chain(logits, draft_tokens, draft_probs, sampling, num_draft, ragged, positions)

    def _drafts(self, draft: DraftBatch, sampling: SamplingTensors, slots: torch.Tensor | None) -> DraftTree:
        if not self.drafts_after_verify:
            return self.drafter(draft, sampling)
        assert slots is not None
        g = draft.gamma
        # (A greedy step reads no probabilities: a slot's are stale when its last sampled step was another request's.)
        sampled = "draft_probs" in self.state.tensors and not sampling.all_greedy
        probs = self.state.gather("draft_probs", slots)[:, :g] if sampled else None
        tokens = self.state.gather("draft_tokens", slots)[:, :g]
        if self.tree_facts is None:
            return DraftTree.chain(tokens, probs)
        # A prefix of each stored tree is a tree (parents first): _place_tree cuts it to num_draft.
        max_depth, max_children = self.tree_facts
        return DraftTree(tokens=tokens, parents=self.state.gather("draft_parents", slots)[:, :g], probs=probs,
                         is_chain=False, num_nodes=self.state.gather("draft_num_nodes", slots),
                         max_depth=max_depth, max_children=max_children)

    def forward(
        self,
        *,
        target_inputs: DecoderInputs,  # packed; γ placeholder rows per request (its tokens field gets the drafts)
        draft_index: torch.Tensor | None,  # [B, γ] packed rows of the placeholders (padded: see _pack)
        draft: DraftBatch | None,  # None: no drafts this step
        sampling: SamplingTensors,
        num_draft: torch.Tensor,  # [B] drafts each request really proposes
        ragged: bool,  # some request has fewer than γ drafts (its draft_index is padded)
        positions: torch.Tensor | None,  # [B, γ+1] sequence position of each emitted token (sampling only)
        slots: torch.Tensor | None,  # [B] state-store slots
        next_gamma: int = 0,  # drafts to leave for the next step (a drafter that drafts after verification)
        draft_host: object = None,  # the proposer's prepare_after packing (TargetStep.host)
    ) -> StepOutput:
        t = time.perf_counter()
        times = self.times
        b = num_draft.shape[0]
        tree: DraftTree | None = None
        if draft is not None and draft.gamma > 0:
            tree = self._drafts(draft, sampling, slots)
            draft_tokens, draft_probs = tree.tokens, tree.probs  # [B, γ], [B, γ, V] | None
            # Request r has num_draft[r] placeholder rows; its draft_index past
            # them points at its last real row, which gets its own token back.
            idx = draft_index.reshape(-1)
            values = draft_tokens.reshape(-1)
            if ragged:
                real = (torch.arange(draft.gamma, device=idx.device) < num_draft.unsqueeze(1)).reshape(-1)
                values = torch.where(real, values, target_inputs.tokens.index_select(0, idx))
            target_inputs.tokens = target_inputs.tokens.index_put((idx,), values)
        else:
            draft_tokens = torch.zeros(b, 0, dtype=torch.long, device=num_draft.device)
            draft_probs = None
        branching = tree is not None and not tree.is_chain
        nodes = None
        if branching:
            assert tree is not None and draft is not None
            nodes, node_depths = self._place_tree(target_inputs, tree, draft.gamma, draft_index, num_draft)
        t = self._draft_laps(t)
        recheck = self.recheck_rows and not branching
        target_inputs.isolate_rows = not recheck
        if self.target_verify_chain is not None and not branching and target_inputs.single_request:
            # (Compiled: verification runs in the target's graph; its time is target_forward's.)
            args = (draft_tokens, draft_probs, sampling, num_draft, ragged, positions)
            out, acc, fault = self.target_verify_chain(target_inputs, *args)
            if recheck and bool((fault >= 0).any()):
                target_inputs.isolate_rows = True
                out, acc, fault = self.target_verify_chain(target_inputs, *args)
            times.lap("target_forward", t)
            return StepOutput(tokens=out, num_accepted=acc, fault=fault)
        target_out = self.target(target_inputs)
        t = times.lap("target_forward", t)
        logits = target_out.logits.view(b, -1, target_out.logits.shape[-1])  # [B, γ+1, V]
        path = depth = None
        if branching:
            assert tree is not None
            out, acc, path, depth = self._verify_tree(target_inputs, tree, nodes, node_depths, logits, sampling,
                                                      positions)
            fault = _tree_fault(logits, draft_probs, path, acc)
        else:
            def verify(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                return _verify_chain(logits, draft_tokens, draft_probs, sampling, num_draft, ragged, positions,
                                     greedy=self.verify_greedy_chain, sampled=self.verify_sampled_chain)

            out, acc, fault = verify(logits)
            if recheck and bool((fault >= 0).any()):  # (rare: counted as verification)
                target_inputs.isolate_rows = True
                target_out = self.target(target_inputs)
                out, acc, fault = verify(target_out.logits.view(b, -1, target_out.logits.shape[-1]))
        t = times.lap("verify", t)
        if self.drafts_after_verify and next_gamma > 0:
            assert slots is not None
            aux = target_out.aux_hidden_states
            logit_rows = target_inputs.logit_index.view(b, logits.shape[1])  # [B, γ+1] packed rows
            hidden = target_out.hidden_states.view(b, logits.shape[1], -1)
            aux_hidden = aux.view(b, logits.shape[1], -1) if aux is not None else None
            bonus_at = acc.unsqueeze(1)  # [B, 1] row (of the verified ones) that produced the bonus
            path_rows = None
            if path is not None:  # a tree: row j of the step is the j-th row of the accepted path
                path_rows = torch.where(path >= 0, logit_rows.gather(1, path.clamp(min=0)), -1)
                on = path.clamp(min=0).unsqueeze(-1)
                hidden = hidden.gather(1, on.expand(-1, -1, hidden.shape[-1]))
                if aux_hidden is not None:
                    aux_hidden = aux_hidden.gather(1, on.expand(-1, -1, aux_hidden.shape[-1]))
                bonus_at = path.gather(1, bonus_at)
            step = TargetStep(
                tokens=out,
                num_accepted=acc,
                hidden=hidden,
                aux_hidden=aux_hidden,
                first_position=target_inputs.positions.index_select(0, logit_rows[:, 0]),
                slots=slots,
                state=self.state,
                bonus_row=logit_rows.gather(1, bonus_at).squeeze(1),
                rows=target_out.row_hidden_states,
                aux_rows=target_out.row_aux_hidden_states,
                inputs=target_inputs if target_inputs.all_hidden else None,
                host=draft_host,
                path=path_rows,
            )
            nxt = self.drafter.draft_after(step, next_gamma, sampling)
            self.state.tensors["draft_tokens"][slots, :next_gamma] = nxt.tokens
            if self.tree_facts is not None:
                self.state.tensors["draft_parents"][slots, :next_gamma] = nxt.parents
                nodes = nxt.num_nodes if nxt.num_nodes is not None else torch.full_like(slots, next_gamma)
                self.state.tensors["draft_num_nodes"][slots] = nodes
            if nxt.probs is not None:
                self.state.tensors["draft_probs"][slots, :next_gamma] = nxt.probs
            self._draft_laps(t)
        return StepOutput(tokens=out, num_accepted=acc, fault=fault, depth=depth)

    def _draft_laps(self, t: float) -> float:
        """Laps the drafting since ``t``: to its catch-up forward's end (when the drafter
        marked one), ``draft_catch_up``, the rest ``draft_steps``; returns now."""
        c = self.drafter.caught_up_at
        if c is not None and c >= t:
            self.times.add("draft_catch_up", c - t)
            t = c
        self.drafter.caught_up_at = None
        return self.times.lap("draft_steps", t)

    # -- token trees (specdec/spec/tree.py) --------------------------------------------
    @staticmethod
    def _place_tree(inputs: DecoderInputs, tree: DraftTree, n: int, draft_index: torch.Tensor,
                    num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sets a tree step's rope positions (root + depth) and ``tree_mask``;
        the node tokens are in place already. Request ``b`` feeds ``num_draft[b]``
        node rows (its tree cut to that prefix); returns its real nodes [B] and
        the nodes' depths [B, N]."""
        nodes = num_draft if tree.num_nodes is None else torch.minimum(tree.num_nodes, num_draft)
        root_row = inputs.logit_index.view(-1, n + 1)[:, 0]  # [B] packed row of each root
        dep = depths(tree.parents, nodes)  # [B, N]; padding 0: its row (or the root's) keeps the root's position
        root_pos = inputs.positions.index_select(0, root_row)  # [B]
        inputs.positions = inputs.positions.index_put((draft_index.reshape(-1),),
                                                      (root_pos.unsqueeze(1) + dep).reshape(-1))
        # The root's index among its request's rows: rows before it are plain (a prompt).
        inputs.attention_groups = None  # (a tree mask spans the whole batch's [B, Q])
        inputs.tree_mask = packed_tree_mask(tree.parents, nodes, root_row - inputs.q_index[:, 0],
                                            inputs.q_index.shape[1])
        return nodes, dep

    @staticmethod
    def _verify_tree(inputs: DecoderInputs, tree: DraftTree, nodes: torch.Tensor, node_depths: torch.Tensor,
                     logits: torch.Tensor, sampling: SamplingTensors, positions: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Verifies a tree, then moves the accepted path's target KV entries into
        place (the caller truncates past it) -> tokens [B, D+1], num_accepted,
        path [B, D+1] (rows: 0 root, i+1 node i), depth [B] of each tree."""
        b, n1 = logits.shape[:2]
        d = min(tree.max_depth if tree.max_depth is not None else n1 - 1, n1 - 1)
        if sampling.all_greedy:
            v = verify_tree_greedy(tokens=tree.tokens, parents=tree.parents, num_nodes=nodes,
                                   target_logits=logits, max_depth=d)
        else:
            assert positions is not None
            v = verify_tree_sampled(tokens=tree.tokens, parents=tree.parents, num_nodes=nodes,
                                    target_probs=probs_from_logits(logits, sampling), draft_probs=tree.probs,
                                    seeds=sampling.seeds, positions=positions[:, 0], max_depth=d,
                                    max_children=tree.max_children)
        assert inputs.kv_cache is not None
        row_slots = inputs.slot_mapping.index_select(0, inputs.logit_index).view(b, n1)  # [B, N+1]
        src, dst = accepted_slot_moves(v.path, row_slots)
        compact_kv(inputs.kv_cache, src, dst)
        depth = node_depths.amax(1) if tree.parents.shape[1] else nodes
        return v.tokens, v.num_accepted, v.path, depth


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
    specs = list(SAMPLING_STATE)
    if proposer.drafts_after_verify:
        specs.append(StateSpec("draft_tokens", torch.long, ("max_draft",)))
        if proposer.samples_drafts:
            specs.append(StateSpec("draft_probs", torch.float32, ("max_draft", vocab_size)))
        if proposer.drafts_trees:  # the trees' shapes too (tokens alone are a chain)
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
        bad = [i for i in proposer.target_layers if not 0 <= i <= target.config.num_hidden_layers]
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
        if proposer.draft_model is not None:
            proposer.draft_model.attach_state_store(self.state)
        # The target decoder class builds the module we call as a submodule.
        self.module = DraftAndVerify(target.build_module(), proposer.drafter,
                                     drafts_after_verify=proposer.drafts_after_verify, state=self.state,
                                     tree_facts=proposer.tree_facts if proposer.drafts_trees else None,
                                     compile_on=self.device if target.runtime.compile else None)
        self.plain = PlainGeneration(target, max_seq_len)  # what a step that drafts nothing runs
        # Per-request bookkeeping is keyed by TextContext.key, unique to each request:
        # request ids are unique only within one engine, and several engines (open
        # streams, generate calls) may share this pipeline with the same ids.
        # Each request's figures since reset_stats (stats() lists them by request id).
        self.counts: dict[int, tuple[str, SpecCounts]] = {}
        self.num_target_forwards = 0
        self.num_spec_steps = 0  # _spec_step calls (the step-time breakdown's steps)
        # Drafts waiting in the state store per request (a drafter that drafts
        # after verification): 0 until the request's first step, and again
        # after a preemption (its slot, and so its drafts, were released).
        self._ready: dict[int, int] = {}
        # Adaptive γ's running acceptance, per live request: [accepted, drafts tried]
        # (spec/gamma.py: a step that accepts k of γ tried k + 1, or k if k = γ).
        self._running: dict[int, list[int]] = {}
        self._drafter_running = [0, 0]  # the same over every request so far (adaptive γ's prior)
        self._curves: tuple[TargetCost, CostCurve] | None = None
        self._catch_up: CostCurve | None = None  # seconds for the drafter to read n unseen tokens
        self._full_gamma: tuple[int, CostCurve] | None = None  # (method γ, T_draft(B) there) when it differs
        # The batch adaptive γ last ran plain and the drafter's counts then: _still_plain.
        self._plain_for: tuple[list[TextContext], tuple[int, ...]] | None = None
        # Decode steps' measured times by (batch size, γ chosen), for adaptive γ (gamma.StepTimes).
        # Not under torchrun: each rank would measure its own and could choose another γ.
        from specdec.dist.group import current

        self.step_times = StepTimes() if config.gamma_policy.adaptive and not current().distributed else None
        self._step_gamma = 0  # the γ adaptive γ chose for the step under way
        self._greedy: dict[int, SamplingTensors] = {}  # all-greedy sampling tensors per batch size
        if config.gamma_policy.adaptive:  # calibrate now, while the KV cache is empty
            self._cost_curves()

    # -- statistics ------------------------------------------------------------------
    @property
    def draft_model(self) -> DecoderPipelineModel | None:
        """The draft decoder (T_draft(1) of the analytic limit); None for model-free methods."""
        return self.proposer.draft_model

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
                        phase_s=ph, spec_steps=self.num_spec_steps)

    def reset_stats(self) -> None:
        self.counts = {}
        self.num_target_forwards = 0
        self.num_spec_steps = 0
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
        if self.proposer.node_budget and left > 0:
            # A tree's nodes sit side by side: only its depth adds tokens, so the tokens
            # still wanted bound the depth, not the size (what a path accepts past
            # max_new_tokens is dropped by TextContext.append). Cutting the node budget
            # to them instead shrank every request's last trees.
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
        # The target verifies at most the request's own γ drafts; a drafting
        # model drafts the step's largest γ for every request, so its cache
        # needs room for the method's γ.
        g = self.config.num_speculative_tokens if full else 0
        self.target.reserve(ctx, processed + num_new + (self.gamma_for(ctx) if full else 0))
        if self.proposer.needs_all_rows:  # it catches up on prefill chunks too, and drafts after each
            self.proposer.reserve(ctx, self.config.num_speculative_tokens)
        elif g:
            self.proposer.reserve(ctx, g)

    def free(self, ctx: TextContext) -> None:
        self.target.free(ctx)
        self.proposer.free(ctx)
        if ctx.done:
            self._running.pop(ctx.key, None)
        self._ready.pop(ctx.key, None)  # its drafts go with its slot
        if ctx.slot is not None:
            slot, ctx.slot = ctx.slot, None  # (cleared first: an interrupt here must not release it twice)
            self.state.release(slot)

    # -- capacity, per cache (see GenerationPipeline) ---------------------------------
    def _draft_tokens(self, num_tokens: int) -> int:
        """What the draft model's cache holds for a request of ``num_tokens`` tokens in a drafting step."""
        return self.proposer.kv_tokens(num_tokens, self.config.num_speculative_tokens)

    def _draft_cache(self) -> DecoderPipelineModel | None:
        """The draft model whose cache a request fills (None: model-free, or γ = 0)."""
        return self.proposer.draft_model if self.config.num_speculative_tokens > 0 else None

    def max_blocks(self, ctx: TextContext) -> dict[str, int]:
        # The target is fed every token but the last, lookahead included: γ never
        # runs past max_new_tokens or max_seq_len (gamma_for). The draft model
        # catches up and drafts the method's γ in every step.
        last = ctx.max_length(self.max_seq_len) - 1
        if self.proposer.node_budget:  # a tree's nodes may run past max_new_tokens (gamma_for)
            last = min(last - 1 + self.config.num_speculative_tokens, self.max_seq_len - 1)
        out = {self.target.cache_name: self.target.blocks_for(max(last, 0))}
        draft = self._draft_cache()
        if draft is not None:
            out[draft.cache_name] = draft.blocks_for(self._draft_tokens(last))
        return out

    def blocks_needed(self, ctx: TextContext) -> dict[str, int]:
        n = len(ctx.tokens)
        out = {self.target.cache_name: self.target.blocks_needed(ctx, n + self.gamma_for(ctx))}
        draft = self._draft_cache()
        if draft is not None:
            out[draft.cache_name] = draft.blocks_needed(ctx, self._draft_tokens(n))
        return out

    def free_blocks(self, replica: int) -> dict[str, int]:
        out = {self.target.cache_name: self.target.num_free_blocks()}  # (one replica)
        draft = self._draft_cache()
        if draft is not None:
            out[draft.cache_name] = draft.num_free_blocks()
        return out

    def total_blocks(self) -> dict[str, int]:
        out = {self.target.cache_name: self.target.num_blocks}
        draft = self._draft_cache()
        if draft is not None:
            out[draft.cache_name] = draft.num_blocks
        return out

    def _sampling(self, batch: list[TextContext], slots: torch.Tensor | None) -> SamplingTensors:
        temps = [c.sampling.temperature for c in batch]
        if all(t == 0 for t in temps):  # greedy reads no sampling tensor: skip the gathers
            greedy = self._greedy.get(len(batch))
            if greedy is None:  # made once per batch size (nothing writes to them)
                z = torch.zeros(len(batch), device=self.device)
                zl = torch.zeros(len(batch), dtype=torch.long, device=self.device)
                greedy = self._greedy[len(batch)] = SamplingTensors(
                    temperature=z, top_k=zl, top_p=z, seeds=zl, all_greedy=True,
                    any_greedy=True, any_top_k=False, any_top_p=False)
            return greedy
        assert slots is not None
        g = self.state.gather
        return SamplingTensors(
            temperature=g("temperature", slots),
            top_k=g("top_k", slots),
            top_p=g("top_p", slots),
            seeds=g("seed", slots),
            all_greedy=all(t == 0 for t in temps),
            any_greedy=any(t == 0 for t in temps),
            any_top_k=any(c.sampling.top_k > 0 for c in batch),
            any_top_p=any(c.sampling.top_p < 1.0 for c in batch),
        )

    @torch.inference_mode()
    def step(self, batch: list[TextContext], num_new: list[int]) -> list[list[int] | RequestFailure]:
        unprocessed = [self.unprocessed(c) for c in batch]
        if unprocessed == num_new:  # (the usual step: no partial prefill chunk)
            if self.step_times is None or max(unprocessed) > 1:
                return self._spec_step(batch, [], unprocessed)
            t = time.perf_counter()  # a decode step: measured for adaptive γ, whole
            out = self._spec_step(batch, [], unprocessed)
            self.step_times.record(len(batch), self._step_gamma, time.perf_counter() - t)
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

    def _prefill_chunks(self, chunks: list[tuple[TextContext, int]]) -> None:
        t = time.perf_counter()
        self.target.execute(self.target.prepare([c for c, _ in chunks], num_tokens=[n for _, n in chunks]))
        self.num_target_forwards += 1
        self.module.times.lap("prefill", t)

    def _cost_curves(self) -> tuple[TargetCost, CostCurve]:
        """T_target(B requests, n tokens each) and T_draft(B) from a short calibration (first use)."""
        if self._curves is None:
            rt = self.target.runtime
            g = self.config.num_speculative_tokens
            bpts = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < rt.max_batch_size] + [rt.max_batch_size]
            ctx = min(128, rt.max_seq_len - 1)
            # By turns (TargetCost.measure): 4 rounds of (1 untimed, 2 timed) forwards per n.
            tt = TargetCost.measure(lambda b, n: forward_time(self.target, n, max(ctx, n), repeats=2, stat="min",
                                                              requests=b, warmup=1), bpts, g + 1, rounds=4)
            td = CostCurve(lambda b: self.proposer.draft_cost(b, ctx), bpts)
            # A compiled drafter's full γ runs its steps as one graph: per draft, that
            # cost / γ, cheaper than T_draft(B) (gamma.choose_gamma).
            fused = {b: self.proposer.fused_draft_cost(b, ctx) for b in bpts}
            fc = (CostCurve(lambda b: (fused[b] or 0.0) / g, bpts) if None not in fused.values() else None)
            # A drafter's one-time read of a prompt it has not seen (one request, n tokens).
            npts = sorted({min(n, rt.max_seq_len - 1) for n in (16, 64, 256, 1024)})
            tc = CostCurve(self.proposer.catch_up_cost, npts)
            # Under torchrun every rank must pick the same γ (tensor-parallel ranks run
            # each step's forwards together): all take rank 0's measured curves.
            from specdec.dist.group import current

            curves = tt.curves
            times, td.times, tc.times, full_times = current().broadcast_object(
                ([c.times for c in curves], td.times, tc.times, fc and fc.times))
            for c, ts in zip(curves, times):
                c.times = ts
            if fc is not None:
                fc.times = full_times
            self._curves = (tt, td)
            self._catch_up = tc
            self._full_gamma = (g, fc) if fc is not None else None
        return self._curves

    def _policy_gamma(self, batch: list[TextContext], gammas: list[int]) -> int:
        pol = self.config.gamma_policy
        seen = tuple(self._drafter_running)
        if self._still_plain(batch):
            return 0
        accept = [pol.acceptance(tuple(self._running.get(c.key, (0, 0))), seen) for c in batch]
        tt, td = self._cost_curves()
        # Unseen tokens past a step's own catch-up (γ + 1 at most) are a one-time cost
        # (only a drafter that reads them has a catch-up curve above zero).
        catch_up = 0.0
        if self._catch_up is not None and self._catch_up.times[-1] > 0:
            extra = sum(u for u in map(self.proposer.unseen_tokens, batch) if u > max(gammas) + 1)
            catch_up = self._catch_up(extra) if extra else 0.0
        remaining = sum(max(1, c.sampling.max_new_tokens - c.num_generated) for c in batch)
        g = choose_gamma(accept, max(gammas), tt, td, pol.min_gain, catch_up_s=catch_up, remaining_tokens=remaining,
                         fused=self._full_gamma, measured=self.step_times.ratio if self.step_times else None)
        g = pol.explore(g, max(gammas), seen[1])
        self._plain_for = (list(batch), seen) if g == 0 else None
        return g

    def _still_plain(self, batch: list[TextContext]) -> bool:
        """Whether adaptive γ chose plain decoding for this very batch (the same request
        objects, not just their ids) and nothing it read has changed since: a step that
        drafts nothing changes no acceptance, and its tokens only add to what a drafter
        has not read (a larger catch-up) over fewer remaining tokens; each request's γ cap
        (:meth:`gamma_for`) only shrinks, which only takes choices away. So the model is
        skipped then (at batch 16-64 it cost about 1% of a compiled step), and so are the
        per-request caps."""
        last = self._plain_for
        return (last is not None and len(last[0]) == len(batch) and all(map(operator.is_, last[0], batch))
                and last[1] == tuple(self._drafter_running))

    def _plain_step(self, batch: list[TextContext], chunks: list[tuple[TextContext, int]], unprocessed: list[int],
                    t: float) -> list[list[int] | RequestFailure]:
        """A step that drafts nothing is a step of plain decoding (:class:`PlainGeneration`:
        the same forward, sampling and checks, none of the verification's bookkeeping), the
        batch's and the prefill chunks' rows in one forward. Adaptive γ turns speculation
        off this way where it cannot pay (large batches), so there it costs what plain
        decoding costs. Its time is the step's ``target_forward``."""
        fed = batch + [c for c, _ in chunks]
        out = self.plain.decode(fed, unprocessed + [n for _, n in chunks])[: len(batch)]
        self.num_target_forwards += 1
        for c, toks in zip(batch, out):
            if not isinstance(toks, RequestFailure):
                self._counts(c).record_plain()
        self.module.times.lap("target_forward", t)
        self.module.times.prefilling = False
        return out

    def _counts(self, ctx: TextContext) -> SpecCounts:
        entry = self.counts.get(ctx.key)
        if entry is None:
            entry = self.counts[ctx.key] = (ctx.request_id, SpecCounts())
        return entry[1]

    def _spec_step(self, batch: list[TextContext], chunks: list[tuple[TextContext, int]],
                   unprocessed: list[int]) -> list[list[int] | RequestFailure]:
        """One draft-and-verify step for ``batch`` (``unprocessed``: each request's tokens the
        target has not seen); runs the prefill ``chunks`` too (in the same target forward
        when nothing is drafted, as plain decoding would)."""
        times = self.module.times
        t = time.perf_counter()
        # A step with prompt rows (first steps, chunks) is timed as prefill, whole.
        times.prefilling = bool(chunks) or max(unprocessed) > 1
        self.num_spec_steps += not times.prefilling
        self._step_gamma = 0
        if (not chunks and self.config.gamma_policy.adaptive and not self.proposer.drafts_after_verify
                and self._still_plain(batch)):
            return self._plain_step(batch, chunks, unprocessed, times.lap("draft_prepare", t))
        gammas = [self.gamma_for(c) for c in batch]
        if self.config.gamma_policy.adaptive and max(gammas) > 0:
            # At batch > 1, a step that carries prompt rows decodes plain: drafting in it
            # gains a token or two for some rows but throws the requests out of step with
            # each other, so later prompts land in mixed steps and the run ends in part-full
            # batches (the 2026-12-07 A/B in gamma.py: n-gram at batch 4, 0.976 -> 0.986 of
            # plain decoding). Drafters that draft after verifying keep their drafts.
            mixed = times.prefilling and len(batch) > 1 and not self.proposer.drafts_after_verify
            g = self._step_gamma = 0 if mixed else self._policy_gamma(batch, gammas)
            gammas = [min(x, g) for x in gammas]
        lens = [len(c.tokens) for c in batch]
        after = self.proposer.drafts_after_verify
        if after:  # the drafts the last step left in the store, as many as each request may verify
            gammas = [min(g, self._ready.get(c.key, 0)) for c, g in zip(batch, gammas)]
        gamma = max(gammas)
        draft: DraftBatch | None = None
        if gamma and not after:
            draft = self.proposer.prepare(batch, gamma, gammas)
            if draft.gamma < gamma:
                # The proposer found fewer drafts than asked (n-gram lookups that
                # miss): verify only those, not γ placeholder rows.
                gamma = draft.gamma
                draft = draft if gamma else None
        t = times.lap("draft_prepare", t)
        if gamma == 0 and not after:
            return self._plain_step(batch, chunks, unprocessed, t)
        fed, num_tokens = batch, None
        # One forward for all when nothing is drafted, or when the drafter drafts
        # after verification (it catches up on the chunks' rows too): the chunks'
        # rows are verified and dropped.
        if chunks and (gamma == 0 or after):
            fed = batch + [c for c, _ in chunks]
            num_tokens = unprocessed + [n for _, n in chunks]
            lens = lens + [c.processed(self.target.cache_name) + n for c, n in chunks]
        elif chunks:
            self._prefill_chunks(chunks)
            t = time.perf_counter()
        if gamma and after:
            gammas_fed = gammas + [0] * (len(fed) - len(batch))
            draft = DraftBatch(gamma=gamma, num_draft=torch.tensor(gammas_fed, device=self.device),
                               first_position=torch.tensor(lens, device=self.device))
        num_draft = draft.num_draft if draft is not None else torch.zeros(len(fed), dtype=torch.long, device=self.device)
        look = num_draft.tolist() if gamma else [0] * len(fed)
        # Each request verifies only its own drafts (no placeholder rows for
        # the padding up to the step's γ).
        packed = self.target.prepare(fed, return_n_logits=gamma + 1, lookahead=look, num_tokens=num_tokens)
        inputs = packed.inputs
        inputs.capture_layers = self.proposer.target_layers
        draft_host = None
        if after and self.proposer.needs_all_rows:
            inputs.all_hidden = True
            t = times.lap("target_prepare", t)
            draft_host = self.proposer.prepare_after(fed, packed, self.config.num_speculative_tokens)
            t = times.lap("draft_prepare", t)
        sampling = self._sampling(fed, packed.state_slots)
        positions = None
        if not sampling.all_greedy:
            positions = torch.tensor(lens, dtype=torch.long, device=self.device).unsqueeze(1) + torch.arange(
                gamma + 1, device=self.device
            )
        times.lap("target_prepare", t)
        out = self.module(
            target_inputs=inputs,
            draft_index=packed.draft_index,
            draft=draft,
            sampling=sampling,
            num_draft=num_draft,
            ragged=min(look) < gamma,
            positions=positions,
            slots=packed.state_slots,
            next_gamma=self.config.num_speculative_tokens if after else 0,
            draft_host=draft_host,
        )
        self.num_target_forwards += 1
        # The one host sync of the step: each row is tokens [γ+1], accepted, fault (, tree depth).
        cols = [out.tokens, out.num_accepted.unsqueeze(1), out.fault.unsqueeze(1)]
        tree = out.depth is not None
        if tree:
            cols.append(out.depth.unsqueeze(1))
        t = time.perf_counter()
        rows = torch.cat(cols, 1).tolist()
        t = times.lap("sync", t)
        new: list[list[int] | RequestFailure] = []
        for c, row, n, ln, g in zip(batch, rows, look, lens, gammas):
            depth = row.pop() if tree else None
            toks, k, fault = row[:-2], row[-2], row[-1]
            if fault >= 0:  # this request only: the engine ends it and frees what it holds
                what = "the drafter's probabilities" if fault % 2 else "the target's logits"
                new.append(non_finite(c, what, ln + fault // 2))
                continue
            self._counts(c).record(n, k, depth=depth)
            new.append(toks[: k + 1])
            if g:  # drafts were asked for (found or not): adaptive γ's running acceptance
                running = self._running.get(c.key)
                if running is None:
                    running = self._running[c.key] = [0, 0]
                tried = k + (k < g)  # drafts up to the first rejected (or missing) one
                running[0] += k
                running[1] += tried
                self._drafter_running[0] += k
                self._drafter_running[1] += tried
            # Target keeps the committed tokens but the last (it is fed next step):
            # it was fed through ln + n, so only rejected drafts (n > k) roll back.
            if n > k:
                self.target.truncate(c, ln + k)
            if gamma or after:  # (a step that drafted nothing leaves the proposer nothing to forget)
                self.proposer.commit(c, ln + k + 1)
            if after:
                self._ready[c.key] = self.config.num_speculative_tokens
        times.lap("commit", t)
        times.prefilling = False
        return new
