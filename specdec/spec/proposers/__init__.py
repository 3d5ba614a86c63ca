"""Drafting methods; importing this package registers the built-in ones."""

from specdec.spec.proposers import draft_model, ngram  # noqa: F401
from specdec.spec.proposers.base import (
    DraftBatch,
    Drafter,
    DraftOutput,
    Proposer,
    ProposerDeps,
    proposer_class,
    register_proposer,
    registered_proposers,
)

__all__ = [
    "DraftBatch",
    "DraftOutput",
    "Drafter",
    "Proposer",
    "ProposerDeps",
    "proposer_class",
    "register_proposer",
    "registered_proposers",
]
