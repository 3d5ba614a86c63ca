"""The proposer interface: how a drafting method plugs into speculation.

A proposer has two halves:

- the **host half** (:class:`Proposer`) keeps per-request bookkeeping (its KV
  cache, n-gram tables …) and, each step, packs what its device half needs
  into a :class:`DraftBatch`;
- the **device half** (``Proposer.drafter``, an ``nn.Module``) turns a
  :class:`DraftBatch` into draft tokens and their probabilities inside the
  draft-and-verify module, with no host round trip before verification.

Proposers register by name (``@register_proposer("ngram")``) and are built
from their own typed config; nothing dispatches on method names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch
from torch import nn

from specdec.core.context import TextContext
from specdec.core.pipeline_model import DecoderPipelineModel, RuntimeConfig
from specdec.sampling import SamplingTensors


@dataclass
class ProposerDeps:
    """What a proposer may need from the run, bundled (never the whole run config)."""

    runtime: RuntimeConfig  # sizes for a draft model's own cache
    target: DecoderPipelineModel  # the target it drafts for (vocab, tokenizer checks)


@dataclass
class DraftBatch:
    """Inputs of a drafter for one step (fields beyond these are the proposer's own)."""

    gamma: int  # padded number of draft tokens per request this step
    num_draft: torch.Tensor  # [B] int64, drafts each request really proposes (<= gamma)
    first_position: torch.Tensor  # [B] int64, sequence position of each request's first draft


@dataclass
class DraftOutput:
    tokens: torch.Tensor  # [B, γ] int64
    probs: torch.Tensor | None  # [B, γ, V] the draft distribution q, or None when deterministic


class Drafter(nn.Module):
    """Device half of a proposer."""

    def forward(self, batch: DraftBatch, sampling: SamplingTensors) -> DraftOutput:  # pragma: no cover
        raise NotImplementedError


class Proposer(ABC):
    """Host half of a drafting method."""

    name: ClassVar[str] = ""
    # True: the drafter reads the last step's results from the shared state
    # store (``num_accepted``, ``draft_tokens``; EAGLE-style drafters condition
    # on them), so the pipeline writes them each step. Off, it skips the writes.
    reads_step_state: ClassVar[bool] = False
    drafter: Drafter

    @abstractmethod
    def prepare(self, batch: list[TextContext], gamma: int, num_draft: list[int]) -> DraftBatch:
        """Packs this step's drafter inputs. ``num_draft[i] <= gamma`` per request.

        The returned batch's ``gamma`` may be smaller than asked (a model-free
        proposer that found fewer tokens): the step then verifies only that many.
        """

    def reserve(self, ctx: TextContext, gamma: int) -> None:
        """Makes room (KV blocks …) for drafting ``gamma`` tokens; may raise OutOfBlocks."""

    def commit(self, ctx: TextContext, num_committed: int) -> None:
        """After verification: forget state past the request's ``num_committed`` tokens."""

    def free(self, ctx: TextContext) -> None:
        """Releases everything held for the request."""

    def draft_cost(self, batch_size: int, context_len: int) -> float:
        """Seconds one drafting forward takes for ``batch_size`` requests (0: model-free)."""
        return 0.0


P = TypeVar("P", bound=type[Proposer])
_PROPOSERS: dict[str, type[Proposer]] = {}


def register_proposer(name: str) -> Callable[[P], P]:
    def deco(cls: P) -> P:
        if name in _PROPOSERS and _PROPOSERS[name] is not cls:
            raise ValueError(f"proposer {name!r} is already registered to {_PROPOSERS[name].__qualname__}")
        cls.name = name
        _PROPOSERS[name] = cls
        return cls

    return deco


def proposer_class(name: str) -> type[Proposer]:
    import specdec.spec.proposers  # noqa: F401  (registers the built-in proposers)

    try:
        return _PROPOSERS[name]
    except KeyError:
        raise KeyError(f"unknown proposer {name!r}; registered: {', '.join(sorted(_PROPOSERS))}") from None


def registered_proposers() -> list[str]:
    import specdec.spec.proposers  # noqa: F401

    return sorted(_PROPOSERS)
