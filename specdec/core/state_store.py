"""Per-request state kept on the device between steps.

The speculative pipeline builds one store per run from the state its parts
declare (sampling parameters; a proposer's own ``state_specs()``, e.g. a
target feature per request): a list of :class:`StateSpec` (name, dtype,
per-request shape). The store holds one tensor per name,
``[max_batch_size, *shape]``; a request owns one row (its *slot*) while it
runs. The draft and target batch processors share the store and pack each
batch's slots (``PackedBatch.state_slots``), so a step gathers and scatters
state by slot on the device, never through Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSpec:
    """One named per-request tensor; ``shape`` may use dim names bound by ``dims``."""

    name: str
    dtype: torch.dtype
    shape: tuple[str | int, ...] = ()
    fill: float | int = 0


class RequestStateStore:
    """Slots of named tensors, one row per running request."""

    def __init__(
        self,
        specs: Sequence[StateSpec],
        *,
        max_batch_size: int,
        dims: dict[str, int] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.max_batch_size = max_batch_size
        self.dims = dict(dims or {})
        self.specs = {s.name: s for s in specs}
        self.tensors: dict[str, torch.Tensor] = {}
        for s in specs:
            shape = []
            for d in s.shape:
                if isinstance(d, str):
                    if d not in self.dims:
                        raise ValueError(f"state {s.name!r}: dim {d!r} is not bound (dims: {sorted(self.dims)})")
                    shape.append(self.dims[d])
                else:
                    shape.append(d)
            self.tensors[s.name] = torch.full((max_batch_size, *shape), s.fill, dtype=s.dtype, device=device)
        self._free = list(range(max_batch_size - 1, -1, -1))
        self._owner: dict[int, str] = {}

    def allocate(self, request_id: str) -> int:
        if not self._free:
            raise RuntimeError(f"state store full ({self.max_batch_size} slots); cannot admit {request_id!r}")
        slot = self._free.pop()
        self._owner[slot] = request_id
        for name, t in self.tensors.items():
            t[slot] = self.specs[name].fill
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._owner:
            raise KeyError(f"state slot {slot} is not allocated")
        del self._owner[slot]
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def gather(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        return self.tensors[name].index_select(0, slots)

    def scatter(self, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.tensors[name].index_copy_(0, slots, values.to(self.tensors[name].dtype))

    def names(self) -> Iterable[str]:
        return self.tensors.keys()
