"""Paged KV cache: fixed-size blocks, an allocator, per-request block tables.

Storage is one tensor per K and V, ``[layers, num_blocks * block_size,
kv_heads, head_dim]``; token ``i`` of a request lives in *slot*
``table.blocks[i // block_size] * block_size + i % block_size``. Attention
gathers a request's slots (see :mod:`specdec.core.inputs`).

Rolling back the last ``n`` tokens (rejected draft tokens) only moves the
table's length back and frees blocks that become empty: the stale values are
overwritten by the next append.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.core.inputs import KVCacheTensors


class OutOfBlocks(RuntimeError):
    """The allocator cannot satisfy a request: a scheduler event, not a crash."""


@dataclass(frozen=True)
class KVCacheParams:
    """Shape of one decoder's paged cache (MAX's ``KVCacheParamInterface``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    num_blocks: int = 256
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    def __post_init__(self) -> None:
        for k in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"kv cache {k} must be an integer, got {v!r} ({type(v).__name__})")
        if self.block_size < 1 or self.num_blocks < 1:
            raise ValueError(
                f"kv cache needs block_size >= 1 and num_blocks >= 1, got "
                f"block_size={self.block_size}, num_blocks={self.num_blocks}"
            )

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V storage."""
        return 2 * self.num_layers * self.num_slots * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def available_memory(device: str | torch.device) -> tuple[int, str] | None:
    """Bytes a new allocation on ``device`` may take, and where that figure comes from
    (CUDA: ``torch.cuda.mem_get_info``; CPU: ``MemAvailable`` of /proc/meminfo);
    None where it cannot be told (another backend, no /proc)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free), f"free memory of {dev} (torch.cuda.mem_get_info)"
    if dev.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
        except (OSError, ValueError, IndexError):
            return None
    return None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # (unreachable)


class BlockAllocator:
    """The free block ids, handed out lowest first. Never hands out a block twice.

    Lowest first keeps the blocks in use packed at the start of the cache
    however requests come and go. A plain free list hands freed blocks back in
    the order they were freed, so after a few thousand requests each one's
    blocks lie scattered across the whole cache; on a CPU a batch-64 decode
    step then ran 13% slower than on a fresh cache.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # a min-heap (sorted is one)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            heapq.heappush(self._free, b)


@dataclass
class BlockTable:
    """One request's blocks in one cache, and how many tokens they hold."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PagedKVCache:
    """One decoder's cache storage plus its allocator and the requests' tables.

    Tables live in ``TextContext.kv[self.name]`` so a request carries its own
    blocks; this object only hands blocks out and takes them back.
    """

    def __init__(self, params: KVCacheParams, name: str = "target") -> None:
        self.params = params
        self.name = name
        avail = available_memory(params.device)
        if avail is not None and params.nbytes > avail[0]:
            raise ValueError(
                f"the {name!r} KV cache needs {human_bytes(params.nbytes)} ({params.num_blocks} blocks of "
                f"{params.block_size} tokens, {params.num_layers} layers, {params.num_kv_heads} KV heads of "
                f"{params.head_dim}), more than the {human_bytes(avail[0])} available ({avail[1]}): lower "
                "runtime.num_blocks, or runtime.max_batch_size / runtime.max_seq_len")
        shape = (params.num_layers, params.num_slots, params.num_kv_heads, params.head_dim)
        self.tensors = KVCacheTensors(
            k=torch.zeros(shape, dtype=params.dtype, device=params.device),
            v=torch.zeros(shape, dtype=params.dtype, device=params.device),
        )
        self.allocator = BlockAllocator(params.num_blocks)

    @property
    def block_size(self) -> int:
        return self.params.block_size

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        """Extra blocks ``table`` needs to hold ``num_tokens`` tokens in all."""
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(table.blocks))

    def reserve(self, table: BlockTable, num_tokens: int) -> None:
        """Makes room for ``num_tokens`` tokens in all (raises :class:`OutOfBlocks`)."""
        n = self.blocks_needed(table, num_tokens)
        if n:
            table.blocks.extend(self.allocator.allocate(n))

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Keeps the first ``num_tokens`` tokens; frees blocks left empty."""
        if not 0 <= num_tokens <= table.num_tokens:
            raise ValueError(f"cannot truncate {table.num_tokens} tokens to {num_tokens}")
        table.num_tokens = num_tokens
        keep = -(-num_tokens // self.block_size)
        if len(table.blocks) > keep:
            self.allocator.free(table.blocks[keep:])
            del table.blocks[keep:]

    def free(self, table: BlockTable) -> None:
        self.allocator.free(table.blocks)
        table.blocks = []
        table.num_tokens = 0

    def slots(self, table: BlockTable, start: int, end: int) -> list[int]:
        """Slot ids of token positions ``start:end`` (blocks must be reserved)."""
        bs = self.block_size
        return [table.blocks[i // bs] * bs + i % bs for i in range(start, end)]

    @contextmanager
    def scratch(self, requests: int, num_tokens: int) -> Iterator[torch.Tensor]:
        """Blocks for ``requests`` throwaway requests of ``num_tokens`` tokens, freed on exit;
        yields each one's slots ``[requests, num_tokens]`` (bare timing of a forward)."""
        tables = [BlockTable() for _ in range(requests)]
        try:
            for table in tables:
                self.reserve(table, num_tokens)
            yield torch.tensor([self.slots(t, 0, num_tokens) for t in tables], device=self.tensors.k.device)
        finally:
            for table in tables:
                self.free(table)


def block_table_array(tables: list[list[int]]) -> np.ndarray:
    """The requests' block lists as one zero-padded ``[B, max_blocks]`` int64 array."""
    if len(tables) == 1:
        return np.asarray(tables, dtype=np.int64)
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for i, blocks in enumerate(tables):
        out[i, : len(blocks)] = blocks
    return out
