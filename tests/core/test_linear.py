"""``runtime.cpu_linear``: the models' projections (and norms) through packed-weight kernels.

Two kernels: ``specdec`` (our own, ``specdec/core/kernels/cpu.cpp``, float32; weights
that are all bfloat16 values packed as bfloat16) and
``onednn`` (oneDNN's runtime-sized kernel, float32 and bfloat16). What each must
keep: the same values as ``F.linear`` (to float rounding), the same ``state_dict``,
gradients where a caller needs them, and — what makes it more than a speed switch —
one row's result whatever rows share the call, so that a row verified among γ + 1
gets the bits it gets decoded alone.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from specdec.core import kernels, linear
from specdec.core.kernels import cpu_kernels_available
from specdec.core.linear import Linear, RMSNorm, onednn_available, pack_layers
from specdec.core.pipeline_model import RuntimeConfig
from specdec.models.config import LlamaConfig
from specdec.models.llama import LlamaDecoder

needs_onednn = pytest.mark.skipif(not onednn_available("cpu", torch.float32), reason="no oneDNN in this torch")
needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="specdec's CPU kernels did not build here")
# (kernel, dtype) pairs a packed layer serves. oneDNN's bf16 products need AVX-512 BW/VL/DQ
# or AVX-NE-CONVERT (an AVX2-only CPU has neither).
CASES = [
    pytest.param("specdec", torch.float32, marks=needs_kernels, id="specdec-fp32"),
    pytest.param("onednn", torch.float32, marks=needs_onednn, id="onednn-fp32"),
    pytest.param("onednn", torch.bfloat16, id="onednn-bf16", marks=pytest.mark.skipif(
        not onednn_available("cpu", torch.bfloat16), reason="this CPU has no oneDNN bf16")),
]
SHAPES = [(256, 768), (768, 256), (256, 4096), (48, 80)]


def rows_independent(layer: torch.nn.Module, n_in: int, dtype: torch.dtype,
                     rows: tuple[int, ...] = (1, 2, 5, 7, 9, 17, 64), seed: int = 0) -> bool:
    """Whether ``layer`` gives each row the same bits whatever rows share its call."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(rows) + 3, n_in, generator=g).to(dtype)
    with torch.inference_mode():
        full = layer(x)
        return all(torch.equal(layer(x[s : s + n]), full[s : s + n]) for n in rows for s in (0, 3))


def _linear(n_in: int, n_out: int, dtype: torch.dtype, bias: bool = True, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    return Linear(n_in, n_out, bias=bias).to(dtype)


@pytest.mark.parametrize("kernel,dtype", CASES)
@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_packed_layer_computes_f_linear(kernel, dtype, n_in, n_out):
    layer = _linear(n_in, n_out, dtype)
    x = torch.randn(2, 7, n_in).to(dtype)  # a leading batch dim too: [..., in]
    want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert layer.pack(kernel) and layer.kernel == kernel
    with torch.inference_mode():
        got = layer(x)
        assert torch.equal(layer(x.transpose(0, 1)).transpose(0, 1), got)  # a strided input too
    assert got.shape == (2, 7, n_out) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.double(), want, atol=tol * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("kernel,dtype", CASES)
@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_a_packed_rows_bits_do_not_depend_on_the_rows_beside_it(kernel, dtype, n_in, n_out):
    layer = _linear(n_in, n_out, dtype, bias=False)
    assert layer.pack(kernel)
    assert rows_independent(layer, n_in, dtype)
    # and the check can fail: a layer whose row depends on the batch's size is caught
    unfair = _linear(n_in, n_out, dtype, bias=False)
    unfair.forward = lambda x: F.linear(x, unfair.weight) + 0.5 * (x.shape[0] > 1)  # type: ignore[method-assign]
    assert not rows_independent(unfair, n_in, dtype)


@needs_kernels
@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_bf16_valued_weights_pack_as_bf16_and_give_the_same_bits(n_in, n_out):
    # A bf16 checkpoint loaded as float32 (the built-in pair): every weight is a bfloat16
    # value, so our kernel keeps half the bytes and widens them back exactly.
    layer = _linear(n_in, n_out, torch.float32)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.to(torch.bfloat16).float())
    assert layer.pack("specdec") and layer.packed.dtype == torch.bfloat16
    full = torch.ops.specdec_cpu.row_linear_pack(layer.weight.detach())  # the float32 panels
    assert full.dtype == torch.float32 and full.numel() == layer.packed.numel()
    x = torch.randn(13, n_in)
    with torch.inference_mode():
        for m in (1, 2, 5, 6, 7, 13):  # every micro-kernel height, and a tail
            want = torch.ops.specdec_cpu.row_linear(x[:m], full, layer.bias, n_out)
            assert torch.equal(layer(x[:m]), want)
    assert rows_independent(layer, n_in, torch.float32)
    # One value that is not a bfloat16: the layer keeps float32 panels (nothing is rounded).
    with torch.no_grad():
        layer.weight[0, 0] += 2.0**-20
    assert layer.pack("specdec") and layer.packed.dtype == torch.float32


