"""What a model holds in memory: each weight the forward reads packed once, and a KV cache
sized by the runtime settings (issue 57)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdec.api import LLM
from specdec.core.kernels import cpu_kernels_available
from specdec.core.linear import Linear, onednn_available, pack_layers
from specdec.models.config import LlamaConfig
from specdec.models.llama import LlamaDecoder

TARGET = Path(__file__).resolve().parents[2] / "specdec" / "zoo" / "code-target"
KERNELS = [pytest.param("specdec", marks=pytest.mark.skipif(not cpu_kernels_available(), reason="no specdec kernels")),
           pytest.param("onednn", marks=pytest.mark.skipif(not onednn_available("cpu", torch.float32),
                                                           reason="no oneDNN"))]


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied weights once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and not t.is_mkldnn:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.skipif(not cpu_kernels_available(), reason="specdec's CPU kernels did not build here")
def test_packing_holds_each_projection_the_forward_calls_once():
    # float32 weights that are not bfloat16 values: packed as float32, as large as the dense ones
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    model = LlamaDecoder(cfg)
    model.prepare_for_inference()  # fused [q; k; v] and [gate; up]: views, no extra copy
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    before = _storage_bytes([*model.parameters(), *model.buffers()])
    pack_layers(model)
    packed = sum(m.packed.numel() * m.packed.element_size() for m in model.modules()
                 if isinstance(m, Linear) and m.packed is not None)
    linear_weights = sum(m.weight.numel() * m.weight.element_size() for m in (
        model.lm_head, *(x for layer in model.model.layers for x in (
            layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down_proj))))
    # packing the parts of a fused layer as well held q, k, v, gate and up twice (1.7x here)
    assert packed == linear_weights <= weights
    assert _storage_bytes([*model.parameters(), *model.buffers()]) <= before + packed


def test_default_kv_cache_holds_max_batch_size_sequences_of_max_seq_len():
    llm = LLM(TARGET, max_batch_size=3, max_seq_len=40)
    (cache,) = llm.pipeline.target.caches
    c = llm.pipeline.target.config
    blocks = 3 * -(-40 // cache.params.block_size)  # whole blocks for each of 3 sequences of 40
    assert cache.params.num_blocks == blocks
    token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # K and V, float32
    assert cache.params.nbytes == blocks * cache.params.block_size * token
    assert cache.tensors.k.nbytes + cache.tensors.v.nbytes == cache.params.nbytes
    (cache,) = LLM(TARGET, max_batch_size=3, max_seq_len=40, num_blocks=5).pipeline.target.caches
    assert cache.params.num_blocks == 5  # an explicit num_blocks is what it holds


def _tiny(tie: bool, bf16_values: bool = False) -> LlamaDecoder:
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie)
    model = LlamaDecoder(cfg)
    if bf16_values:  # a bf16 checkpoint loaded as float32: packed as bfloat16 by our kernel
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
    return model


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("tie", [False, True])
def test_packing_frees_the_dense_weight_beside_each_packed_one(kernel, tie):
    model = _tiny(tie)
    model.prepare_for_inference()
    embedding = model.model.embed_tokens.weight
    others = sum(t.untyped_storage().nbytes() for n, t in model.named_parameters()
                 if "norm" in n or "embed" in n)  # what no Linear packs
    pack_layers(model, kernel)
    packed = sum(m.packed.numel() * m.packed.element_size() for m in model.modules()
                 if isinstance(m, Linear) and m.packed is not None)
    placeholders = sum(m.weight.untyped_storage().nbytes() for m in model.modules()
                       if isinstance(m, Linear) and m.dense_freed)
    assert placeholders <= 4 * 32  # a float each, where the dense weights were
    held = _storage_bytes([*model.parameters(), *model.buffers()])
    # before: each projection dense (q, k, v, gate, up through their fused layers) and packed
    assert held <= others + placeholders + (0 if kernel == "onednn" else packed)
    # a head tied to the embedding: the embedding reads its rows from our kernel's packed head, so
    # the dense table goes too; oneDNN's layout serves no rows, so there the head keeps it
    from_packed = tie and kernel == "specdec"
    assert model.lm_head.dense_freed is (not tie or from_packed)
    assert (model.model.embed_tokens.weight is embedding) is not from_packed
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tie
    assert not from_packed or model.model.embed_tokens.weight.untyped_storage().nbytes() <= 4


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bf16_values", [False, True])
def test_a_packed_model_gives_its_dense_weights_back_bit_for_bit(kernel, bf16_values):
    model = _tiny(tie=False, bf16_values=bf16_values)
    model.model.layers[0].mlp.down_proj.weight.data[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    want = {k: v.clone() for k, v in model.state_dict().items()}
    model.prepare_for_inference()
    pack_layers(model, kernel)
    assert model.model.layers[0].mlp.down_proj.dense_freed
    got = model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(_bits(got[k]), _bits(want[k])) for k in want)  # q/k/v, gate/up: from the fused layers
    # a model built from it packs to the very same bits: greedy outputs cannot change
    again = LlamaDecoder(model.config)
    again.load_state_dict(got)
    again.prepare_for_inference()
    pack_layers(again, kernel)
    if kernel == "specdec":
        a, b = model.model.layers[1].self_attn.qkv.packed, again.model.layers[1].self_attn.qkv.packed
        assert a.dtype == (torch.bfloat16 if bf16_values else torch.float32) and torch.equal(_bits(a), _bits(b))
    x = torch.randn(5, 64)
    with torch.inference_mode():
        assert torch.equal(model.lm_head(x), again.lm_head(x))
    # gradients for an input (a drafter trained through a frozen head) take the unpacked weight
    xg, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    model.lm_head(xg).sum().backward()
    torch.nn.functional.linear(xr, want["lm_head.weight"]).sum().backward()
    assert torch.equal(xg.grad, xr.grad)


def test_a_packed_layer_refuses_training_and_loading_naming_it():
    model = _tiny(tie=False)
    model.prepare_for_inference()
    pack_layers(model)
    layer = model.model.layers[1].mlp.down_proj
    layer.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"Linear\(128 -> 64\).*cannot be trained"):
        layer(torch.randn(2, 128))
    with pytest.raises(RuntimeError, match=r"Linear model\.layers\.0\.self_attn\.q_proj: .*load them before packing"):
        model.load_state_dict(_tiny(tie=False).state_dict())


def test_a_loaded_model_holds_its_checkpoint_packed_only():
    stored = load_file(TARGET / "model.safetensors")
    llm = LLM(TARGET, max_batch_size=1, max_seq_len=32)
    module = llm.pipeline.target.module
    linears = [m for m in module.modules() if isinstance(m, Linear)]
    dense = sum(m.weight.untyped_storage().nbytes() for m in linears if not m.dense_freed)
    tied = module.lm_head.weight.untyped_storage().nbytes() if not module.lm_head.dense_freed else 0
    assert dense == tied  # only a head tied to the embedding keeps a dense weight
    got = module.state_dict()
    assert all(torch.equal(_bits(got[k]), _bits(v.float())) for k, v in stored.items() if k in got)
