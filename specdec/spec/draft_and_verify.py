"""One speculative step on the device, in one module call: :class:`DraftAndVerify`.

Phases of :meth:`DraftAndVerify.forward` (the pipeline packs the inputs and
reads the result; docs/architecture.md)::

    drafts       -> tree tokens [B, γ] (q [B, γ, V]): drafted now, or read by slot
                    from the store, written into the request's placeholder rows
    target       -> logits (+ hidden states) of the last γ+1 rows of each request
    verify       -> tokens [B, γ+1], num_accepted [B], fault [B] (spec/verify.py); a greedy
                    chain: the fault found on the host, and drafted before the step, its
                    acceptance too (StepOutput.greedy_rows, verify.accept_greedy_chain)
    draft_after  -> (a drafter that drafts after verification) the next step's
                    drafts, from this forward's hidden states, into the store

A branching tree (``DraftTree.is_chain`` False; spec/tree.py) fills request b's
``num_draft[b]`` rows at rope position root + depth under ``tree_mask``; the
tree verifiers pick the accepted path and its target KV entries are compacted
into place, so the pipeline's usual truncation keeps exactly the committed tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specdec.core.backend import backend_of
from specdec.core.batch_processor import drop_pad_rows
from specdec.core.inputs import DecoderInputs
from specdec.core.pipeline_model import compile_function, compile_method
from specdec.core.state_store import RequestStateStore
from specdec.sampling import SamplingTensors, finite_rows, probs_from_logits
from specdec.spec.metrics import PhaseTimes
from specdec.spec.proposers.base import DraftBatch, Drafter, DraftTree, TargetStep
from specdec.spec.tree import (
    accepted_slot_moves,
    compact_kv,
    depths,
    packed_tree_mask,
    verify_tree_greedy,
    verify_tree_sampled,
)
from specdec.spec.verify import (accept_greedy_chain, chain_fault, greedy_chain_readout, greedy_fault, tree_fault,
                                 verify_greedy, verify_sampled)


@dataclass
class StepOutput:
    """The step's verdict on the device: ``tokens``, ``num_accepted`` and ``fault``, or (a
    greedy chain drafted before the step: nothing on the device waits for the verdict)
    only ``greedy_rows``, from which the host takes the same (verify.accept_greedy_chain)."""

    tokens: torch.Tensor | None = None  # [B, γ+1] accepted drafts then the recovered/bonus token; -1 past it (tree: [B, D+1])
    num_accepted: torch.Tensor | None = None  # [B]
    fault: torch.Tensor | None = None  # [B] -1, or the first non-finite number verification used (verify.describe_fault)
    depth: torch.Tensor | None = None  # [B] a tree step: the depth of each request's tree (None: chains)
    greedy_rows: torch.Tensor | None = None  # [B, 3γ+2] verify.greedy_chain_readout (then the three above are None)
    # [B, γ+1] a greedy chain's logits rows finite (1) or not, in place of ``fault`` (the host
    # takes chain_fault's code from it: verify.greedy_fault)
    finite: torch.Tensor | None = None

    def readout(self) -> torch.Tensor:
        """Everything the host needs, one tensor [B, ·] for the step's one read: ``greedy_rows``,
        or per request its tokens, num_accepted, then its fault (or its rows' finite flags), then
        its tree's depth (trees). :meth:`verdict` reads a row of it back."""
        if self.greedy_rows is not None:
            return self.greedy_rows
        assert self.tokens is not None and self.num_accepted is not None
        last = self.finite if self.finite is not None else self.fault.unsqueeze(1)
        cols = [self.tokens, self.num_accepted.unsqueeze(1), last]
        if self.depth is not None:
            cols.append(self.depth.unsqueeze(1))
        return torch.cat(cols, 1)

    def verdict(self, row: list[int], gamma: int, num_draft: int) -> tuple[list[int], int, int, int | None]:
        """One request's row of :meth:`readout` -> (tokens, num_accepted, fault code, tree depth or None)."""
        if self.greedy_rows is not None:
            return (*accept_greedy_chain(row, gamma, num_draft), None)
        if self.finite is not None:
            w = len(row) // 2  # γ+1 tokens, k, γ+1 flags
            return row[:w], row[w], greedy_fault(row[w + 1:], row[w]), None
        depth = row.pop() if self.depth is not None else None
        return row[:-2], row[-2], row[-1], depth


def _verify_sampled_chain(logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                          sampling: SamplingTensors, num_draft: torch.Tensor, positions: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sampled chain's verification from the target's ``logits`` [B, γ+1, V] ->
    (tokens [B, γ+1], num_accepted [B], fault [B]). Tensors in (and the sampling flags):
    compiled, its few dozen eager ops over [B, γ+1, V] become one graph."""
    out, acc = verify_sampled(draft_tokens=draft_tokens, draft_probs=draft_probs,
                              target_probs=probs_from_logits(logits, sampling), num_draft=num_draft,
                              seeds=sampling.seeds, positions=positions)
    return out, acc, chain_fault(logits, draft_probs, acc, num_draft)


def _verify_greedy_chain(logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                         num_draft: torch.Tensor, ragged: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy chain's verification (``ragged``: requests have fewer drafts than the
    step's γ), as :func:`_verify_sampled_chain`; compiled, its small eager ops are one graph."""
    out, acc = verify_greedy(draft_tokens=draft_tokens, target_logits=logits, num_draft=num_draft if ragged else None)
    return out, acc, chain_fault(logits, draft_probs, acc, num_draft)


def _verify_chain(logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                  sampling: SamplingTensors, num_draft: torch.Tensor, ragged: bool, positions: torch.Tensor | None,
                  *, greedy: Callable[..., Any] = _verify_greedy_chain,
                  sampled: Callable[..., Any] = _verify_sampled_chain
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chain's verification, greedy or sampled (``greedy`` / ``sampled``: those
    functions, or their compiled graphs) -> (tokens [B, γ+1], num_accepted [B], fault [B])."""
    if sampling.all_greedy:
        return greedy(logits, draft_tokens, draft_probs, num_draft, ragged)
    assert positions is not None
    return sampled(logits, draft_tokens, draft_probs, sampling, num_draft, positions)


class DraftAndVerify(nn.Module):
    """One speculative step in one call. ``target`` and ``drafter`` are submodules.

    ``compile_on`` (runtime.compile): a chain's verification runs as one compiled graph,
    and a one-request step verifying a chain drafted before it runs the target's forward
    and that verification as one graph (:meth:`_target_verify_chain`). One request only:
    each graph holds the whole target, compiled again for every shape kind a batch meets.
    Neither where the target's forward is one C++ call (its backend's ``compile_around`` is False): the graph's
    guards would cost more than the eager ops they replace.
    """

    def __init__(self, target: nn.Module, drafter: Drafter, *, drafts_after_verify: bool,
                 state: RequestStateStore, tree_facts: tuple[int | None, int | None] | None = None,
                 compile_on: torch.device | None = None) -> None:
        super().__init__()
        native = not backend_of(target).compile_around
        compile_verify = compile_on if not native else None
        self.verify_sampled_chain = (compile_function(_verify_sampled_chain, compile_verify)
                                     if compile_verify is not None else _verify_sampled_chain)
        self.verify_greedy_chain = (compile_function(_verify_greedy_chain, compile_verify)
                                    if compile_verify is not None else _verify_greedy_chain)
        self.target = target
        self.drafter = drafter
        self.drafts_after_verify = drafts_after_verify
        self.target_verify_chain = (compile_method(self, type(self)._target_verify_chain, compile_on)
                                    if compile_on is not None and not drafts_after_verify and not native else None)
        # Compiled on a CPU, a chain drafted before the step is verified by a forward that does
        # not hide each row's non-finite new keys from the rows before it (isolate_rows costs
        # there), and again with it when any request's verification met a non-finite number:
        # where none did, every row a request uses is bit for bit the hidden one.
        self.recheck_rows = (compile_on is not None and compile_on.type == "cpu" and not drafts_after_verify)
        # A drafter that drafts trees after verification: (max_depth, max_children)
        # of its trees (host facts); the store keeps their parents and node counts.
        self.tree_facts = tree_facts
        self.state = state
        self.times = PhaseTimes()  # host clock per step phase (spec/metrics.py); the pipeline laps its own

    def forward(
        self,
        *,
        target_inputs: DecoderInputs,  # packed; γ placeholder rows per request (its tokens field gets the drafts)
        draft_index: torch.Tensor | None,  # [B, γ] packed rows of the placeholders (padded: see _place_drafts)
        draft: DraftBatch | None,  # draft inputs; None: nothing drafted this step
        sampling: SamplingTensors,
        num_draft: torch.Tensor,  # [B] each request's γ
        ragged: bool,  # some request has fewer than γ drafts (its draft_index is padded)
        positions: torch.Tensor | None,  # [B, γ+1] sequence position of each emitted token (sampling only)
        slots: torch.Tensor | None,  # [B] state-store slots
        next_gamma: int = 0,  # drafts to leave for the next step (a drafter that drafts after verification)
        draft_host: object = None,  # the proposer's prepare_after packing (TargetStep.host)
    ) -> StepOutput:
        t = time.perf_counter()
        tree, draft_tokens, draft_probs = self._place_drafts(target_inputs, draft_index, draft, sampling, num_draft,
                                                             ragged, slots)
        branching = tree is not None and not tree.is_chain
        if branching:
            assert tree is not None and draft is not None and draft_index is not None
            nodes, node_depths = self._place_tree(target_inputs, tree, draft.gamma, draft_index, num_draft)
        t = self._draft_laps(t)
        recheck = self.recheck_rows and not branching
        target_inputs.isolate_rows = not recheck
        chain = (draft_tokens, draft_probs, sampling, num_draft, ragged, positions)
        if self.target_verify_chain is not None and not branching and target_inputs.single_request:
            out, acc, fault = self.target_verify_chain(target_inputs, *chain)  # (its time is target_forward's)
            if recheck and bool((fault >= 0).any()):
                target_inputs.isolate_rows = True
                out, acc, fault = self.target_verify_chain(target_inputs, *chain)
            self.times.lap("target_forward", t)
            return StepOutput(tokens=out, num_accepted=acc, fault=fault)
        b = num_draft.shape[0]
        target_out = drop_pad_rows(self.target(target_inputs), target_inputs, b)  # (padded to a graph's size)
        t = self.times.lap("target_forward", t)
        logits = target_out.logits.view(b, -1, target_out.logits.shape[-1])  # [B, γ+1, V]
        path = depth = finite = None
        if branching:
            assert tree is not None
            out, acc, path, depth = self._verify_tree(target_inputs, tree, nodes, node_depths, logits, sampling,
                                                      positions)
            fault = tree_fault(logits, draft_probs, path, acc)
        elif (not recheck and sampling.all_greedy and draft_probs is None
              and self.verify_greedy_chain is _verify_greedy_chain):  # (eager: no graph to keep whole)
            if not self.drafts_after_verify:
                self.times.lap("verify", t)  # (the host verifies: pipeline._commit)
                return StepOutput(greedy_rows=greedy_chain_readout(logits, draft_tokens))
            out, acc = verify_greedy(draft_tokens=draft_tokens, target_logits=logits,
                                     num_draft=num_draft if ragged else None)
            fault, finite = None, finite_rows(logits).long()  # (the host finds the fault: pipeline._commit)
        else:
            out, acc, fault = self._verify_chain(logits, chain, target_inputs, recheck)
        t = self.times.lap("verify", t)
        if self.drafts_after_verify and next_gamma > 0:
            assert slots is not None
            self._draft_after(target_inputs, target_out, logits.shape[1], out, acc, path, slots, next_gamma,
                              sampling, draft_host)
            self._draft_laps(t)
        return StepOutput(tokens=out, num_accepted=acc, fault=fault, depth=depth, finite=finite)

    # -- phases ------------------------------------------------------------------------
    def _place_drafts(self, target_inputs: DecoderInputs, draft_index: torch.Tensor | None, draft: DraftBatch | None,
                      sampling: SamplingTensors, num_draft: torch.Tensor, ragged: bool, slots: torch.Tensor | None
                      ) -> tuple[DraftTree | None, torch.Tensor, torch.Tensor | None]:
        """This step's drafts -> (tree, tokens [B, γ], probs [B, γ, V] | None), the tokens
        written into each request's placeholder rows (no drafts: an empty [B, 0])."""
        if draft is None or draft.gamma == 0:
            return None, torch.zeros(num_draft.shape[0], 0, dtype=torch.long, device=num_draft.device), None
        assert draft_index is not None
        tree = self._drafts(draft, sampling, slots)
        # Request r has num_draft[r] placeholder rows; its draft_index past
        # them points at its last real row, which gets its own token back.
        values = tree.tokens  # [B, γ], as draft_index
        if ragged:
            real = torch.arange(draft.gamma, device=draft_index.device) < num_draft.unsqueeze(1)
            values = torch.where(real, values,
                                 target_inputs.tokens.index_select(0, draft_index.reshape(-1)).view_as(values))
        target_inputs.tokens = target_inputs.tokens.index_put((draft_index,), values)
        return tree, tree.tokens, tree.probs

    def _drafts(self, draft: DraftBatch, sampling: SamplingTensors, slots: torch.Tensor | None) -> DraftTree:
        """Drafted now, or (a drafter that drafts after verification) read from the store."""
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

    def _target_verify_chain(self, inputs: DecoderInputs, draft_tokens: torch.Tensor,
                             draft_probs: torch.Tensor | None, sampling: SamplingTensors, num_draft: torch.Tensor,
                             ragged: bool, positions: torch.Tensor | None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The target's forward on ``inputs``, then a chain's verification (as
        :meth:`forward`'s unfused path): written for ``torch.compile`` to take whole."""
        out = self.target(inputs)
        logits = out.logits.view(num_draft.shape[0], -1, out.logits.shape[-1])  # [B, γ+1, V]
        return _verify_chain(logits, draft_tokens, draft_probs, sampling, num_draft, ragged, positions)

    def _verify_chain(self, logits: torch.Tensor, chain: tuple[Any, ...], target_inputs: DecoderInputs,
                      recheck: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A chain's verification of this forward's ``logits``; where ``recheck`` and a fault
        was met, the forward again with rows isolated (rare: counted as verification)."""
        kw = {"greedy": self.verify_greedy_chain, "sampled": self.verify_sampled_chain}
        out, acc, fault = _verify_chain(logits, *chain, **kw)
        if recheck and bool((fault >= 0).any()):
            target_inputs.isolate_rows = True
            again = self.target(target_inputs).logits
            out, acc, fault = _verify_chain(again.view(logits.shape[0], -1, again.shape[-1]), *chain, **kw)
        return out, acc, fault

    def _draft_after(self, target_inputs: DecoderInputs, target_out: Any, n: int, out: torch.Tensor,
                     acc: torch.Tensor, path: torch.Tensor | None, slots: torch.Tensor, next_gamma: int,
                     sampling: SamplingTensors, draft_host: object) -> None:
        """Drafts the next step's ``next_gamma`` from this forward's hidden states of the
        accepted rows (``n`` = rows verified per request) and leaves them in the store."""
        b = acc.shape[0]
        aux = target_out.aux_hidden_states
        logit_rows = target_inputs.logit_index.view(b, n)  # [B, γ+1] packed rows
        hidden = target_out.hidden_states.view(b, n, -1)
        aux_hidden = aux.view(b, n, -1) if aux is not None else None
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