@needs_kernels
def test_our_kernels_give_the_same_bits_on_one_thread_as_on_two():
    # Threads split a layer's outputs (whole panels), never its sums: a run's figures must
    # not depend on runtime.threads. The vocabulary head and a wide batch use both threads.
    layer, norm = _linear(256, 4096, torch.float32), RMSNorm(256, 1e-6)
    assert layer.pack("specdec") and norm.pack("specdec")
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(37, 256)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.inference_mode():
                outs.append((layer(x), norm(x)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@needs_kernels
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-panels", "bf16-panels"])
def test_every_row_count_up_to_64_gives_a_row_the_bits_it_gets_alone(bf16):
    # A verify pass of gamma + 1 rows, a batch of requests: the kernel blocks rows in
    # registers (several rows per weight load, a tail of fewer), and every split of 1..64
    # rows must give each row the sums it gets alone, with and without a bias.
    for bias in (False, True):
        layer = _linear(256, 320, torch.float32, bias=bias)
        if bf16:
            with torch.no_grad():
                layer.weight.copy_(layer.weight.to(torch.bfloat16).float())
        assert layer.pack("specdec") and layer.packed.dtype == (torch.bfloat16 if bf16 else torch.float32)
        x = torch.randn(67, 256)
        with torch.inference_mode():
            alone = torch.cat([layer(x[i : i + 1]) for i in range(67)])
            for m in range(1, 65):
                for s in (0, 3):
                    assert torch.equal(layer(x[s : s + m]), alone[s : s + m]), (m, s, bias)


@needs_kernels
def test_the_kernel_benchmarks_timer_times_each_product_and_names_a_mismatch():
    # specdec_cpu::row_linear_timed (experiments/bench/kernel.py): a forward's products back
    # to back, one time per product and pass; a list that does not line up is named.
    layers = [_linear(64, 128, torch.float32, bias=False), _linear(128, 64, torch.float32, bias=False)]
    assert all(m.pack("specdec") for m in layers)
    xs, packed = [torch.randn(3, 64), torch.randn(3, 128)], [m.packed for m in layers]
    secs = torch.ops.specdec_cpu.row_linear_timed(xs, packed, [128, 64], 4)
    assert secs.shape == (4, 2) and secs.dtype == torch.float64 and bool((secs >= 0).all())
    with pytest.raises(RuntimeError, match="want as many x as packed weights and out_features"):
        torch.ops.specdec_cpu.row_linear_timed(xs, packed[:1], [128, 64], 1)
    with pytest.raises(RuntimeError, match="packed weight .* does not serve"):
        torch.ops.specdec_cpu.row_linear_timed(xs[::-1], packed, [128, 64], 1)


@needs_kernels
@pytest.mark.parametrize("d", [256, 16, 40])  # a row of whole vectors, a Qwen3 head, a ragged tail
def test_packed_rms_norm_computes_f_rms_norm_per_row(d):
    norm = RMSNorm(d, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 9, d) * 3
    want = F.rms_norm(x.double(), (d,), norm.weight.double(), 1e-6)
    assert norm.pack("specdec")
    with torch.inference_mode():
        got = norm(x)
        assert torch.equal(norm(x.transpose(0, 1)).transpose(0, 1), got)  # a strided input (q/k heads)
    assert got.shape == x.shape
    assert torch.allclose(got.double(), want, atol=1e-5 * want.abs().max().item(), rtol=0)
    assert rows_independent(norm, d, torch.float32)
    # with gradients wanted, F.rms_norm (the kernel has no backward)
    xg = x.clone().requires_grad_(True)
    norm(xg).sum().backward()
    assert xg.grad is not None and xg.grad.abs().sum() > 0


@pytest.mark.parametrize("kernel", [pytest.param("specdec", marks=needs_kernels),
                                    pytest.param("onednn", marks=needs_onednn)])
def test_packing_keeps_the_state_dict_and_gradients_take_f_linear(kernel):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = LlamaDecoder(cfg)
    keys = set(model.state_dict())
    model.prepare_for_inference()  # fused q/k/v and gate/up: outside the state_dict
    n = pack_layers(model, kernel)
    assert n == 2 * 4 + 1  # per layer the fused qkv, o, the fused gate_up, down (not their parts); lm_head
    assert {m.kernel for m in model.modules() if isinstance(m, Linear)} == {kernel, None}
    assert set(model.state_dict()) == keys
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 48, requires_grad=True)
    layer(x).sum().backward()  # through F.linear: the packed kernels have no backward
    assert torch.allclose(x.grad, layer.dense_weight().sum(0).expand(3, -1), atol=1e-5)  # (unpacked: freed)


@pytest.mark.parametrize("kernel", [pytest.param("specdec", marks=needs_kernels),
                                    pytest.param("onednn", marks=needs_onednn)])
def test_packing_a_packed_model_again_packs_nothing_more(kernel):
    # (a module built over a packed one packs it again: the fused layers' parts, whose
    # dense weights packing freed, must not be packed from their placeholders)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = LlamaDecoder(cfg).prepare_for_inference()
    first = pack_layers(model, kernel)
    packed = {id(m) for m in model.modules() if isinstance(m, Linear) and m.packed is not None}
    assert pack_layers(model, kernel) == first
    assert {id(m) for m in model.modules() if isinstance(m, Linear) and m.packed is not None} == packed


def test_cpu_linear_is_checked():
    with pytest.raises(ValueError, match="runtime.cpu_linear"):
        RuntimeConfig(cpu_linear="mkl")
    layer = _linear(8, 8, torch.float64)
    assert not layer.pack() and layer.packed is None  # float64: no kernel serves it, F.linear stays
    with pytest.raises(ValueError, match="Linear.pack: kernel"):
        layer.pack("mkl")


@needs_kernels
def test_our_kernel_names_the_operand_that_does_not_fit():
    layer = _linear(64, 96, torch.float32)
    assert layer.pack("specdec")
    with pytest.raises(RuntimeError, match="specdec::row_linear: packed weight"):
        torch.ops.specdec_cpu.row_linear(torch.randn(2, 63), layer.packed, None, 96)
    with pytest.raises(RuntimeError, match="specdec::row_linear: want float32"):
        torch.ops.specdec_cpu.row_linear(torch.randn(2, 64).double(), layer.packed, None, 96)
    with pytest.raises(RuntimeError, match="bias has 95 values for 96 outputs"):
        torch.ops.specdec_cpu.row_linear(torch.randn(2, 64), layer.packed, torch.randn(95), 96)


@needs_onednn
def test_where_our_kernel_did_not_build_fp32_layers_take_onednn(monkeypatch):
    monkeypatch.setattr(linear, "cpu_kernels_available", lambda: False)
    layer, norm = _linear(64, 96, torch.float32), RMSNorm(64, 1e-6)
    assert layer.pack("specdec") and layer.kernel == "onednn"
    assert not norm.pack("specdec") and norm.kernel is None
    x = torch.randn(5, 64)
    with torch.inference_mode():
        assert torch.equal(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-6))
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=0)


