"""Medusa drafting: K heads over the target's last hidden state, after verification.

Each step, inside the draft-and-verify module and after the target verified,
the target's final-norm hidden state ``h`` at each request's bonus row (the
row whose logits gave the bonus token) goes through the heads: head ``i``
gives the distribution of the token ``i + 2`` ahead of that row, i.e. of
draft ``i`` of the next step (the bonus token itself is the target's). The
next step's chain is each head's top-1 (greedy) or a draw from each head's
softmax under the request's temperature / top-k / top-p (sampled; the
distribution ``q`` is kept beside the drafts, so the usual lossless
verification applies). No KV cache and no catch-up: only the bonus row's
hidden state is read. γ is at most K (``max_speculative_tokens``).

Medusa's own sampling rule, *typical acceptance*, is not distribution-
preserving and is not offered: sampled Medusa runs here are exact.

A static tree (``tree.kind=static``, ``tree.choices``: Medusa-choices rank
paths, e.g. ``[[0], [1], [0, 0]]``, likeliest first; none given: the list
the heads' ``manifest.json`` ships, measured when they were trained; γ is
then the node budget, and it keeps the first γ choices) gives node
``i`` the ``ranks[i]``-th top token of head ``depth[i] - 1``
(``MedusaDrafter.tree_tokens``: Medusa's candidates); tree drafts are
deterministic top-k (verified with q a point mass), at most K deep.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from specdec.core.backend import load_backend
from specdec.core.pipeline_model import pack_for_runtime
from specdec.models.medusa import MedusaHeads, load_medusa
from specdec.sampling import SamplingTensors, draw_drafts, greedy_tokens
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
from specdec.spec.forward_time import time_calls
from specdec.spec.tree import StaticShape, StaticShapes, check_tree_fits


@dataclass(frozen=True)
class MedusaConfig(CheckpointProposerConfig):
    """``path``: the heads (either published Medusa layout); ``tree``: a chain of
    γ = min(K, num_speculative_tokens) top-1s, or a static tree (Medusa-choices
    paths, at most K deep) whose node budget is γ."""

    path_is: ClassVar[str] = "the Medusa heads' checkpoint directory"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tree.kind == "dynamic":
            raise ValueError(f"{self.key('tree.kind')}=dynamic: Medusa heads draft one distribution per depth, "
                             "not per node; use kind=static (Medusa choices) or chain")

    def shipped_tree_choices(self) -> list[list[int]]:
        """The heads' own static tree: the likeliest-first list ``python -m specdec.train
        train=medusa`` measured on held-out text (``manifest.json``: heldout.shipped.static_tree)."""
        manifest = Path(self.path) / "manifest.json"
        try:
            return json.loads(manifest.read_text())["heldout"]["shipped"]["static_tree"]["choices"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"method.medusa.tree.choices is not given and {manifest} lists no static tree "
                             f"(heldout.shipped.static_tree.choices; {type(e).__name__}: {e}); give the choices, "
                             "e.g. [[0], [1], [0, 0]]") from e


class MedusaDrafter(Drafter):
    """Device half: the heads as a submodule (the target's lm_head borrowed when shared)."""

    def __init__(self, heads: MedusaHeads) -> None:
        super().__init__()
        self.heads = heads
        self.choices: tuple[tuple[int, ...], ...] | None = None  # a static tree (Medusa choices)
        self._shapes: StaticShapes | None = None  # the static tree's shapes per node budget

    def draft_after(self, step: TargetStep, gamma: int, sampling: SamplingTensors) -> DraftTree:
        b = step.num_accepted.shape[0]
        rows = torch.arange(b, device=step.hidden.device)
        h = step.hidden[rows, step.num_accepted]  # [B, H] the bonus row's final-norm hidden state
        if self.choices is not None:
            return self.tree_tokens(h, gamma)
        logits = self.heads(h, gamma)  # [B, γ, V], γ <= K
        if sampling.all_greedy:  # (no positions: nothing is drawn)
            return DraftTree.chain(greedy_tokens(logits))
        # Draft j takes sequence position (bonus row's) + 2 + j.
        pos = (step.first_position + step.num_accepted).unsqueeze(1) + 2 + torch.arange(gamma, device=h.device)
        return DraftTree.chain(*draw_drafts(logits, sampling, pos))

    def static_shape(self, n: int) -> StaticShape:
        """The static tree cut to its first ``n`` choices (as listed)."""
        if self._shapes is None:
            assert self.choices is not None
            self._shapes = StaticShapes(self.choices, self.heads.block(0).linear.weight.device)
        return self._shapes(n)

    def tree_tokens(self, h: torch.Tensor, n: int) -> DraftTree:
        """The static tree (first ``n`` nodes): node ``i`` = the ``ranks[i]``-th top token of
        head ``depth[i] - 1`` (Medusa's candidates: one distribution per depth)."""
        shape = self.static_shape(n)
        topk = self.heads(h, shape.max_depth).topk(shape.top_k, dim=-1).indices  # [B, D, k]
        b = h.shape[0]
        return DraftTree(tokens=topk[:, shape.depths - 1, shape.ranks], parents=shape.parents.expand(b, n),
                         is_chain=False, num_nodes=torch.full((b,), n, dtype=torch.long, device=h.device),
                         max_depth=shape.max_depth, max_children=shape.max_children)


@register_proposer("medusa", MedusaConfig)
class MedusaProposer(Proposer):
    """Host half: loads the heads; nothing per request (no KV cache, no state beyond the drafts)."""

    def __init__(self, config: MedusaConfig, deps: ProposerDeps) -> None:
        self.config = config
        target, rt = deps.target, deps.runtime
        built = target.build_module()  # the target module the step calls: borrow its lm_head
        # The heads compute in the target's dtype (they read its hidden states, may share its lm_head).
        dtype = rt.torch_dtype or built.lm_head.weight.dtype
        heads = load_medusa(config.path, target=target.config, dtype=dtype, device=rt.device)
        heads.attach_target(built.lm_head)
        pack_for_runtime(heads, rt)
        load_backend(heads)  # native (one C++ call a pass) or eager: once, here
        self.heads = heads
        self.drafter = MedusaDrafter(heads)
        tree = config.tree if config.tree.is_tree else None
        self._tree_facts: tuple[int | None, int | None] | None = None  # a tree's (depth, max children)
        if tree is not None:
            self._tree_facts = (None, None)
            self.drafter.choices = tuple(tuple(c) for c in tree.choices)
            g = config.num_speculative_tokens
            check_tree_fits(config.key("tree"), tree, g, heads.config.vocab_size,
                            f"the heads' vocabulary at {config.path!r}")
            if g:
                shape = self.drafter.static_shape(g)
                depth, kids = shape.max_depth, shape.max_children
                if depth > heads.num_heads:
                    raise ValueError(f"{config.key('tree.choices')}: its first {g} nodes reach depth {depth}; the "
                                     f"heads at {config.path!r} draft at most {heads.num_heads} levels (K heads)")
                self._tree_facts = (depth, kids)

    def drafter_spec(self) -> DrafterSpec:
        """Drafts after verification from the target's last hidden state: a sampled chain of at
        most K (head i drafts the token i + 2 ahead), or a top-k tree (deterministic, no q)
        whose shapes the store keeps. Its heads time themselves (one pass a step: draft_cost …)."""
        if self._tree_facts is None:
            return DrafterSpec(drafts_after_verify=True, samples_drafts=True,
                               max_speculative_tokens=self.heads.num_heads)
        return DrafterSpec(drafts_after_verify=True, drafts_trees=True, node_budget=True,
                           tree_facts=self._tree_facts)

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    @torch.inference_mode()
    def _heads_time(self, batch_size: int, repeats: int, between: Callable[[], object] | None = None,
                    warmup: int = 2) -> float:
        """Median seconds of one pass of the heads a step runs (a chain's γ, a tree's depth)."""
        w = self.heads.block(0).linear.weight
        h = torch.zeros(batch_size, self.heads.config.hidden_size, dtype=w.dtype, device=w.device)
        spec = self.spec
        g = spec.tree_facts[0] if spec.drafts_trees and spec.tree_facts[0] else self.gamma  # heads run
        return time_calls(lambda: self.heads(h, g), w.device, repeats=repeats, warmup=warmup, between=between)

    @property
    def gamma(self) -> int:
        """Drafts per step: γ = min(K, num_speculative_tokens) for a chain, the node budget for a tree."""
        g = self.config.num_speculative_tokens
        return max(1, g if self.spec.drafts_trees else min(g, self.heads.num_heads))

    def draft_forward_time(self, ctx_len: int, repeats: int = 10, *,
                           between: Callable[[], object] | None = None, warmup: int = 3,
                           requests: int = 1) -> float:
        """T_draft(1) of the analytic limit, which charges it once per draft token: one pass of
        the γ heads for ``requests`` requests (all drafts of a step at once, no context
        read) divided by γ."""
        return self._heads_time(requests, repeats, between, warmup) / self.gamma

    def draft_cost(self, batch_size: int, context_len: int) -> float:
        """Per draft token, as adaptive γ charges it (γ · T_draft(B)): one pass of the heads / γ."""
        return self._heads_time(max(batch_size, 1), 7) / self.gamma

__all__ = ["MedusaConfig", "MedusaDrafter", "MedusaProposer"]
