"""N-gram / prompt-lookup drafting: no model.

The last ``n`` tokens of a request (``n`` from ``max_n`` down to ``min_n``)
are looked up among its earlier tokens (prompt and output); the tokens that
followed their most recent earlier occurrence are proposed. Each request
keeps an index ``n-gram -> end position`` that grows with its tokens, so a
lookup costs O(1) per ``n``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.core.context import TextContext
from specdec.core.inputs import move_tensors
from specdec.sampling import SamplingTensors
from specdec.spec.proposers.base import (
    DraftBatch,
    Drafter,
    DraftTree,
    Proposer,
    ProposerConfig,
    ProposerDeps,
    register_proposer,
)


@dataclass(frozen=True)
class NgramConfig(ProposerConfig):
    max_n: int = 3  # longest n-gram looked up
    min_n: int = 1  # shortest

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (1 <= self.min_n <= self.max_n):
            raise ValueError(f"min_n / max_n need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")


@dataclass
class _Index:
    upto: int = 0  # n-grams ending before this position are indexed
    ends: list[dict[tuple[int, ...], int]] = field(default_factory=list)  # per n: n-gram -> end


@dataclass
class NgramDraftBatch(DraftBatch):
    tokens: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # [B, γ]


class NgramDrafter(Drafter):
    """The proposals were found on the host; they are deterministic (q one-hot)."""

    def forward(self, batch: NgramDraftBatch, sampling: SamplingTensors) -> DraftTree:  # type: ignore[override]
        return DraftTree.chain(batch.tokens)


def lookup(tokens: list[int], index: _Index, max_n: int, min_n: int, k: int) -> list[int]:
    """Updates ``index`` with ``tokens`` and returns up to ``k`` proposed tokens."""
    if not index.ends:
        index.ends = [dict() for _ in range(max_n + 1)]
    last = len(tokens) - 1
    for e in range(max(index.upto, 1), last + 1):  # continuation starts at e
        for n in range(min_n, max_n + 1):
            if e - n >= 0:
                index.ends[n][tuple(tokens[e - n : e])] = e
    index.upto = last + 1
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n:
            continue
        e = index.ends[n].get(tuple(tokens[len(tokens) - n :]))
        if e is not None:
            return tokens[e : e + k]
    return []


@register_proposer("ngram", NgramConfig)
class NgramProposer(Proposer):
    def __init__(self, config: NgramConfig, deps: ProposerDeps | None = None) -> None:
        self.config = config
        self.drafter = NgramDrafter()
        self._index: dict[str, _Index] = {}
        self.device = torch.device(deps.runtime.device if deps is not None else "cpu")

    def prepare(self, batch: list[TextContext], gamma: int, num_draft: list[int]) -> NgramDraftBatch:
        cfg = self.config
        props = []
        for ctx, k in zip(batch, num_draft):
            idx = self._index.setdefault(ctx.request_id, _Index())
            props.append(lookup(ctx.tokens, idx, cfg.max_n, cfg.min_n, k) if k else [])
        found = [len(p) for p in props]
        gamma = max(found)  # the step verifies only as many rows as were found
        rows = [p + [0] * (gamma - len(p)) for p in props]
        return move_tensors(NgramDraftBatch(
            gamma=gamma,
            num_draft=torch.tensor(found, dtype=torch.long),
            first_position=torch.tensor([len(c.tokens) for c in batch], dtype=torch.long),
            tokens=torch.tensor(rows, dtype=torch.long).view(len(batch), gamma),
        ), self.device)

    def free(self, ctx: TextContext) -> None:
        self._index.pop(ctx.request_id, None)
