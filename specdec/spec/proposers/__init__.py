"""Drafting methods: each module here is one method (a config dataclass and a
proposer registered together); :func:`proposer_class` finds them by name."""

from specdec.spec.proposers.base import (
    DraftBatch,
    Drafter,
    DrafterSpec,
    DraftTree,
    Proposer,
    ProposerConfig,
    ProposerDeps,
    TargetStep,
    config_class,
    proposer_class,
    proposer_for,
    register_proposer,
    registered_proposers,
)

__all__ = [
    "DraftBatch",
    "DraftTree",
    "Drafter",
    "DrafterSpec",
    "Proposer",
    "ProposerConfig",
    "ProposerDeps",
    "TargetStep",
    "config_class",
    "proposer_class",
    "proposer_for",
    "register_proposer",
    "registered_proposers",
]
