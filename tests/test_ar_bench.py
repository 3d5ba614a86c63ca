"""experiments/bench/ar.py's figures on tiny checkpoints: the weight bytes behind its
weight-read bound, and transformers' peer of a GGUF target (``target=smollm2``)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdec import LLM, SamplingParams
from specdec.measure import random_checkpoint
from tests.scripts import load_script
from tests.test_real_target import _tiny_gguf

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "bench"


def _ar() -> types.ModuleType:
    return load_script(BENCH / "ar.py")


def test_weight_bytes_counts_each_packed_weight_once(tmp_path: Path) -> None:
    # Every row count a multiple of 64 (the packed panels' width: no padding) and random float32
    # values (packed as float32): the bytes a step reads are the checkpoint's, 4 per value, the
    # tied head once. The parts of the fused [q; k; v] and [gate; up] keep placeholders of their
    # shapes: counted as weights too, the figure read 1.6x this.
    path = random_checkpoint(layers=1, hidden=64, vocab=128, heads=2, kv_heads=1, out=tmp_path / "ckpt")
    values = sum(t.numel() for t in load_file(path / "model.safetensors").values())
    module = LLM(path, max_batch_size=1, max_seq_len=32).pipeline.target.module
    attn = module.model.layers[0].self_attn
    if attn.qkv is None or attn.qkv.packed is None or not attn.q_proj.dense_freed:
        pytest.skip("projections not fused and packed here (our kernels did not build)")
    assert _ar().weight_bytes(module) == 4 * values


def test_hf_peer_of_a_gguf_file_decodes_as_ours(tmp_path: Path) -> None:
    # transformers' model built from the GGUF's weights (Q / K rows unpermuted, head tied to
    # the embedding) gives our greedy tokens.
    ar = _ar()
    gguf = _tiny_gguf(tmp_path / "tiny.gguf")
    prompt = [1, 5, 9, 2, 40, 7]
    ours = LLM(gguf, max_seq_len=64, max_batch_size=1).generate(
        [prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    assert ar.hf_generate(ar.hf_peer(gguf), torch.tensor([prompt]), 12) == [ours]
