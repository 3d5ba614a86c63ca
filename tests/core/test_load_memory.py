"""Loading keeps one copy of each weight: tensors converted a few rows at a time straight into
the storage the module keeps, and packed straight into the one packed block (issue 57)."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specdec.core import checkpoint, gguf, linear
from specdec.core.checkpoint import load_decoder
from specdec.core.kernels import cpu_kernels_available
from specdec.core.backend import backend_of
from specdec.core.inputs import KVCacheTensors
from specdec.core.linear import Linear, lossless_bf16, pack_layers

from packing import pack_rows  # tests/packing.py

TARGET = Path(__file__).resolve().parents[2] / "specdec" / "zoo" / "code-target"


def test_a_bf16_checkpoint_loads_as_float32_in_chunks_each_weight_in_a_storage_of_its_own(monkeypatch):
    monkeypatch.setattr(checkpoint, "_CHUNK_BYTES", 3000)  # a few rows at a time: many chunks a tensor
    module = load_decoder(TARGET, dtype=torch.float32).module
    stored = load_file(str(TARGET / "model.safetensors"))
    params = dict(module.named_parameters())
    for name, t in stored.items():
        p = params[name]
        assert p.dtype == torch.float32 and torch.equal(p, t.float()), name
        # the storage holds this weight only: no whole stored-type copy or larger buffer kept behind it
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), name


def _mapped_rss(path: Path) -> int:
    """Bytes of ``path``'s mapped pages resident in this process (/proc/self/smaps)."""
    smaps = Path("/proc/self/smaps").read_text()
    return sum(int(kb) * 1024 for kb in re.findall(rf" {re.escape(str(path))}\n(?:[^\n]*\n)*?Rss:\s+(\d+) kB", smaps))


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="needs Linux's /proc/self/smaps")
def test_a_safetensors_files_pages_are_not_resident_while_its_tensors_load(monkeypatch):
    """Each tensor is read into the storage the module keeps; the file's own pages (half the
    float32 weights again for a bf16 file) do not count in the process's memory meanwhile."""
    file = (TARGET / "model.safetensors").resolve()
    with safe_open(str(file), "pt") as f:
        n = len(f.keys())
    loads, resident = [], []
    fill = checkpoint.fill_module

    def measured(dtype=None, *, load):
        t = load(dtype)
        loads.append(1)
        if len(loads) % 8 == 0 or len(loads) == n:  # (reading smaps takes a while)
            resident.append(_mapped_rss(file))
        return t

    monkeypatch.setattr(checkpoint, "fill_module", lambda module, entries, **kw: fill(
        module, ((*head, functools.partial(measured, load=load)) for *head, load in entries), **kw))
    module = load_decoder(TARGET, dtype=torch.float32).module
    assert len(loads) == n and max(resident) < file.stat().st_size // 16
    stored = load_file(str(file))
    for name, p in module.named_parameters():
        assert torch.equal(p, stored[name].float()), name


def test_gguf_tensors_dequantize_in_chunks_as_they_do_whole(tmp_path, monkeypatch):
    gg = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    heads, head_dim, hidden = 4, 8, 32
    q = rng.standard_normal((heads * head_dim, hidden)).astype(np.float32)
    e = rng.standard_normal((50, hidden)).astype(np.float32)
    path = tmp_path / "t.gguf"
    w = gg.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", gg.quants.quantize(q, gg.GGMLQuantizationType.Q8_0),
                 raw_dtype=gg.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", e)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()

    class Cfg:
        num_attention_heads, num_key_value_heads = heads, heads

    def loaded() -> dict[str, torch.Tensor]:
        return {n: load(torch.bfloat16) for n, _, _, load in gguf.GGUFCheckpoint(path).iter_tensors(Cfg)}

    whole = loaded()
    monkeypatch.setattr(gguf, "_CHUNK_BYTES", 1)  # a Q head's rows (or one embedding row) at a time
    chunked = loaded()
    ref = gguf.unpermute(torch.from_numpy(gg.quants.dequantize(
        gg.quants.quantize(q, gg.GGMLQuantizationType.Q8_0), gg.GGMLQuantizationType.Q8_0)), heads)
    assert torch.equal(whole["model.layers.0.self_attn.q_proj.weight"], ref.bfloat16())
    assert torch.equal(whole["model.embed_tokens.weight"], torch.from_numpy(e).bfloat16())
    for name in whole:
        assert chunked[name].dtype == torch.bfloat16 and torch.equal(chunked[name], whole[name]), name


