"""The models' linear layer, with an optional oneDNN path for CPU inference.

Every projection of the built-in architectures is a :class:`Linear` (an
``nn.Linear``: same parameters, same ``state_dict``). :func:`pack_linears`
gives each one a copy of its weight in oneDNN's layout, after which the layer
multiplies through oneDNN instead of ``F.linear`` (MKL's sgemm on torch's CPU
wheel). Why:

- **Speed on CPUs MKL does not favour.** On a 2-core AMD EPYC (Zen 4) the
  built-in target's 41 matmuls took 4.7 ms a one-token forward through MKL and
  3.2 ms through oneDNN; at 5 rows 5.9 against 2.3 ms, at 17 rows 8.2 against
  3.2 (``experiments/bench/ar.py`` reports the path it ran). Where MKL is
  strong it is the faster path: on a 2-core Intel Xeon (AVX-512) the compiled
  one-token forward took 1.55 ms through MKL against 2.27 through oneDNN,
  whose call costs ~14 us beside its 4 us kernel (256 x 256, one row).
- **One row's result does not depend on the rows beside it.** oneDNN's
  runtime-sized kernel (weights packed for any batch) computes each output
  row in the same order whatever the number of rows; MKL's sgemm picks its
  kernel by shape, so a row verified among γ + 1 can differ in the last bits
  from the same row decoded alone; ``tests/core/test_linear.py`` holds it.

The packed copy doubles the weights' memory (the dense weight stays: the
``state_dict``, tensor-parallel sharding and ``build_module`` read it) and is
stale after an in-place weight update: pack after loading, as
:class:`~specdec.core.pipeline_model.DecoderPipelineModel` does, never before
training. ``runtime.cpu_linear=aten`` keeps ``F.linear``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = (torch.float32, torch.bfloat16)  # what oneDNN's packed linear serves here


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


class Linear(nn.Linear):
    """``nn.Linear`` that multiplies through oneDNN once :meth:`pack` ran (inference only:
    a call that needs gradients takes ``F.linear``)."""

    packed: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kw: object) -> None:
        super().__init__(in_features, out_features, bias, **kw)  # type: ignore[arg-type]
        self.register_buffer("packed", None, persistent=False)

    @classmethod
    def fused(cls, linears: list[nn.Linear]) -> Linear:
        """One layer over the rows of ``linears`` (e.g. ``[q; k; v]``): one matmul instead of
        several. Its weight and bias are buffers outside the ``state_dict``, and each of
        ``linears`` becomes a view of them (no extra copy)."""
        w = torch.cat([m.weight.detach() for m in linears])
        b = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
        start = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight.data = w[start : start + n]
            if b is not None:
                m.bias.data = b[start : start + n]
            start += n
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.in_features, out.out_features = w.shape[1], w.shape[0]
        out.register_buffer("weight", w, persistent=False)
        out.register_buffer("bias", b, persistent=False)
        out.register_buffer("packed", None, persistent=False)
        return out

    def pack(self) -> bool:
        """Packs the weight for oneDNN where it can serve it; whether it did."""
        if not onednn_available(self.weight.device, self.weight.dtype):
            return False
        self.packed = pack_weight(self.weight)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features).contiguous()
        if torch.compiler.is_compiling():  # one opaque kernel in the graph
            out = torch.ops.specdec.onednn_linear(x2, self.packed, self.bias)
        else:  # eager: oneDNN's op itself, without the library op's Python call around it
            out = _onednn_linear(x2, self.packed, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def pack_linears(module: nn.Module) -> int:
    """Packs every :class:`Linear` in ``module`` for oneDNN (see the module docstring);
    the number packed."""
    return sum(m.pack() for m in module.modules() if isinstance(m, Linear))


def register_compiled_lowering() -> None:
    """Has Inductor lower ``specdec::onednn_linear`` to oneDNN's C kernel itself (cpp_wrapper:
    a direct call, no Python in between), not to a call back into Python. Once, before compiling.

    On the built-in target's compiled one-token forward: 2.7-3.2 ms against 4.8-6.2 with the
    call back into Python (12.5 us a call, 41 calls). Inductor's on-disk graph cache does not
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
