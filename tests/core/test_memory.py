"""What a model holds in memory: each weight the forward reads packed once, and a KV cache
sized by the runtime settings (issue 57)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.api import LLM
from specdec.core.kernels import cpu_kernels_available
from specdec.core.linear import Linear, pack_layers
from specdec.models.config import LlamaConfig
from specdec.models.llama import LlamaDecoder

TARGET = Path(__file__).resolve().parents[2] / "specdec" / "zoo" / "code-target"


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
