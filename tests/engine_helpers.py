"""Test helper: run a batch of token-id prompts through an engine to completion."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from specdec.core.context import SamplingParams, TextContext
from specdec.engine import Engine


def generate_ids(
    engine: Engine,
    prompts: Iterable[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
) -> list[TextContext]:
    """Runs ``prompts`` to completion; returns their contexts in prompt order."""
    prompts = list(prompts)
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    assert len(params) == len(prompts), f"got {len(params)} sampling params for {len(prompts)} prompts"
    ctxs = [engine.add_request(p, s) for p, s in zip(prompts, params)]
    engine.run()
    return ctxs