@pytest.mark.skipif(not cpu_kernels_available(), reason="specdec's CPU kernels did not build here")
@pytest.mark.parametrize("bf16_values", [False, True])
def test_packing_in_chunks_fills_one_block_and_frees_every_dense_weight_the_tied_one_too(monkeypatch, bf16_values):
    module = load_decoder(TARGET, dtype=torch.float32).module
    if not bf16_values:  # float32 values that are not bfloat16: packed as float32
        with torch.no_grad():
            for p in module.parameters():
                p.add_(p.abs() * 2**-12)
    module.prepare_for_inference()
    called = linear.called_linears([m for m in module.modules() if isinstance(m, Linear)])
    expected = [torch.ops.specdec_cpu.row_linear_pack(lossless_bf16(m.weight.detach())) for m in called]
    monkeypatch.setattr(linear, "_PACK_CHUNK_BYTES", 5000)  # a panel's rows at a time: many chunks a weight
    assert pack_layers(module) == len(called)
    arena = {m.packed.untyped_storage().data_ptr() for m in called}
    assert len(arena) == 1  # one block, each packed weight a view of it
    for m, want in zip(called, expected):
        assert m.packed.dtype == want.dtype == (torch.bfloat16 if bf16_values else torch.float32)
        assert torch.equal(m.packed.view(torch.uint8), want.view(torch.uint8))
    for m in called:  # no dense copy beside the packed one (the tied embedding reads the packed head)
        assert m.dense_freed and m.weight.untyped_storage().nbytes() <= m.weight.element_size()
    assert module.model.embed_tokens.weight is module.lm_head.weight


@pytest.mark.skipif(not cpu_kernels_available(), reason="specdec's CPU kernels did not build here")
def test_a_packed_tied_model_holds_its_vocabulary_table_once_with_the_same_outputs():
    """The built-in target ties its embedding to its head: packed, it keeps no dense table
    beside the packed head, and gives what the same weights give with the embedding untied
    (a dense table beside the same packed head), its state_dict the unpacked model's."""
    tied = load_decoder(TARGET, dtype=torch.float32).module
    untied = load_decoder(TARGET, dtype=torch.float32).module
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())  # untie: same values
    before = {k: v.clone() for k, v in tied.state_dict().items()}
    for m in (tied, untied):
        m.prepare_for_inference()
        pack_layers(m)
        m.ensure_rope(64)
    table = tied.config.vocab_size * tied.config.hidden_size * 4  # bytes of the dense table
    arena = tied.lm_head.packed.untyped_storage().data_ptr()
    big = {t.untyped_storage().data_ptr() for t in (*tied.parameters(), *tied.buffers())
           if t.untyped_storage().nbytes() >= table}
    assert big == {arena}  # the one block of packed weights only
    assert untied.model.embed_tokens.weight.untyped_storage().nbytes() >= table  # (what the test would see)
    ids = torch.randint(0, tied.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(tied.forward_dense(ids), untied.forward_dense(ids))  # the Python embedding
        inputs = pack_rows(ids[0].tolist(), [0], [12], [[0]], 16)
        outs = []
        for m in (tied, untied):  # the native forward (specdec_cpu::decoder_forward)
            assert backend_of(m).kind == "native"
            cfg = m.config
            shape = (cfg.num_hidden_layers, 16, cfg.num_key_value_heads, cfg.head_dim)
            step = dataclasses.replace(inputs, kv_cache=KVCacheTensors(k=torch.zeros(shape), v=torch.zeros(shape)))
            step.logit_index = torch.arange(12)
            outs.append(m(step).logits)
        assert torch.equal(*outs)
    after = tied.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    with pytest.raises(RuntimeError, match="model.embed_tokens: loading weights into an embedding read from its"):
        tied.load_state_dict(before)
