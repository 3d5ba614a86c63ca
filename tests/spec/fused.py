"""Test helper: count a draft model's fused draftings through its public methods."""

from __future__ import annotations

from typing import Any


def count_fused_draftings(drafter: Any) -> tuple[list[int], list[int]]:
    """Wraps ``drafter.forward`` and ``drafter.caught_up``; returns the lists ``(fused, own_catch_ups)``
    that grow by one per fused drafting and per catch-up run outside a graph. A fused drafting runs
    its catch-up inside the compiled graph, so a drafting with no catch-up of its own is a fused one."""
    fused: list[int] = []
    own: list[int] = []
    forward, caught_up = drafter.forward, drafter.caught_up

    def counted_forward(*a: Any) -> Any:
        before = len(own)
        out = forward(*a)
        if len(own) == before:
            fused.append(1)
        return out

    drafter.forward = counted_forward
    drafter.caught_up = lambda: own.append(1) or caught_up()
    return fused, own


def count_compiled_eagle_draftings(drafter: Any) -> list[int]:
    """A list that grows by one per call of an EAGLE drafter's compiled chain (``compiled_chain``)
    or tree (``compiled_tree``), whichever it has. Its catch-up runs outside the graph, so no
    public call tells a compiled drafting from a step-by-step one: this wraps the one callable."""
    assert drafter.compiled_chain or drafter.compiled_tree
    calls: list[int] = []
    name = "_fused" if drafter.compiled_chain else "_fused_tree"
    fused = getattr(drafter, name)
    setattr(drafter, name, lambda *a: calls.append(1) or fused(*a))
    return calls