def test_a_failed_build_warns_naming_the_source_and_returns_false(monkeypatch):
    import torch.utils.cpp_extension as ext

    def no_compiler(*a: object, **k: object) -> None:
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(ext, "load", no_compiler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernels.cpu_kernels_available.__wrapped__() is False  # the uncached builder
    assert any("cpu.cpp" in str(w.message) and "command not found" in str(w.message) for w in caught)


@pytest.mark.parametrize("kernel", [pytest.param("specdec", marks=needs_kernels),
                                    pytest.param("onednn", marks=needs_onednn)])
def test_compiled_packed_layer_matches_eager(kernel):
    # Both kernels are one opaque call in the graph: ours its op, oneDNN's lowered by Inductor
    # to its C kernel with the packed weight passed as it is (a "contiguous" copy of an mkldnn
    # tensor reads garbage). Ours is the same code compiled or not: the same bits.
    from specdec.core.pipeline_model import compile_function

    layer = _linear(64, 96, torch.float32)
    assert layer.pack(kernel)
    fn = compile_function(lambda x: F.silu(layer(x)), torch.device("cpu"))
    with torch.inference_mode():
        for rows in (3, 1, 7):
            x = torch.randn(rows, 64)
            got, want = fn(x), F.silu(layer(x))
            assert torch.equal(got, want) if kernel == "specdec" else torch.allclose(got, want, atol=1e-5, rtol=0)


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
    assert pack_layers(LlamaDecoder(cfg).to(torch.bfloat16)) == 0
    assert pack_layers(LlamaDecoder(cfg)) > 0


@needs_kernels
def test_a_tied_embedding_reads_its_rows_from_the_packed_head_compiled_or_not():
    # After packing, the embedding tied to a head holds no table: its rows come from the head's
    # packed panels (bfloat16 ones paired up, padded past the 100 rows), the values it held;
    # traced too (one graph: nothing in its forward that dynamo cannot follow).
    embed, head = linear.Embedding(100, 32), Linear(32, 100, bias=False)
    embed.weight.data = embed.weight.data.bfloat16().float()  # (a bf16 checkpoint's: bfloat16 panels)
    head.weight = embed.weight
    model = torch.nn.ModuleList([embed, head])
    want = embed.weight.detach().clone()
    assert pack_layers(model) == 1 and pack_layers(model) == 1  # (again: nothing more, the tie kept)
    assert head.packed.dtype == torch.bfloat16 and embed.weight is head.weight
    assert embed.weight.untyped_storage().nbytes() <= 4
    ids = torch.tensor([[0, 5, 99], [63, 64, 31]])
    fn = torch.compile(embed, backend="eager", fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(embed(ids), want[ids]) and torch.equal(fn(ids), want[ids])
        with pytest.raises(IndexError):
            embed(torch.tensor([100]))
