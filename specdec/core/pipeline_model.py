"""Pipeline models: a registered decoder with its caches, batch processor and state.

:func:`registered_pipeline_model` finalizes the config, constructs the
decoder as ``decoder_cls(config)``, loads the checkpoint, allocates one paged
KV cache per data-parallel replica and a :class:`DecoderBatchProcessor`, and
returns a :class:`DecoderPipelineModel` ready to batch and execute.

:class:`PlainGeneration` is the engine-facing pipeline of ordinary
(non-speculative) decoding; the speculative one lives in
:mod:`specdec.spec.pipeline` and follows the same :class:`GenerationPipeline`
protocol.
"""

from __future__ import annotations

import copy
import functools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from specdec.core.batch_processor import (
    BatchProcessorRuntime,
    DecoderBatchProcessor,
    PackedBatch,
    split_replicas,
)
from specdec.core.checkpoint import LoadedDecoder, load_decoder
from specdec.core.context import RequestFailure, TextContext
from specdec.core.flex import use_flex_attention
from specdec.core.graphs import graph_buckets
from specdec.core.inputs import DecoderOutputs, ModelOutputs
from specdec.core.kv_cache import BlockTable, KVCacheParams, PagedKVCache, available_memory, human_bytes
from specdec.core.backend import (  # (compile_*: also imported from here)
    compile_decoder,  # noqa: F401
    compile_function,  # noqa: F401
    compile_method,  # noqa: F401
    load_backend,
)
from specdec.core.linear import KERNELS, pack_layers
from specdec.core.registry import BuildContext, Role
from specdec.core.state_store import RequestStateStore
from specdec.spec.metrics import RunStats
from specdec.sampling import (
    LANE_TARGET,
    greedy_tokens,
    probs_from_logits,
    sample_from,
    sampling_tensors,
)


