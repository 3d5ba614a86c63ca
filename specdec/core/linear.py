"""The models' linear layer, with packed-weight kernels for CPU inference.

Every projection of the built-in architectures is a :class:`Linear` (an
``nn.Linear``: same parameters, same ``state_dict``). :func:`pack_layers`
gives each one a copy of its weight in a kernel's own layout, after which the
layer multiplies through that kernel instead of ``F.linear`` (MKL's sgemm on
torch's CPU wheel). Two kernels, by ``runtime.cpu_linear``:

- ``specdec`` (the default): our own, ``specdec/core/kernels/cpu.cpp``,
  built on first use for float32. Each output is one fused multiply-add chain
  over the inputs in order, whatever the number of rows or threads. A weight
  whose every value is a bfloat16 (a bf16 checkpoint loaded as float32, as the
  built-in pair is) is packed as bfloat16 (:func:`lossless_bf16`) and widened
  back exactly in the kernel: the same bits from half the bytes, so target and
  drafter fit a CPU's last-level cache together.
- ``onednn``: oneDNN's runtime-sized kernel (weights packed for any batch),
  which also computes each row in the same order whatever the number of rows.
  It serves bfloat16, and float32 where our kernel could not be built.

Why not ``F.linear``:

- **One row's result must not depend on the rows beside it.** MKL's sgemm
  picks its kernel by shape, so a row's last bits depend on how many rows share
  the call: a token verified among γ + 1 could get other logits than decoded
  alone. ``tests/core/test_linear.py`` holds both packed kernels to it.
- **Call cost.** A decode step of a small model is dozens of small one-row
  matmuls, where per-call overhead dominates: at one row ours costs the least,
  oneDNN's the most. ``experiments/bench/ar.py`` reports the kernel it ran.

A module's packed weights (ours) live in one block of memory on transparent
huge pages (``pack_layers``): a decode step streams them all from DRAM, and on
4 KiB pages each 4 KiB is a TLB miss and a stop for the prefetchers.

The packed copy replaces the dense weight: ``pack_layers`` frees each packed
layer's dense weight (and its fused parts'), leaving a one-element placeholder of
the same shape, dtype and device (:meth:`Linear.free_dense`), unless another
module reads that storage too. A tied embedding (:class:`Embedding`) does not keep it:
it reads its rows from the packed head (:func:`packed_rows`), so a tied model holds its
vocabulary table once. What still needs the dense
values gets them back exactly from the packed copy (:func:`unpack`): the
``state_dict``, a forward with gradients for its input, fusing again. Training
the weight itself fails, naming the layer: pack after loading, as
:class:`~specdec.core.pipeline_model.DecoderPipelineModel` does, never before
training. ``runtime.cpu_linear=aten`` keeps ``F.linear`` and the dense weights.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from specdec.core.backend import forget_backend
from specdec.core.kernels import cpu_kernels_available

DTYPES = (torch.float32, torch.bfloat16)  # what oneDNN's packed linear serves here
KERNELS = ("specdec", "onednn")  # what pack() can pack for


# ``specdec::onednn_linear(x, packed, bias)``: oneDNN's linear as one opaque op, so that
# ``torch.compile`` calls it as a kernel (Inductor lowers oneDNN's own op only for weights
# frozen into the graph). Defined through ``torch.library.Library`` rather than
# ``custom_op``, whose Python wrapper cost ~9 us more a call (41 calls a target forward).
_LIB = torch.library.Library("specdec", "DEF")
_LIB.define("onednn_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x [T, in] -> [T, out]`` through oneDNN with ``packed`` from :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_LIB.impl("onednn_linear", _onednn_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("specdec::onednn_linear")
def _(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` in oneDNN's layout for any number of rows (an mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def onednn_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether oneDNN can serve linears of ``dtype`` on ``device`` here. bfloat16 needs the
    CPU's support (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): an AVX2-only CPU (AMD Zen 1-3) has
    none, and packing a bf16 weight there raises, so its bf16 layers keep ``F.linear``."""
    if torch.device(device).type != "cpu" or dtype not in DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or onednn_bf16()


