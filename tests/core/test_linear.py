"""``runtime.cpu_linear=onednn``: the models' projections through oneDNN with packed weights.

What it must keep: the same values as ``F.linear`` (to float rounding), the same
``state_dict``, gradients where a caller needs them, and — what makes it more
than a speed switch — one row's result whatever rows share the call, so that a
row verified among γ + 1 gets the bits it gets decoded alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.core import linear
from specdec.core.linear import Linear, onednn_available, pack_linears
from specdec.core.pipeline_model import RuntimeConfig
from specdec.models.config import LlamaConfig
from specdec.models.llama import LlamaDecoder

needs_onednn = pytest.mark.skipif(not onednn_available("cpu", torch.float32), reason="no oneDNN in this torch")
# oneDNN's bf16 products need AVX-512 BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only CPU has neither)
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not onednn_available("cpu", torch.bfloat16), reason="this CPU has no oneDNN bf16"))]
SHAPES = [(256, 768), (768, 256), (256, 4096), (48, 80)]


def rows_independent(layer: Linear, rows: tuple[int, ...] = (1, 2, 5, 9, 17, 64), seed: int = 0) -> bool:
    """Whether ``layer`` gives each row the same bits whatever rows share its call."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(rows) + 3, layer.in_features, generator=g).to(layer.weight.dtype)
    with torch.inference_mode():
        full = layer(x)
        return all(torch.equal(layer(x[s : s + n]), full[s : s + n]) for n in rows for s in (0, 3))


def _linear(n_in: int, n_out: int, dtype: torch.dtype, bias: bool = True, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    return Linear(n_in, n_out, bias=bias).to(dtype)


@needs_onednn
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_packed_layer_computes_f_linear(n_in, n_out, dtype):
    layer = _linear(n_in, n_out, dtype)
    x = torch.randn(2, 7, n_in).to(dtype)  # a leading batch dim too: [..., in]
    want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert layer.pack()
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (2, 7, n_out) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.double(), want, atol=tol * want.abs().max().item(), rtol=0)


@needs_onednn
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_a_packed_rows_bits_do_not_depend_on_the_rows_beside_it(n_in, n_out, dtype):
    layer = _linear(n_in, n_out, dtype, bias=False)
    assert layer.pack()
    assert rows_independent(layer)
    # and the check can fail: a layer whose row depends on the batch's size is caught
    unfair = _linear(n_in, n_out, dtype, bias=False)
    unfair.forward = lambda x: F.linear(x, unfair.weight) + 0.5 * (x.shape[0] > 1)  # type: ignore[method-assign]
    assert not rows_independent(unfair)


@needs_onednn
def test_packing_keeps_the_state_dict_and_gradients_take_f_linear():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = LlamaDecoder(cfg)
    keys = set(model.state_dict())
    model.prepare_for_inference()  # fused q/k/v and gate/up: outside the state_dict
    n = pack_linears(model)
    assert n == 2 * 9 + 1  # per layer q, k, v, o, gate, up, down and the fused qkv, gate_up; lm_head
    assert set(model.state_dict()) == keys
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 48, requires_grad=True)
    layer(x).sum().backward()  # through F.linear: oneDNN's op has no backward here
    assert torch.allclose(x.grad, layer.weight.detach().sum(0).expand(3, -1), atol=1e-5)


def test_cpu_linear_is_checked():
    with pytest.raises(ValueError, match="runtime.cpu_linear"):
        RuntimeConfig(cpu_linear="mkl")
    layer = _linear(8, 8, torch.float64)
    assert not layer.pack() and layer.packed is None  # float64: not served, F.linear stays


@needs_onednn
def test_compiled_packed_layer_runs_onednn_in_the_graph_and_matches_eager():
    # Inductor lowers specdec::onednn_linear to oneDNN's C kernel with the packed weight
    # passed as it is (a "contiguous" copy of an mkldnn tensor reads garbage).
    from specdec.core.pipeline_model import compile_function

    layer = _linear(64, 96, torch.float32)
    assert layer.pack()
    fn = compile_function(lambda x: F.silu(layer(x)), torch.device("cpu"))
    with torch.inference_mode():
        for rows in (3, 1, 7):
            x = torch.randn(rows, 64)
            assert torch.allclose(fn(x), F.silu(layer(x)), atol=1e-5, rtol=0)


@needs_onednn
def test_without_onednn_bf16_a_bf16_model_keeps_f_linear(monkeypatch):
    # An AVX2-only CPU has no oneDNN bf16: packing a bf16 weight there raised, so a bf16
    # run could not even load. Its bf16 layers must stay on F.linear; fp32 ones still pack.
    monkeypatch.setattr(linear, "onednn_bf16", lambda: False)
    layer = _linear(256, 768, torch.bfloat16)
    assert not layer.pack() and layer.packed is None
    x = torch.randn(3, 256).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    assert pack_linears(LlamaDecoder(cfg).to(torch.bfloat16)) == 0
    assert pack_linears(LlamaDecoder(cfg)) > 0
