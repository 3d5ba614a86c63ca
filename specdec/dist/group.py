"""Process groups from ``torchrun``'s environment, and the collectives specdec uses.

``torchrun --nproc-per-node N -m specdec.run runtime.tensor_parallel_degree=T
runtime.data_parallel_degree=D ...`` starts ``N = T * D`` processes (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` in each one's
environment). :func:`init_from_env` joins them: NCCL when the run is on CUDA
(each process on its ``LOCAL_RANK``-th device), Gloo on CPU. Rank
``r = dp_rank * T + tp_rank``: the ``T`` ranks of one data-parallel replica
are consecutive (on one node when ``T`` <= GPUs per node) and share a
tensor-parallel group.

One process (no ``WORLD_SIZE``, or 1) is the single-device case: every
collective here is then the identity, so callers need no branch.

Host decisions under tensor parallelism: the ranks of a group run every
forward together, so whatever chooses the next forward must choose the same
on each. Tokens, acceptance, admission and non-finite checks do by
themselves (they read logits, which the collectives leave bit-identical on
every rank, and counters); what reads a clock would not, so
:meth:`DistContext.decide` gives every rank of a group its first rank's
choice: where the experiment's turns end (specdec/measure.py ``lockstep``),
which requests passed their deadline (specdec/engine.py); adaptive γ takes
rank 0's measured forward times (specdec/spec/pipeline.py). A collective that
fails or waits past the timeout raises :class:`DistError` naming the rank, the
collective and its number.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch

D = TypeVar("D")


class DistError(ValueError):
    """A distributed setting or launch that cannot work (names the setting, rank or job)."""


@dataclass
class DistContext:
    """This process's place in a ``torchrun`` launch."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tp: int = 1  # tensor-parallel degree: ranks sharing one model
    dp: int = 1  # data-parallel process groups (replicas across processes)
    backend: str | None = None  # "gloo" / "nccl"; None: one process, no group
    tp_group: Any = None  # torch.distributed ProcessGroup of this rank's tensor-parallel ranks
    _tp_ranks: list[int] = field(default_factory=list)
    timeout_s: float = 600.0  # how long a collective waits for the other ranks
    collectives: int = 0  # tensor-parallel collectives this rank has entered (the same count on each)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def is_writer(self) -> bool:
        """Rank 0 alone writes results, logs and W&B."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # -- tensor-parallel collectives (identity without tensor parallelism) ------------
    def _failed(self, what: str, e: RuntimeError) -> DistError:
        """The error of a tensor-parallel collective that failed: a peer died, or it waited past
        the timeout (the peer was elsewhere: another collective, or none)."""
        return DistError(
            f"rank {self.rank} of {self.world_size} (tensor-parallel ranks {self._tp_ranks}): {what}, "
            f"collective #{self.collectives} of this rank, failed: a peer died, or waited elsewhere for longer "
            f"than {self.timeout_s:g} s ($SPECDEC_DIST_TIMEOUT); the other ranks' errors name theirs: {e}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over this rank's tensor-parallel group (in place)."""
        if self.tp > 1:
            self.collectives += 1
            try:
                torch.distributed.all_reduce(x, group=self.tp_group)
            except RuntimeError as e:  # gloo; NCCL's watchdog aborts the process itself
                raise self._failed(f"all_reduce of {x.dtype} {list(x.shape)}", e) from e
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of every tensor-parallel rank, concatenated on the last dim in rank order."""
        if self.tp == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        self.collectives += 1
        try:
            torch.distributed.all_gather(parts, x.contiguous(), group=self.tp_group)
        except RuntimeError as e:
            raise self._failed(f"all_gather of {x.dtype} {list(x.shape)}", e) from e
        return torch.cat(parts, dim=-1)

    def decide(self, value: D, what: str = "a host decision") -> D:
        """``value`` as this tensor-parallel group's first rank has it, on every rank of the
        group (identity without tensor parallelism). For a host choice that steers the
        next forwards but reads a per-rank clock (where a turn of steps ends, which
        requests passed their deadline): the ranks must make it once. A bool goes as one
        number; anything else picklable as an object."""
        if self.tp == 1:
            return value
        src, group = self._tp_ranks[0], self.tp_group
        self.collectives += 1
        try:
            if isinstance(value, bool):
                flag = torch.tensor([value], dtype=torch.int32, device=self._object_device())
                torch.distributed.broadcast(flag, src=src, group=group)
                return bool(flag.item())  # type: ignore[return-value]
            box = [value]
            torch.distributed.broadcast_object_list(box, src=src, group=group, device=self._object_device())
        except RuntimeError as e:
            raise self._failed(f"sharing {what}", e) from e
        return box[0]  # type: ignore[no-any-return]

    # -- whole-world object collectives (host data: ids, records) -------------------
    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src, device=self._object_device())
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def _object_device(self) -> torch.device | None:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None


_CTX: DistContext | None = None


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def env_rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def current() -> DistContext:
    """This process's context: set by :func:`init_from_env`, else one process."""
    return _CTX if _CTX is not None else DistContext()


