"""RequestStateStore: slots, fill values, gather and scatter (the pipeline's use of it: tests/spec/test_target_conditioned.py)."""

from __future__ import annotations

import pytest
import torch

from specdec.core.state_store import RequestStateStore, StateSpec


def test_allocate_release_gather_scatter() -> None:
    store = RequestStateStore(
        [StateSpec("accepted", torch.long), StateSpec("draft", torch.long, ("gamma",), fill=-1)],
        max_batch_size=3,
        dims={"gamma": 4},
    )
    assert store.tensors["draft"].shape == (3, 4)  # [max_batch_size, gamma]
    a, b = store.allocate("a"), store.allocate("b")
    assert (a, b) == (0, 1) and store.num_free == 1
    slots = torch.tensor([b, a])
    store.scatter("accepted", slots, torch.tensor([7, 5]))
    assert store.gather("accepted", torch.tensor([a, b])).tolist() == [5, 7]
    store.release(a)
    c = store.allocate("c")  # a's slot is reused and reset to the fill value
    assert c == a and store.tensors["accepted"][c].item() == 0
    assert store.tensors["draft"][c].tolist() == [-1, -1, -1, -1]
    store.allocate("d")
    with pytest.raises(RuntimeError, match="'e'"):
        store.allocate("e")  # full: names the request it cannot admit
    with pytest.raises(KeyError):
        store.release(7)


def test_unbound_dim_is_named() -> None:
    with pytest.raises(ValueError, match="'gamma'"):
        RequestStateStore([StateSpec("draft", torch.long, ("gamma",))], max_batch_size=2)