@dataclass(frozen=True)
class RuntimeConfig:
    """Sizes a pipeline model allocates for (one per model; no god-config)."""

    max_batch_size: int = 32
    max_seq_len: int = 1024
    block_size: int = 16
    num_blocks: int | None = None  # None: enough for max_batch_size full sequences
    # Replicas, each on its share of the requests: in one process, replicas of the module
    # (the batch processor's replica concat and splits); under torchrun, processes.
    data_parallel_degree: int = 1
    # Ranks one model is split across (heads, MLP columns, vocabulary; specdec/dist): torchrun
    # --nproc-per-node <tensor_parallel_degree × data_parallel_degree> -m specdec.run ...
    tensor_parallel_degree: int = 1
    # "auto": float32 on CPU (our kernels' dtype), bfloat16 on CUDA (tensor cores, half the
    # bytes per step); None: the checkpoint's declared dtype. Read it as ``compute_dtype``.
    dtype: str | None = "auto"
    # CUDA: float32 matmuls on TF32 tensor cores (process-wide, set when a CUDA pipeline is
    # built); false for float32 products to the last bit. No effect on CPU.
    tf32: bool = True
    device: str = "cpu"
    compile: bool = False  # torch.compile each decoder (dynamic shapes); the first calls compile
    threads: int | None = None  # torch.set_num_threads for a run; None: torch's default
    # CPU, glibc: keep tensors up to 32 MiB in the heap instead of a fresh mmap each (see keep_large_allocations)
    keep_allocations: bool = True
    # CPU projections (specdec/core/linear.py): "specdec", our own packed kernel for float32
    # (oneDNN for bfloat16); "onednn", oneDNN's packed kernel; "aten", F.linear (MKL's sgemm)
    cpu_linear: str = "specdec"
    # Attention over the paged cache: "auto", our CPU kernel where it serves, else SDPA over
    # gathered keys; "flex", torch's flex_attention reading the cache in place (specdec/core/flex.py)
    attention: str = "auto"

    def __post_init__(self) -> None:
        # Types first: a bool is not a size, and "8" or 1e6 (a string, a float) is a mistake to
        # name now, not an allocator error after the weights load.
        for k in ("max_batch_size", "max_seq_len", "block_size", "data_parallel_degree", "tensor_parallel_degree",
                  "num_blocks", "threads"):
            v = getattr(self, k)
            if v is None and k in ("num_blocks", "threads"):
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ValueError(f"runtime.{k} must be an integer, got {v!r:.200} ({type(v).__name__})")
            if v < 1:
                raise ValueError(f"runtime.{k} must be >= 1{' or null' if k in ('num_blocks', 'threads') else ''}, "
                                 f"got {v}")
        for k in ("compile", "keep_allocations", "tf32"):
            if not isinstance(getattr(self, k), bool):
                raise ValueError(f"runtime.{k} must be true or false, got {getattr(self, k)!r:.200}")
        if not isinstance(self.device, str):
            raise ValueError(f"runtime.device must be a device name (cpu, cuda, cuda:1 ...), got {self.device!r:.200}")
        if self.cpu_linear not in (*KERNELS, "aten"):
            raise ValueError(f"runtime.cpu_linear must be one of {(*KERNELS, 'aten')}, got {self.cpu_linear!r}")
        if self.attention not in ("auto", "flex"):
            raise ValueError(f"runtime.attention must be auto or flex, got {self.attention!r:.200}")
        if self.dtype is not None and self.dtype not in ("auto", "float32", "float16", "bfloat16", "float64"):
            raise ValueError(f"runtime.dtype must be auto, float32, float16, bfloat16, float64 or null, "
                             f"got {self.dtype!r}")

    @property
    def compute_dtype(self) -> str | None:
        """``dtype`` with "auto" resolved for ``device``: bfloat16 on CUDA, else float32
        (None: the checkpoint's declared dtype)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """:attr:`compute_dtype` as a ``torch.dtype`` (None: the checkpoint's declared dtype)."""
        name = self.compute_dtype
        return getattr(torch, name) if name else None

    def blocks(self, extra_tokens: int = 0) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        per_seq = -(-(self.max_seq_len + extra_tokens) // self.block_size)
        return self.max_batch_size * per_seq


class DecoderPipelineModel:
    """Serves one registered decoder: module replicas, caches, batch processor.

    It owns its modules and KV caches: callers pack through :meth:`prepare`
    (which attaches the cache), run through :meth:`execute` or the module of
    :meth:`build_module`, and keep per-request KV through
    :meth:`reserve` / :meth:`truncate` / :meth:`free`.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        config: Any,
        processor: DecoderBatchProcessor,
        runtime: RuntimeConfig,
        path: Path | None = None,
        max_seq_len: int | None = None,
    ) -> None:
        self.path = path  # the checkpoint directory, when loaded from one
        self.runtime = runtime
        self.modules = list(modules)
        self.config = config
        self.processor = processor
        self._max_positions = (max_seq_len or runtime.max_seq_len) + 1  # rope table size
        self._built: nn.Module | None = None
        for m in self.modules:
            self._prepare(m)

    @property
    def module(self) -> nn.Module:
        return self.modules[0]

    @property
    def caches(self) -> list[PagedKVCache]:
        return self.processor.runtime.kv_caches

    @functools.cached_property
    def cache_name(self) -> str:
        # (cached: a per-request lookup in every step's reserve and packing, and
        # the caches, named at build, are never renamed)
        return self.processor.runtime.cache_name

    @functools.cached_property
    def block_size(self) -> int:
        """Tokens per KV block (every replica's cache has the same)."""
        return self.caches[0].block_size

    @property
    def device(self) -> torch.device:
        return torch.device(self.runtime.device)

    def attach_state_store(self, store: RequestStateStore) -> None:
        """Shares ``store`` with this model's batch processor (it packs the requests' slots)."""
        self.processor.state_store = store

    def _prepare(self, module: nn.Module) -> None:
        """Inference rewrites, rope tables, packing, the backend: once per module, here only."""
        if hasattr(module, "prepare_for_inference"):
            module.prepare_for_inference()
        if hasattr(module, "ensure_rope"):
            module.ensure_rope(self._max_positions, self.runtime.device)
        pack_for_runtime(module, self.runtime)
        if self.runtime.attention == "flex":
            use_flex_attention(module)
        load_backend(module, compile=self.runtime.compile)  # native, compiled or eager: once, here

    def build_module(self) -> nn.Module:
        """The module a draft-and-verify module calls as its target.

        The prepared module itself where the decoder class keeps the default
        ``build_module`` (rebuilding it would fuse and pack its weights again); else
        built once by the class's ``build_module`` over this model's weights (adopted,
        not copied) and prepared like its own. From then on this model executes it
        too, so one set of weights and compiled graphs serve plain steps, speculative
        steps and timing.
        """
        if self._built is None:
            from specdec.core.decoder_module import DecoderModule

            cls = type(self.module)
            if getattr(self.module, "tp", None) is not None:  # a tensor-parallel shard: split the same way
                from specdec.dist.tensor_parallel import rebuild_like

                built = rebuild_like(self.module)
            elif getattr(cls.build_module, "__func__", None) is DecoderModule.build_module.__func__:
                # The default would rebuild this very module from its own weights: it is that module,
                # prepared already (a rebuild fused and packed its weights a second time).
                self._built = self.module
                return self._built
            else:
                built = cls.build_module(BuildContext(config=self.config, state_dict=self.module.state_dict()),
                                         type(self.config))  # type: ignore[attr-defined]
            self._prepare(built)
            self.modules[0] = self._built = built
        return self._built

    def prepare(
        self,
        batch: Sequence[TextContext],
        *,
        return_n_logits: int = 1,
        num_tokens: Sequence[int] | None = None,
        lookahead: int | Sequence[int] = 0,
        pad: bool = False,
    ) -> PackedBatch:
        """Packs one replica's ``batch`` (see ``prepare_initial_token_inputs``; ``pad``: to a CUDA
        graph's sizes where the runtime records graphs) with its KV cache attached."""
        packed = self.processor.prepare_initial_token_inputs(
            [batch], return_n_logits, num_tokens=num_tokens, lookahead=lookahead, pad=pad
        )
        packed.inputs.kv_cache = self.caches[0].tensors
        return packed

    @torch.inference_mode()
    def execute(self, batch: PackedBatch) -> ModelOutputs:
        """Runs the packed batch (each replica on its slice) -> :class:`ModelOutputs`."""
        parts = split_replicas(batch.inputs, batch.return_n_logits)
        outs: list[DecoderOutputs] = []
        for r, inp in enumerate(parts):
            if inp.tokens.numel() == 0:
                continue
            inp.kv_cache = self.caches[r].tensors
            outs.append(self.modules[r](inp))
        return self.processor.process_outputs(outs, batch)

    # -- per-request KV bookkeeping ----------------------------------------------
    def table(self, ctx: TextContext) -> BlockTable:
        table = ctx.kv.get(self.cache_name)
        if table is None:  # (not setdefault: that builds a BlockTable on every call)
            table = ctx.kv[self.cache_name] = BlockTable()
        return table

    def reserve(self, ctx: TextContext, num_tokens: int) -> None:
        table = ctx.kv.get(self.cache_name)
        # Most steps of a decode stay inside the blocks a request holds: nothing to do.
        if table is not None and len(table.blocks) * self.block_size >= num_tokens:
            return
        self.caches[ctx.replica].reserve(table if table is not None else self.table(ctx), num_tokens)

    def truncate(self, ctx: TextContext, num_tokens: int) -> None:
        table = self.table(ctx)
        if table.num_tokens > num_tokens:
            self.caches[ctx.replica].truncate(table, num_tokens)

    def free(self, ctx: TextContext) -> None:
        table = ctx.kv.pop(self.cache_name, None)
        if table is not None:
            self.caches[ctx.replica].free(table)

    # -- capacity (what the engine's admission and preemption decide by) ----------
    @property
    def num_blocks(self) -> int:
        """KV blocks of each replica's cache."""
        return self.caches[0].params.num_blocks

    def num_free_blocks(self, replica: int = 0) -> int:
        return self.caches[replica].allocator.num_free

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, ctx: TextContext, num_tokens: int) -> int:
        """KV blocks ``ctx`` needs beyond those it holds to hold ``num_tokens`` tokens."""
        return self.caches[ctx.replica].blocks_needed(ctx.kv.get(self.cache_name) or BlockTable(), num_tokens)


def registered_pipeline_model(
    checkpoint: str | Path | LoadedDecoder,
    runtime: RuntimeConfig = RuntimeConfig(),
    *,
    cache_name: str = "target",
    role: Role = Role.DECODER,
    extra_tokens: int = 0,
    processor_cls: type[DecoderBatchProcessor] = DecoderBatchProcessor,
) -> DecoderPipelineModel:
    """Loads a registered decoder and wraps it for batching and execution.

    ``extra_tokens``: per-sequence slack the KV cache must hold beyond
    ``max_seq_len`` (draft lookahead). ``processor_cls`` batches for the decoder.
    A device this machine lacks, or a ``max_seq_len`` past the model's
    positions, fails before any weight is read.
    """
    check_device(runtime.device)
    configure_device(runtime)
    dtype = runtime.torch_dtype
    tp, build = runtime.tensor_parallel_degree, None
    if tp > 1:  # this rank's shard only (specdec/dist); the process group comes from torchrun's env
        from specdec.dist import init_from_env, tensor_parallel

        if runtime.data_parallel_degree > 1:
            raise ValueError("runtime.tensor_parallel_degree > 1 runs one replica per process: data "
                             "parallelism with it is across processes (torchrun), not replicas in one")
        build = tensor_parallel.loader(init_from_env(tensor_parallel_degree=tp, device=runtime.device))
    def check(config: Any, path: Path, weights: bool = True) -> None:  # before any weight is read
        check_positions(config, runtime, path)
        check_memory(config, runtime, path, kv_heads=config.num_key_value_heads // tp, extra_tokens=extra_tokens,
                     weights=weights)

    if isinstance(checkpoint, LoadedDecoder):
        loaded = checkpoint
        check(loaded.config, loaded.path, weights=False)
    else:
        path = Path(checkpoint)
        loaded = load_decoder(path, role=role, dtype=dtype, device=runtime.device,
                              check=lambda config: check(config, path), build=build)
    module, config = loaded.module, loaded.config
    module_cls = type(module)
    if runtime.data_parallel_degree > 1 and not getattr(module_cls, "supports_data_parallel", False):
        raise ValueError(f"{module_cls.__name__} does not support data parallelism")
    # A tensor-parallel rank holds num_key_value_heads / degree heads of each layer's cache.
    kv_heads = config.num_key_value_heads // (tp if getattr(module, "tp", None) is not None else 1)
    modules = [module] + [copy.deepcopy(module) for _ in range(runtime.data_parallel_degree - 1)]
    wdtype = next(module.parameters()).dtype
    kv_params = KVCacheParams(
        num_layers=config.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_dim=config.head_dim,
        block_size=runtime.block_size,
        num_blocks=runtime.blocks(extra_tokens),
        dtype=wdtype,
        device=runtime.device,
    )
    caches = [PagedKVCache(kv_params, cache_name) for _ in range(runtime.data_parallel_degree)]
    graphs = cuda_graphs(runtime)
    if graphs:  # a CUDA graph may write only tensors whose address never changes: the caches' is fixed
        import torch._dynamo

        for c in caches:
            torch._dynamo.mark_static_address(c.tensors.k)
            torch._dynamo.mark_static_address(c.tensors.v)
    rt = BatchProcessorRuntime(
        kv_caches=caches,
        max_batch_size=runtime.max_batch_size,
        max_seq_len=runtime.max_seq_len + extra_tokens,
        device=runtime.device,
        graph_buckets=graph_buckets(runtime.max_batch_size) if graphs else None,
        compiled=runtime.compile,
    )
    processor = processor_cls(config, rt)
    return DecoderPipelineModel(modules, config, processor, runtime, path=loaded.path,
                                max_seq_len=runtime.max_seq_len + extra_tokens)


def check_device(device: str) -> None:
    """Raises ``ValueError`` naming ``runtime.device`` when this machine cannot
    use it (no CUDA, an index past the last device, a misspelt name)."""
    try:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device here")
        torch.empty(0, device=dev)  # any other backend, or a device index past the last
    except (RuntimeError, AssertionError) as e:  # (AssertionError: torch built without that backend)
        raise ValueError(f"runtime.device={device!r} cannot be used: {e}") from None


def cuda_graphs(runtime: RuntimeConfig) -> bool:
    """Whether ``runtime``'s compiled forwards replay CUDA graphs (``compile`` on a CUDA device,
    one replica: :func:`specdec.core.backend.compile_options`); plain decoding's batches are
    then padded to :func:`~specdec.core.graphs.graph_buckets` sizes."""
    return runtime.compile and torch.device(runtime.device).type == "cuda" and runtime.data_parallel_degree == 1


def configure_device(runtime: RuntimeConfig) -> None:
    """Process-wide settings a pipeline on ``runtime.device`` runs under: on CUDA, whether
    float32 matmuls (and cuDNN convolutions) may use TF32 tensor cores (``runtime.tf32``).
    Nothing on any other device."""
    if torch.device(runtime.device).type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = runtime.tf32
    torch.backends.cudnn.allow_tf32 = runtime.tf32


def check_memory(config: Any, runtime: RuntimeConfig, path: Path, *, kv_heads: int, extra_tokens: int = 0,
                 weights: bool = True) -> None:
    """Raises ``ValueError`` naming the runtime setting when the KV cache it sizes (and, with
    ``weights``, the least the checkpoint's weights take) cannot fit in the memory this
    machine has available on ``runtime.device``: before any weight is read, not as an
    allocator error after a long load."""
    avail = available_memory(runtime.device)
    if avail is None:
        return
    dtype = runtime.torch_dtype or getattr(config, "dtype", torch.float32)
    esz = torch.empty(0, dtype=dtype).element_size()
    blocks, replicas = runtime.blocks(extra_tokens), runtime.data_parallel_degree
    kv = 2 * config.num_hidden_layers * kv_heads * config.head_dim * blocks * runtime.block_size * esz * replicas
    least = getattr(config, "min_weight_elements", None)
    w = least() * esz * replicas // runtime.tensor_parallel_degree if weights and least is not None else 0
    if kv + w <= avail[0]:
        return
    if runtime.num_blocks is not None:
        setting = f"runtime.num_blocks={runtime.num_blocks}"
    else:
        setting = (f"runtime.max_batch_size={runtime.max_batch_size} with runtime.max_seq_len={runtime.max_seq_len} "
                   f"({blocks} KV blocks; runtime.num_blocks unset)")
    raise ValueError(
        f"{setting}: the KV cache for {path} needs {human_bytes(kv)} ({blocks} blocks of {runtime.block_size} tokens"
        f" x {config.num_hidden_layers} layers x {kv_heads} KV heads x {config.head_dim}, {dtype}"
        f"{f', {replicas} replicas' if replicas > 1 else ''})"
        f"{f' and its weights at least {human_bytes(w)}' if w else ''}, more than the {human_bytes(avail[0])} "
        f"available ({avail[1]}): lower it")


def check_positions(config: Any, runtime: RuntimeConfig, path: Path) -> None:
    """Raises ``ValueError`` when ``runtime.max_seq_len`` runs past the positions
    the model was trained for. (A speculative pipeline's lookahead slack past
    ``max_seq_len`` is internal, only drafts that are never verified land
    there, so it is not counted.)"""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and runtime.max_seq_len > limit:
        raise ValueError(
            f"runtime.max_seq_len={runtime.max_seq_len} is more than max_position_embeddings={limit} "
            f"in {path / 'config.json'}: the model has no positions past {limit - 1}; "
            f"set runtime.max_seq_len <= {limit}"
        )


def pack_for_runtime(module: nn.Module, runtime: RuntimeConfig) -> int:
    """Packs ``module``'s linears for ``runtime.cpu_linear``'s kernel where the device and
    dtype allow (:mod:`specdec.core.linear`); the number packed (none for "aten"). After
    loading and ``prepare_for_inference``, before compiling."""
    return 0 if runtime.cpu_linear == "aten" else pack_layers(module, runtime.cpu_linear)


def keep_large_allocations() -> bool:
    """Has glibc's malloc serve allocations up to 32 MiB from its heap and keep freed memory
    (``mallopt``: mmap threshold 32 MiB, trim threshold 1 GiB), process-wide; False where
    that is not glibc. By default every tensor over 128 KiB is a fresh ``mmap``, freed with
    ``munmap``, so each large temporary of a forward (a batch's gathered keys and values, its
    activations) costs page faults again on every call; glibc raises the threshold only as
    it sees such frees. On the built-in target a bare batch-64 decode forward took 60-124 ms
    that way and 26 ms with the heap, depending on what the process had freed before."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


class GenerationPipeline(Protocol):
    """What the engine drives: one step over a batch, and KV bookkeeping."""

    max_seq_len: int
    vocab_size: int
    max_batch_size: int  # requests it can run at once

    def reserve(self, ctx: TextContext, num_new: int) -> None:
        """Makes KV room for feeding ``num_new`` more tokens (raises OutOfBlocks)."""

    def step(self, batch: list[TextContext], num_new: list[int]) -> list[list[int] | RequestFailure]:
        """Feeds ``num_new[i]`` tokens of each request; returns each one's new tokens
        (or a :class:`RequestFailure` for a request it could not step)."""

    def free(self, ctx: TextContext) -> None:
        """Releases everything the request holds (KV blocks, state slots)."""

    def unprocessed(self, ctx: TextContext) -> int:
        """Tokens of ``ctx`` not yet in the model's cache."""

    # Capacity, in KV blocks per cache name (the target's; a draft model's too):
    def max_blocks(self, ctx: TextContext) -> dict[str, int]:
        """The most blocks ``ctx`` may hold at once in its life (its longest
        sequence and lookahead): above a cache's size it can never run."""

    def blocks_needed(self, ctx: TextContext) -> dict[str, int]:
        """Blocks ``ctx`` needs beyond those it holds to feed all its unprocessed
        tokens (and lookahead) in one step."""

    def free_blocks(self, replica: int) -> dict[str, int]:
        """Free blocks of the caches of data-parallel ``replica``."""

    def total_blocks(self) -> dict[str, int]:
        """Blocks of each cache (every replica's is the same size)."""


class PlainGeneration:
    """Ordinary decoding: one target forward per step, one token per request."""

    def __init__(self, target: DecoderPipelineModel, max_seq_len: int) -> None:
        self.target = target
        self.max_seq_len = max_seq_len
        self.vocab_size = target.config.vocab_size
        self.max_batch_size = target.runtime.max_batch_size * target.runtime.data_parallel_degree
        self.num_forwards = 0
        # Entered once per step, never nested (step enters it only from outside it): one
        # instance, not a new one per step as the decorator makes.
        self._inference = torch.inference_mode()

    def stats(self) -> RunStats:
        """Figures since the last :meth:`reset_stats` (plain decoding: forward passes only)."""
        return RunStats(target_forwards=self.num_forwards)

    def reset_stats(self) -> None:
        self.num_forwards = 0

    def unprocessed(self, ctx: TextContext) -> int:
        return len(ctx.tokens) - ctx.processed(self.target.cache_name)

    def reserve(self, ctx: TextContext, num_new: int) -> None:
        self.target.reserve(ctx, ctx.processed(self.target.cache_name) + num_new)

    def free(self, ctx: TextContext) -> None:
        self.target.free(ctx)

    def max_blocks(self, ctx: TextContext) -> dict[str, int]:
        # Every token but the last is fed (the last emitted one never is).
        return {self.target.cache_name: self.target.blocks_for(ctx.max_length(self.max_seq_len) - 1)}

    def blocks_needed(self, ctx: TextContext) -> dict[str, int]:
        return {self.target.cache_name: self.target.blocks_needed(ctx, len(ctx.tokens))}

    def free_blocks(self, replica: int) -> dict[str, int]:
        return {self.target.cache_name: self.target.num_free_blocks(replica)}

    def total_blocks(self) -> dict[str, int]:
        return {self.target.cache_name: self.target.num_blocks}

    def replica_batches(self, batch: list[TextContext]) -> list[list[TextContext]]:
        out: list[list[TextContext]] = [[] for _ in self.target.caches]
        for c in batch:
            out[c.replica].append(c)
        return out

    def step(self, batch: list[TextContext], num_new: list[int]) -> list[list[int] | RequestFailure]:
        if torch.is_inference_mode_enabled():  # (a caller already in it: no second entry)
            return self.decode(batch, num_new)
        with self._inference:
            return self.decode(batch, num_new)

    def decode(self, batch: list[TextContext], num_new: list[int]) -> list[list[int] | RequestFailure]:
        """:meth:`step` for a caller already in inference mode (a speculative pipeline's plain
        steps: entering it once more cost about 15 µs a step, on caches the forward left cold)."""
        if len(batch) == 1 and num_new[0] == 1:
            out = self._decode_one(batch[0])
            if out is not None:
                return [out]
        rb = self.replica_batches(batch)
        order = [c for r in rb for c in r]
        n_of = {id(c): n for c, n in zip(batch, num_new)}
        # (with_state=False: a speculative pipeline's target has a state store, which plain steps
        # never read: no slots tensor to build)
        # (pad: to a CUDA graph's batch size, where the runtime records them; execute drops the pad rows)
        packed = self.target.processor.prepare_initial_token_inputs(rb, num_tokens=[n_of[id(c)] for c in order],
                                                                    with_state=False, pad=True)
        out = self.target.execute(packed)
        self.num_forwards += 1
        toks_list = self._next_tokens(out.logits, order)
        result: dict[int, list[int] | RequestFailure] = {}
        for c, t in zip(order, toks_list):
            if c.processed(self.target.cache_name) != len(c.tokens):
                result[id(c)] = []  # a prefill chunk that stops short of the end emits nothing
            elif t < 0:
                result[id(c)] = non_finite(c, "the target's logits", len(c.tokens))
            else:
                result[id(c)] = [t]
        return [result[id(c)] for c in batch]

    def _decode_one(self, ctx: TextContext) -> list[int] | RequestFailure | None:
        """A decode step of a batch of one (``ctx`` feeds its last token), packed in the
        processor's reused step buffers and run straight on the module: no replica split, no
        per-step tensor but the forward's and the token's. None where those buffers do not
        serve (:meth:`DecoderBatchProcessor.pack_decode`): the general path steps it."""
        inputs = self.target.processor.pack_decode(ctx)
        if inputs is None:
            return None
        inputs.kv_cache = self.target.caches[0].tensors
        logits = self.target.modules[0](inputs).logits  # [1, V]
        self.num_forwards += 1
        t = self._next_tokens(logits, [ctx])[0]
        return non_finite(ctx, "the target's logits", len(ctx.tokens)) if t < 0 else [t]

    def _next_tokens(self, logits: torch.Tensor, order: list[TextContext]) -> list[int]:
        """Each request's next token from its logits row ``[B, V]`` (greedy: the argmax; else
        drawn at its sequence position), -1 where its row went non-finite: a row of NaN or
        inf fails its request only (no other row saw it: PagedAttend)."""
        if all(c.sampling.temperature == 0 for c in order):  # (no sampling tensors to build)
            toks = greedy_tokens(logits)
        else:
            st = sampling_tensors([c.sampling for c in order], [c.seed for c in order], logits.device)
            probs = probs_from_logits(logits.unsqueeze(1), st).squeeze(1)
            pos = torch.tensor([len(c.tokens) for c in order], dtype=torch.long, device=logits.device)
            toks = sample_from(probs, st.seeds, pos, LANE_TARGET)
        # Two reads (tokens, row sums) and the check in Python: fewer tensor ops than a masked
        # fill (finite_rows' rule: NaN and inf survive a row's float32 sum).
        sums = logits.sum(-1, dtype=torch.float32).tolist()
        return [t if math.isfinite(s) else -1 for t, s in zip(toks.tolist(), sums)]


def non_finite(ctx: TextContext, what: str, position: int) -> RequestFailure:
    """The failure of a request whose ``what`` went NaN or infinite at sequence ``position``."""
    return RequestFailure(f"request {ctx.request_id!r}: {what} went non-finite (NaN or inf) at sequence "
                          f"position {position}; this request stopped there, the others in its batch go on")