def onednn_bf16() -> bool:
    """Whether this CPU runs oneDNN's bfloat16 products."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def row_kernel_serves(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether our own kernel (``specdec/core/kernels/cpu.cpp``) serves ``dtype`` on
    ``device``: float32 on a CPU where it built (the first call builds it)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and cpu_kernels_available()


def lossless_bf16(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as bfloat16 where that loses nothing (every value is a bfloat16: a bf16
    checkpoint loaded as float32), else ``weight`` itself. Our kernel widens bf16 panels to
    the exact float32 values, so the products are the same bits from half the bytes."""
    w16 = weight.to(torch.bfloat16)
    return w16 if torch.equal(w16.float(), weight) else weight


@functools.cache
def _bf16_columns(p: int) -> torch.Tensor:
    """Where each of a bfloat16 panel's ``p`` columns lies in it (``row_linear_pack`` pairs
    them up): read off by packing the column numbers themselves (exact in bfloat16)."""
    probe = torch.ops.specdec_cpu.row_linear_pack(torch.arange(p, dtype=torch.bfloat16).view(p, 1))
    return torch.argsort(probe.view(p).float())


def unpack(packed: torch.Tensor, out_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``[out_features, in]`` weight of ``dtype`` that ``packed`` was packed from,
    bit for bit: oneDNN's layout (an mkldnn tensor) reordered back, or ours
    (``specdec/core/kernels/cpu.cpp`` ``pack``: panels ``[N/P, K, P]`` of P output columns,
    zero-padded past N; a bfloat16 panel's columns paired up) read back, bfloat16 widened
    to the float32 values it was narrowed from without loss (:func:`lossless_bf16`)."""
    if packed.is_mkldnn:
        return packed.to_dense().to(dtype)
    np_, k, p = packed.shape
    panels = packed[..., _bf16_columns(p)] if packed.dtype == torch.bfloat16 else packed
    return panels.transpose(1, 2).reshape(np_ * p, k)[:out_features].to(dtype, copy=True)


@functools.cache
def unpack_is_exact(kernel: str, dtype: torch.dtype) -> bool:
    """Whether :func:`unpack` gives back exactly what ``kernel`` packed, for weights of
    ``dtype`` (a check on odd-shaped weights with special values, once): where it does not
    (the kernel's layout changed), ``pack_layers`` keeps the dense weights, with a warning."""
    if kernel == "specdec" and not cpu_kernels_available():
        return False
    w = torch.randn(131, 37, generator=torch.Generator().manual_seed(0)).to(dtype)  # (not the global RNG)
    w[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    ws = [w, w.bfloat16().to(dtype)]  # float32 as itself and as bfloat16 values (packed as bf16)
    for w in ws:
        packed = (torch.ops.specdec_cpu.row_linear_pack(lossless_bf16(w)) if kernel == "specdec"
                  else pack_weight(w))
        if not torch.equal(unpack(packed, w.shape[0], dtype).view(torch.uint8), w.view(torch.uint8)):
            warnings.warn(f"specdec.core.linear.unpack does not invert the {kernel!r} kernel's packing of "
                          f"{dtype}: packed layers keep their dense weights", stacklevel=2)
            return False
    return True


def packed_columns(packed: torch.Tensor) -> torch.Tensor:
    """Where each of the P output columns of our kernel's panels ``packed`` lies in a panel."""
    p = packed.shape[-1]
    return (_bf16_columns(p) if packed.dtype == torch.bfloat16 else torch.arange(p)).to(packed.device)


def packed_rows(packed: torch.Tensor, ids: torch.Tensor, rows: int, columns: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the ``[rows, in]`` float32 weight that ``packed`` (our kernel's
    layout, see :func:`unpack`) was packed from, bit for bit: row i is panel i // P's column
    i % P (at ``columns[i % P]``: :func:`packed_columns`), a bfloat16 one widened. What
    ``specdec_cpu::decoder_forward`` reads for a tied embedding. An id outside ``[0, rows)``
    is sent past the panels, so indexing raises."""
    np_, _, p = packed.shape
    ids = torch.where((ids >= 0) & (ids < rows), ids, np_ * p)  # (no host sync; the zero padding is never read)
    return packed[ids // p, :, columns[ids % p]].float()


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    """``like``'s shape, dtype and device on one element (NaN: a read of it shows)."""
    return torch.full((1,), float("nan"), dtype=like.dtype, device=like.device).expand(like.shape)


class Linear(nn.Linear):
    """``nn.Linear`` that multiplies through a packed-weight kernel once :meth:`pack` ran
    (inference only: a call that needs gradients takes ``F.linear``). After
    :meth:`free_dense` its ``weight`` is a placeholder and :meth:`dense_weight` unpacks it."""

    packed: torch.Tensor | None
    kernel: str | None  # the kernel ``packed`` is laid out for: "specdec", "onednn" or None
    dense_freed = False  # ``weight`` is a placeholder: the values live in ``packed`` (or the fused layer's)
    fused_in: tuple[Linear, int] | None = None  # the fused layer whose rows from this offset are this one's
    parts: tuple[Linear, ...] = ()  # a fused layer's parts (:meth:`fused`)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kw: object) -> None:
        super().__init__(in_features, out_features, bias, **kw)  # type: ignore[arg-type]
        self.register_buffer("packed", None, persistent=False)
        self.kernel = None

    def dense_weight(self) -> torch.Tensor:
        """The weight's values: ``weight`` itself, or, after :meth:`free_dense`, a fresh copy
        unpacked from the packed one (this layer's, or its fused layer's rows), bit for bit."""
        if not self.dense_freed:
            return self.weight
        if self.fused_in is not None:
            fused, start = self.fused_in
            return fused.dense_weight()[start : start + self.out_features].clone()
        assert self.packed is not None
        return unpack(self.packed, self.out_features, self.weight.dtype)

    def free_dense(self) -> None:
        """Drops the dense weight of a packed layer (and of its fused parts, ``parts``: see
        :meth:`fused`), keeping a placeholder of its shape, dtype and device: the packed copy
        holds the values (:meth:`dense_weight`). Called by ``pack_layers``."""
        if self.packed is None:
            raise RuntimeError("Linear.free_dense: the layer is not packed; its dense weight is its only copy")
        if self.dense_freed:
            return
        for part in self.parts:
            part.weight = nn.Parameter(_placeholder(part.weight), requires_grad=False)
            part.dense_freed = True
        hold = self._buffers if "weight" in self._buffers else self._parameters
        hold["weight"] = (_placeholder(self.weight) if hold is self._buffers
                          else nn.Parameter(_placeholder(self.weight), requires_grad=False))
        self.dense_freed = True

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.dense_freed and prefix + "weight" in destination:  # the values, not the placeholder
            destination[prefix + "weight"] = self.dense_weight()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object, **kw: object) -> None:
        if self.dense_freed and prefix + "weight" in state_dict:
            raise RuntimeError(f"Linear {prefix.rstrip('.') or '(root)'}: loading weights into a packed layer whose "
                               "dense weight was freed; load them before packing (pack_layers)")
        super()._load_from_state_dict(state_dict, prefix, *args, **kw)  # type: ignore[arg-type]

    @classmethod
    def fused(cls, linears: list[nn.Linear]) -> Linear:
        """One layer over the rows of ``linears`` (e.g. ``[q; k; v]``): one matmul instead of
        several. Its weight and bias are buffers outside the ``state_dict``, and each of
        ``linears`` becomes a view of them (no extra copy)."""
        w = torch.cat([m.dense_weight().detach() for m in linears])
        b = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        start = 0
        for m in linears:
            n = m.weight.shape[0]
            if m.dense_freed:  # fused afresh: its values are in w now
                m.weight = nn.Parameter(w[start : start + n], requires_grad=m.weight.requires_grad)
                m.dense_freed = False
            else:
                m.weight.data = w[start : start + n]
            if b is not None:
                m.bias.data = b[start : start + n]
            m.fused_in = (out, start)
            start += n
        out.in_features, out.out_features = w.shape[1], w.shape[0]
        out.register_buffer("weight", w, persistent=False)
        out.register_buffer("bias", b, persistent=False)
        out.register_buffer("packed", None, persistent=False)
        out.kernel = None
        out.parts = tuple(linears)  # (a plain attribute: not submodules, not in the state_dict)
        return out

    def pack(self, kernel: str = "specdec") -> bool:
        """Packs the weight for ``kernel`` ("specdec" or "onednn") where it serves the
        layer's device and dtype, else for oneDNN where that does; whether it packed."""
        if kernel not in KERNELS:
            raise ValueError(f"Linear.pack: kernel must be one of {KERNELS}, got {kernel!r}")
        if self.dense_freed and self.kernel == kernel:
            return True  # packed already, and the packed copy is the only one
        w = self.dense_weight().detach()
        if kernel == "specdec" and row_kernel_serves(w.device, w.dtype):
            self.packed = torch.ops.specdec_cpu.row_linear_pack(lossless_bf16(w))
            self.kernel = "specdec"
            return True
        if not onednn_available(w.device, w.dtype):
            return False
        self.packed = pack_weight(w)
        self.kernel = "onednn"
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            if self.dense_freed:
                if self.weight.requires_grad:
                    raise RuntimeError(f"Linear({self.in_features} -> {self.out_features}): its weight was packed for "
                                       "inference and its dense copy freed, so it cannot be trained; train "
                                       "before packing (runtime.cpu_linear=aten keeps the dense weights)")
                return F.linear(x, self.dense_weight(), self.bias)  # gradients for x only
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features).contiguous()
        if self.kernel == "specdec":  # eager and compiled alike: the op (a C++ call in the graph)
            out = torch.ops.specdec_cpu.row_linear.default(x2, self.packed, self.bias, self.out_features)
        elif torch.compiler.is_compiling():  # one opaque kernel in the graph
            out = torch.ops.specdec.onednn_linear(x2, self.packed, self.bias)
        else:  # eager: oneDNN's op itself, without the library op's Python call around it
            out = _onednn_linear(x2, self.packed, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


class Embedding(nn.Embedding):
    """``nn.Embedding`` that can read its rows from the head it is tied to, once that head is
    packed for our kernel and its dense weight freed (``pack_layers`` ties them): a tied model
    then holds its vocabulary table once, in the head's packed block. ``weight`` is the head's
    placeholder then (the same parameter: the tie stays visible); the ``state_dict`` unpacks."""

    tied_head: Linear | None = None  # set by pack_layers (read_from): the packed head holding this table
    _columns: torch.Tensor  # packed_columns of its packed weight (found once: not in a compiled forward)

    def read_from(self, head: Linear) -> None:
        """Reads the rows from ``head``, whose weight is this one's, once it is packed for our
        kernel with its dense copy freed; this embedding's dense table is then dropped."""
        self.__dict__["tied_head"] = head  # (a plain attribute, not a submodule: no second state_dict entry)
        if self.packed_head() is not None:
            assert head.packed is not None
            self.__dict__["_columns"] = packed_columns(head.packed)
            self.weight = head.weight  # the placeholder

    def packed_head(self) -> Linear | None:
        """The packed head whose block holds this table (its dense copy freed), else None."""
        head = self.tied_head
        return head if head is not None and head.dense_freed and head.kernel == "specdec" else None

    def _freed_head(self) -> Linear | None:
        head = self.tied_head
        return head if head is not None and head.dense_freed else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self._freed_head()
        if head is None:
            return super().forward(ids)
        if head.kernel == "specdec":
            assert head.packed is not None
            return packed_rows(head.packed, ids, self.num_embeddings, self._columns)
        return F.embedding(ids, head.dense_weight(), self.padding_idx)  # (packed again for oneDNN: unpacked whole)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        head = self._freed_head()
        if head is not None and prefix + "weight" in destination:  # the values, not the placeholder
            destination[prefix + "weight"] = head.dense_weight()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object, **kw: object) -> None:
        if self._freed_head() is not None and prefix + "weight" in state_dict:
            raise RuntimeError(f"Embedding {prefix.rstrip('.') or '(root)'}: loading weights into an embedding read "
                               "from its packed, tied head; load them before packing (pack_layers)")
        super()._load_from_state_dict(state_dict, prefix, *args, **kw)  # type: ignore[arg-type]


def embedding_operand(embed: nn.Module) -> tuple[torch.Tensor, int] | None:
    """What our native ops read as ``embed``'s table, and its rows: its float32 weight, or the
    packed head a tied :class:`Embedding` reads (``specdec_cpu`` ``embedding_rows``); None for
    any other embedding (tensor parallel's, another dtype)."""
    if type(embed) not in (nn.Embedding, Embedding) or embed.weight.dtype != torch.float32:
        return None
    head = embed.packed_head() if isinstance(embed, Embedding) else None
    return (embed.weight if head is None else head.packed), embed.num_embeddings


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: ``weight * x / sqrt(mean(x²) + eps)``, in float32 for
    lower precisions. After :meth:`pack` ("specdec"), an eager float32 CPU call without
    gradients runs our one-pass kernel (``specdec/core/kernels/cpu.cpp``): torch's eager
    ``rms_norm`` is half a dozen ops on a CPU, about ten times the kernel's call.
    Compiled, Inductor fuses ``F.rms_norm`` itself."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel: str | None = None

    def pack(self, kernel: str = "specdec") -> bool:
        """Has the layer use ``kernel`` where it serves the weight's device and dtype."""
        serves = kernel == "specdec" and row_kernel_serves(self.weight.device, self.weight.dtype)
        self.kernel = "specdec" if serves else None
        return serves

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if (self.kernel is not None and not torch.compiler.is_compiling()
                    and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
                return torch.ops.specdec_cpu.rms_norm.default(x, self.weight, self.eps)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # same arithmetic as below
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def pack_layers(module: nn.Module, kernel: str = "specdec") -> int:
    """Packs every :class:`Linear` a forward calls (not the parts of a fused layer) and, for
    "specdec", every :class:`RMSNorm` in ``module`` for ``kernel`` (see :meth:`Linear.pack`
    and the module docstring); the number of linears packed.
    For "specdec" it also sets ``attention_kernel`` on every submodule that declares one (the
    decoders over a paged cache), so their float32 CPU attention runs our kernel too. A module
    with a native backend (``native_operands``) chooses its backend again on the packed weights."""
    for m in module.modules():
        if isinstance(m, RMSNorm):
            m.pack(kernel)
        if hasattr(m, "native_operands"):  # its native backend gathered the old weights: choose again
            forget_backend(m)
        if hasattr(type(m), "attention_kernel"):
            w = next(m.parameters(), None)
            # (our attention kernel reads a head 16 floats at a time: other head sizes keep SDPA,
            # and no native forward, whose attention is that kernel)
            own = (kernel == "specdec" and w is not None and row_kernel_serves(w.device, w.dtype)
                   and getattr(getattr(m, "config", None), "head_dim", 16) % 16 == 0)
            m.attention_kernel = "specdec" if own else None
    # The parts of a fused layer ([q; k; v], [gate; up]) are views of its weight that the
    # forward never calls: packing them too would hold those weights packed twice.
    linears = called_linears([m for m in module.modules() if isinstance(m, Linear)])
    # A layer packed for ``kernel`` already (a head borrowed from a packed target) stays as it is:
    # packing it again would hold it packed twice.
    done = [m for m in linears if m.packed is not None and m.kernel == kernel]
    todo = [m for m in linears if m not in done]
    ours = [m for m in todo if kernel == "specdec" and row_kernel_serves(m.weight.device, m.weight.dtype)]
    ties = _tied_embeddings(module, ours)
    shared = _shared_storages(module, linears, tuple(e for e, _ in ties))
    release_freed_memory()  # (what fusing the projections freed)
    _pack_into_arena(ours, shared)
    for e, m in ties:  # the embedding reads the packed head now: its dense table goes
        e.read_from(m)
    packed = len(done) + len(ours)
    for m in todo:
        if not any(m is o for o in ours) and m.pack(kernel):  # oneDNN's layout
            packed += 1
            # Layer by layer: the next layer's packed copy takes the memory this dense one held.
            if m.weight.untyped_storage().data_ptr() not in shared and unpack_is_exact(m.kernel, m.weight.dtype):
                m.free_dense()
    release_freed_memory()
    return packed


_PACK_CHUNK_BYTES = 4 << 20  # dense weight bytes packed at a time (see _pack_into_arena)


@functools.cache
def _panel_width(dtype: torch.dtype) -> int:
    """P, the output columns of one of our kernel's panels of ``dtype`` (``[N/P, K, P]``)."""
    return int(torch.ops.specdec_cpu.row_linear_pack(torch.zeros(1, 1, dtype=dtype)).shape[-1])


def _is_bf16_valued(w: torch.Tensor) -> bool:
    """Whether every value of ``w`` is a bfloat16 (:func:`lossless_bf16`), checked a few MiB of
    rows at a time: no whole narrowed copy beside it."""
    rows = w.reshape(w.shape[0], -1)
    step = max(1, _PACK_CHUNK_BYTES // max(1, rows.shape[1] * rows.element_size()))
    return all(torch.equal(c.to(torch.bfloat16).float(), c) for c in rows.split(step))


def _pack_into_arena(linears: list[Linear], shared: set[int]) -> None:
    """Packs ``linears`` for our kernel straight into one block of memory on huge pages
    (``specdec_cpu::huge_empty``), in order (each on a cache line of its own). A decode step
    reads them all from DRAM in turn: on 4 KiB pages each 4 KiB was a TLB miss and a stop
    for the CPU's prefetchers. Each is packed a few MiB of rows at a time
    (a panel holds whole rows: P of them), freeing each dense weight once packed (unless
    ``shared`` holds its storage, or :func:`unpack` would not give it back). The block's pages
    are touched only as they are filled, and the freed weights go back to the system as they
    go, so the packed and dense copies of the model are never resident at once: loading
    SmolLM2-135M peaked at 3.1 times its weights when it packed every layer, then copied them all."""
    if not linears:
        return
    plans, total = [], 0
    for m in linears:
        w = m.dense_weight().detach()
        dt = torch.bfloat16 if _is_bf16_valued(w) else w.dtype
        p = _panel_width(dt)
        shape = (-(-w.shape[0] // p), w.shape[1], p)
        total = -(-total // 64) * 64  # each weight on a cache line of its own
        plans.append((m, dt, total, shape))
        total += shape[0] * shape[1] * shape[2] * torch.empty(0, dtype=dt).element_size()
        del w
    arena = torch.ops.specdec_cpu.huge_empty(total)
    for m, dt, off, shape in plans:
        nbytes = shape[0] * shape[1] * shape[2] * torch.empty(0, dtype=dt).element_size()
        view = arena[off : off + nbytes].view(dt).view(shape)
        w = m.dense_weight().detach()
        p = shape[2]
        step = max(1, _PACK_CHUNK_BYTES // max(1, p * w.shape[1] * w.element_size())) * p
        for i in range(0, w.shape[0], step):
            part = torch.ops.specdec_cpu.row_linear_pack(w[i : i + step].to(dt))
            view[i // p : i // p + part.shape[0]].copy_(part)
        m.packed, m.kernel = view, "specdec"
        del w
        if m.weight.untyped_storage().data_ptr() not in shared and unpack_is_exact("specdec", m.weight.dtype):
            m.free_dense()
            release_freed_memory()


def _tied_embeddings(module: nn.Module, linears: list[Linear]) -> list[tuple[Embedding, Linear]]:
    """The :class:`Embedding` s of ``module`` whose weight is one of ``linears``' (a tied head,
    packed for our kernel): they can read their rows from its packed copy instead."""
    heads = {id(m.weight): m for m in linears}
    return [(e, heads[id(e.weight)]) for e in module.modules()
            if isinstance(e, Embedding) and id(e.weight) in heads and e.max_norm is None]


def _shared_storages(module: nn.Module, linears: list[Linear], readers: tuple[nn.Module, ...] = ()) -> set[int]:
    """The storages (data pointers) ``module``'s tensors other than the weights of ``linears``
    and of their fused parts (and of ``readers``: embeddings that will read a packed head)
    hold: a layer whose weight lies in one (a head tied to an embedding that reads it densely)
    keeps its dense weight when packed."""
    slots = {id(m) for m in linears} | {id(p) for m in linears for p in m.parts} | {id(r) for r in readers}
    shared = set()
    for sub in module.modules():
        for name, t in (*sub._parameters.items(), *sub._buffers.items()):
            if t is not None and not t.is_mkldnn and not (id(sub) in slots and name == "weight"):
                shared.add(t.untyped_storage().data_ptr())
    return shared


def release_freed_memory() -> None:
    """Hands the heap's free memory back to the system (glibc's ``malloc_trim``; nothing
    elsewhere). Packing frees a temporary copy of every weight, which glibc keeps under
    ``keep_large_allocations``' 1 GiB trim threshold: 0.6 GiB of SmolLM2-135M's resident
    memory, never used again."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def called_linears(linears: list[Linear]) -> list[Linear]:
    """Those of ``linears`` a forward calls, in order. A fused layer ([q; k; v], [gate; up])
    holds its weight as a buffer and its parts' weights are views of it: the forward calls
    the fused layer only (:meth:`Linear.fused`); once packed, the parts hold placeholders
    (:meth:`Linear.free_dense`), so a second ``pack_layers`` must not take them for layers."""
    fused = {m.weight.untyped_storage().data_ptr() for m in linears if "weight" in m._buffers}
    return [m for m in linears if not (m.dense_freed and m.packed is None)
            and ("weight" in m._buffers or m.weight.untyped_storage().data_ptr() not in fused)]


def register_compiled_lowering() -> None:
    """Has Inductor lower ``specdec::onednn_linear`` to oneDNN's C kernel itself (cpp_wrapper:
    a direct call, no Python in between), not to a call back into Python. Once, before compiling.

    A call back into Python costs more than a small model's one-row kernel itself (its
    compiled one-token forward ran about 1.7 times slower). Inductor's on-disk graph cache does not
    key on lowerings: after changing this one, clear it (``/tmp/torchinductor_$USER``)."""
    from torch._inductor.ir import FixedLayout, TensorBox
    from torch._inductor.lowering import lowerings, register_lowering
    from torch._inductor.mkldnn_ir import LinearUnary, _create_output_node

    op = torch.ops.specdec.onednn_linear.default
    if op in lowerings:
        return

    @register_lowering(op)
    def _lower(x, packed, bias):  # type: ignore[no-untyped-def]
        # As LinearUnary.create, but the packed weight goes in as it is: an mkldnn tensor has
        # no strides, and a "contiguous" copy of it would read its blocked layout as rows.
        x = LinearUnary.require_contiguous(LinearUnary.realize_input(x))
        w = LinearUnary.realize_input(packed)
        inputs, constant_args = [x, w], ["none", [-1], ""]
        if bias is None:
            constant_args.insert(0, None)
        else:
            inputs.append(LinearUnary.require_contiguous(LinearUnary.realize_input(bias)))
        *m, _ = x.get_size()
        layout = FixedLayout(device=x.get_device(), dtype=x.get_dtype(), size=[*m, w.get_size()[0]])
        return TensorBox.create(_create_output_node(LinearUnary(layout=layout, inputs=inputs,
                                                                constant_args=constant_args)))