def init_from_env(*, tensor_parallel_degree: int = 1, data_parallel_degree: int | None = None,
                  device: str = "cpu", timeout_s: float | None = None) -> DistContext:
    """Joins the ``torchrun`` launch this process belongs to (once; later calls
    return the same context and check they agree).

    ``WORLD_SIZE`` must be ``tensor_parallel_degree * data_parallel_degree``
    (``data_parallel_degree`` None: whatever the world leaves). A collective
    that waits longer than ``timeout_s`` (``$SPECDEC_DIST_TIMEOUT``, default
    600 s) fails instead of hanging: a dead rank ends the run.
    """
    global _CTX
    world = env_world_size()
    tp = int(tensor_parallel_degree)
    if tp < 1:
        raise DistError(f"runtime.tensor_parallel_degree must be >= 1, got {tp}")
    if world == 1 and tp > 1:
        raise DistError(f"runtime.tensor_parallel_degree={tp} needs {tp} processes: launch with "
                        f"torchrun --nproc-per-node {tp} -m specdec.run runtime.tensor_parallel_degree={tp} ...")
    if world % tp:
        raise DistError(f"runtime.tensor_parallel_degree={tp} does not divide the {world} processes "
                        f"torchrun started (WORLD_SIZE={world})")
    dp = world // tp
    if data_parallel_degree is not None and world > 1 and data_parallel_degree != dp:
        raise DistError(
            f"torchrun started {world} processes, but runtime.tensor_parallel_degree={tp} × "
            f"runtime.data_parallel_degree={data_parallel_degree} = {tp * data_parallel_degree}: "
            f"launch with --nproc-per-node {tp * data_parallel_degree} (times nodes), or set the degrees to match")
    if _CTX is not None:
        if (_CTX.world_size, _CTX.tp) != (world, tp):
            raise DistError(f"this process already joined a launch of {_CTX.world_size} processes with "
                            f"tensor_parallel_degree={_CTX.tp}; got tensor_parallel_degree={tp}")
        return _CTX
    if world == 1:
        _CTX = DistContext()
        return _CTX
    rank = env_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    cuda = torch.device(device).type == "cuda"
    backend = "nccl" if cuda else "gloo"
    if cuda:
        if not torch.cuda.is_available():
            raise DistError(f"runtime.device={device!r} but torch sees no CUDA device on rank {rank}")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    timeout = timeout_s if timeout_s is not None else float(os.environ.get("SPECDEC_DIST_TIMEOUT", "600"))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=backend, timeout=timedelta(seconds=timeout))
    # Every rank creates every group, in the same order (a torch.distributed rule).
    tp_group, my_ranks = None, [rank]
    for d in range(dp):
        ranks = list(range(d * tp, (d + 1) * tp))
        # (A new group's own timeout, not the world's: torch's default for it is 30 minutes.)
        g = torch.distributed.new_group(ranks, timeout=timedelta(seconds=timeout)) if tp > 1 else None
        if rank in ranks:
            tp_group, my_ranks = g, ranks
    _CTX = DistContext(rank=rank, world_size=world, local_rank=local_rank, tp=tp, dp=dp,
                       backend=backend, tp_group=tp_group, _tp_ranks=my_ranks, timeout_s=timeout)
    return _CTX


def shutdown() -> None:
    """Leaves the process group (end of a run)."""
    global _CTX
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _CTX = None

