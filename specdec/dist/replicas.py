"""Data-parallel replicas of a generation pipeline in one process.

Plain decoding runs its replicas through the batch processor's replica concat
and splits (one pipeline model, one module and KV cache per replica). A
speculative pipeline keeps per-request state of its own (state slots, draft
caches, acceptance), so its replicas are whole pipelines: :class:`Replicas`
gives each request to the pipeline of its ``ctx.replica`` (the engine spreads
requests round-robin) and steps every replica that has requests in the batch.

On a machine with several CUDA devices each replica gets a device of its own
(:func:`replica_devices`), and plain decoding's replicas are whole pipelines too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from specdec.core.context import RequestFailure, TextContext
from specdec.spec.metrics import PHASES, RunStats, SpecCounts


def replica_devices(device: str, n: int, device_count: int | None = None) -> list[str]:
    """The device of each of ``n`` in-process replicas of a model on ``device``.

    On CUDA they take consecutive devices from ``device``'s index (0 for plain "cuda"),
    wrapping past the last of the ``device_count`` (default: torch's count): distinct
    devices while there are enough, shared round-robin beyond that. Any other device, or
    no CUDA device seen, hosts every replica."""
    if n < 1:
        raise ValueError(f"runtime.data_parallel_degree must be >= 1, got {n}")
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return [device] * n
    count = torch.cuda.device_count() if device_count is None else device_count
    if count < 1:
        return [device] * n
    first = dev.index or 0
    return [f"cuda:{(first + r) % count}" for r in range(n)]


@contextmanager
def _local(ctxs: Sequence[TextContext]) -> Iterator[None]:
    """Inside one replica's pipeline a request is on that pipeline's only replica (0)."""
    saved = [c.replica for c in ctxs]
    for c in ctxs:
        c.replica = 0
    try:
        yield
    finally:
        for c, r in zip(ctxs, saved):
            c.replica = r


class Replicas:
    """One engine-facing pipeline over ``pipelines``, one per data-parallel replica.

    Figures (:meth:`stats`) are every replica's merged; anything else a caller
    reads (``target``, ``draft_model``, ``proposer`` …) is replica 0's, which
    is the same model and method as every other replica's.
    """

    def __init__(self, pipelines: Sequence[Any]) -> None:
        if not pipelines:
            raise ValueError("Replicas needs at least one pipeline")
        self.pipelines = list(pipelines)
        first = self.pipelines[0]
        self.max_seq_len = first.max_seq_len
        self.vocab_size = first.vocab_size
        self.max_batch_size = sum(p.max_batch_size for p in self.pipelines)

    @classmethod
    def build(cls, n: int, make: Callable[[int], Any]) -> Replicas:
        return cls([make(r) for r in range(n)])

    def __getattr__(self, name: str) -> Any:  # target, draft_model, proposer, config, module …
        if name == "pipelines":
            raise AttributeError(name)
        return getattr(self.pipelines[0], name)

    @property
    def num_replicas(self) -> int:
        return len(self.pipelines)

    # -- statistics -------------------------------------------------------------------
    def stats(self) -> RunStats:
        parts = [p.stats() for p in self.pipelines]
        total, per = SpecCounts(), {}
        for s in parts:
            total.merge(s.counts)
            per.update(s.per_request)
        return RunStats(counts=total, per_request=per, target_forwards=sum(s.target_forwards for s in parts),
                        draft_time_s=sum(s.draft_time_s for s in parts),
                        target_time_s=sum(s.target_time_s for s in parts),
                        phase_s={k: sum(s.phase_s.get(k, 0.0) for s in parts) for k in PHASES},
                        spec_steps=sum(s.spec_steps for s in parts))

    def reset_stats(self) -> None:
        for p in self.pipelines:
            p.reset_stats()

    # -- engine protocol ------------------------------------------------------------------
    def _of(self, ctx: TextContext) -> Any:
        return self.pipelines[ctx.replica]

    def unprocessed(self, ctx: TextContext) -> int:
        with _local([ctx]):
            return self._of(ctx).unprocessed(ctx)

    def reserve(self, ctx: TextContext, num_new: int) -> None:
        p = self._of(ctx)
        with _local([ctx]):
            p.reserve(ctx, num_new)

    def free(self, ctx: TextContext) -> None:
        p = self._of(ctx)
        with _local([ctx]):
            p.free(ctx)

    def claim_slot(self, ctx: TextContext) -> bool:
        """A state slot on ``ctx``'s own replica (True for a pipeline without a state store)."""
        claim = getattr(self._of(ctx), "claim_slot", None)
        if claim is None:
            return True
        with _local([ctx]):
            return bool(claim(ctx))

    def max_blocks(self, ctx: TextContext) -> dict[str, int]:
        p = self._of(ctx)
        with _local([ctx]):
            return p.max_blocks(ctx)

    def blocks_needed(self, ctx: TextContext) -> dict[str, int]:
        p = self._of(ctx)
        with _local([ctx]):
            return p.blocks_needed(ctx)

    def free_blocks(self, replica: int) -> dict[str, int]:
        return self.pipelines[replica].free_blocks(0)

    def total_blocks(self) -> dict[str, int]:
        return self.pipelines[0].total_blocks()

    def step(self, batch: list[TextContext], num_new: list[int]) -> list[list[int] | RequestFailure]:
        out: dict[int, list[int] | RequestFailure] = {}
        for r, p in enumerate(self.pipelines):
            idx = [i for i, c in enumerate(batch) if c.replica == r]
            if not idx:
                continue
            sub = [batch[i] for i in idx]
            with _local(sub):
                res = p.step(sub, [num_new[i] for i in idx])
            out.update(zip(idx, res))
        return [out[i] for i in range(len(batch))]
