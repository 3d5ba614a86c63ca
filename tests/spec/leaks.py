"""A check the fault and stream tests share: nothing a pipeline holds is left behind."""

from __future__ import annotations

from specdec.api import LLM


def assert_all_free(llm: LLM) -> None:
    """Every KV block (target and draft caches) and every state slot is free."""
    p = llm.pipeline
    for model in (p.target, getattr(getattr(p, "spec", None), "model", None)):
        if model is not None:
            assert model.num_free_blocks() == model.num_blocks, f"{model.cache_name} KV blocks leaked"
    state = getattr(p, "state", None)
    if state is not None:
        assert state.num_free == state.max_batch_size, "state slots leaked"
