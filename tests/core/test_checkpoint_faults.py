"""Bad checkpoints and run settings fail at build, naming the culprit, before
any weight is read where that is possible; none loads silently wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from specdec.api import LLM
from specdec.core.checkpoint import CheckpointError, load_decoder
from specdec.core.pipeline_model import RuntimeConfig, registered_pipeline_model
from specdec.spec.proposers.draft_model import DraftModelConfig


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, cfg: Any) -> None:
    (path / "config.json").write_text(json.dumps(cfg))


# -- a tensor in two shards -------------------------------------------------------


def _shards(path: Path) -> tuple[dict[str, str], list[Path]]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    return index, sorted(path.glob("model-*.safetensors"))


def _rewrite(f: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(f))
    edit(sd)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(f), metadata={"format": "pt"})


def test_tensor_in_two_shards_is_an_error_naming_both(hf_checkpoint, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = _copy(hf_checkpoint("llama", max_shard_size="20KB")[0], tmp_path / "ckpt")
    index, files = _shards(path)
    name = next(n for n, f in index.items() if f == files[0].name)
    stale = torch.zeros_like(load_file(str(files[0]))[name])  # a second, different copy in the last shard
    _rewrite(files[-1], lambda sd: sd.update({name: stale}))
    with pytest.raises(CheckpointError) as e:
        load_decoder(path)
    msg = str(e.value)
    assert name in msg and "twice" in msg and str(files[0]) in msg and str(files[-1]) in msg


def test_tensor_in_another_shard_than_the_index_says_is_an_error(hf_checkpoint, tmp_path: Path) -> None:
    path = _copy(hf_checkpoint("llama", max_shard_size="20KB")[0], tmp_path / "ckpt")
    index, files = _shards(path)
    name = next(n for n, f in index.items() if f == files[0].name)
    moved: dict[str, torch.Tensor] = {}
    _rewrite(files[0], lambda sd: moved.update({name: sd.pop(name)}))
    _rewrite(files[-1], lambda sd: sd.update(moved))
    with pytest.raises(CheckpointError) as e:
        load_decoder(path)
    msg = str(e.value)
    assert name in msg and str(files[-1]) in msg and "index" in msg and files[0].name in msg


# -- config.json of the wrong shape -----------------------------------------------


def _good_config(hf_checkpoint) -> tuple[Path, dict[str, Any]]:
    src = hf_checkpoint("llama")[0]
    return src, json.loads((src / "config.json").read_text())


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda c: [], "must hold a JSON object"),
        (lambda c: None, "must hold a JSON object"),
        (lambda c: "LlamaForCausalLM", "must hold a JSON object"),
        (lambda c: {**c, "architectures": "LlamaForCausalLM"}, "'architectures' must be a list"),
        (lambda c: {**c, "architectures": [7]}, "'architectures' must be a list"),
        (lambda c: {**c, "num_hidden_layers": "2"}, "config.num_hidden_layers must be an integer"),
        (lambda c: {**c, "hidden_size": 32.0}, "config.hidden_size must be an integer"),
        (lambda c: {**c, "rope_parameters": [10000.0]}, "config.rope_parameters must be an object"),
        (lambda c: {**c, "eos_token_id": "2"}, "config.eos_token_id"),
    ],
    ids=["list", "null", "string", "architectures-string", "architectures-ints", "layers-string",
         "hidden-float", "rope-list", "eos-string"],
)
def test_config_of_the_wrong_shape_names_file_and_key(hf_checkpoint, tmp_path: Path, change, named: str) -> None:
    src, cfg = _good_config(hf_checkpoint)
    path = _copy(src, tmp_path / "ckpt")
    _edit_config(path, change(cfg))
    with pytest.raises(CheckpointError) as e:
        load_decoder(path)
    assert named in str(e.value) and str(path / "config.json") in str(e.value)


# -- run settings the machine or the model cannot serve ---------------------------


def test_max_seq_len_past_the_model_positions_fails_before_loading(hf_checkpoint, tmp_path: Path) -> None:
    src = hf_checkpoint("llama")[0]  # max_position_embeddings 512
    path = _copy(src, tmp_path / "ckpt")
    (path / "model.safetensors").unlink()  # an error about the weights would mean they were read first
    with pytest.raises(ValueError) as e:
        registered_pipeline_model(path, RuntimeConfig(max_batch_size=1, max_seq_len=513))
    msg = str(e.value)
    assert "runtime.max_seq_len=513" in msg and "max_position_embeddings=512" in msg and str(path) in msg
    # At the limit it builds, speculative lookahead slack past it included.
    method = DraftModelConfig(path=str(src), num_speculative_tokens=4)
    LLM(src, method=method, runtime=RuntimeConfig(max_batch_size=1, max_seq_len=512, num_blocks=64))


@pytest.mark.parametrize("device", ["cuda:99", "gpu"])
def test_unusable_device_fails_before_loading(tmp_path: Path, device: str) -> None:
    with pytest.raises(ValueError, match=f"runtime.device='{device}'"):
        LLM(tmp_path / "no-such-checkpoint", runtime=RuntimeConfig(device=device))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"runtime.device='cuda'.*no CUDA device"):
        LLM(tmp_path / "no-such-checkpoint", runtime=RuntimeConfig(device="cuda"))


# -- config.json facts past sane bounds, or that the files cannot back -----------------


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda c: {**c, "num_hidden_layers": 1_000_000}, "config.num_hidden_layers=1000000"),
        (lambda c: {**c, "vocab_size": 10**9}, "config.vocab_size=1000000000"),
        (lambda c: {**c, "hidden_size": 1 << 20}, "config.hidden_size=1048576"),
        (lambda c: {**c, "num_hidden_layers": 200}, "need at least"),  # in bounds, but 2 layers are stored
        (lambda c: {**c, "intermediate_size": 1 << 18}, "need at least"),
        (lambda c: {**c, "head_dim": None, "hidden_size": 66}, "must be a multiple of config.num_attention_heads"),
        (lambda c: {**c, "eos_token_id": c["vocab_size"]}, "config.eos_token_id"),
        (lambda c: {**c, "eos_token_id": [0, -1]}, "config.eos_token_id"),
        (lambda c: {**c, "num_hidden_layers": list(range(100_000))}, "config.num_hidden_layers must be an integer"),
    ],
    ids=["layers-1e6", "vocab-1e9", "hidden-1M", "layers-unbacked", "mlp-unbacked", "hidden-not-heads",
         "eos-past-vocab", "eos-negative", "layers-huge-list"],
)
def test_config_facts_are_bounded_before_any_module_is_built(hf_checkpoint, tmp_path: Path, change,
                                                             named: str) -> None:
    src, cfg = _good_config(hf_checkpoint)
    path = _copy(src, tmp_path / "ckpt")
    _edit_config(path, change(cfg))
    with pytest.raises(CheckpointError) as e:  # (a module of a million layers would build for hours)
        load_decoder(path)
    msg = str(e.value)
    assert named in msg and str(path / "config.json") in msg
    assert len(msg) < 1000  # bounded, whatever the value


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.int64])
def test_a_weight_stored_as_integers_names_the_file_and_tensor(hf_checkpoint, tmp_path: Path, dtype) -> None:
    path = _copy(hf_checkpoint("llama")[0], tmp_path / "ckpt")
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(path / "model.safetensors", lambda sd: sd.update({name: sd[name].to(dtype)}))
    with pytest.raises(CheckpointError) as e:
        load_decoder(path)
    msg = str(e.value)
    assert str(path / "model.safetensors") in msg and repr(name) in msg and "floating-point" in msg


@pytest.mark.parametrize(
    ("setting", "value"),
    [("num_blocks", 1e6), ("num_blocks", "8"), ("num_blocks", True), ("max_batch_size", 1e5),
     ("max_seq_len", "1024"), ("block_size", 16.0), ("threads", 2.5)],
)
def test_runtime_sizes_must_be_integers_naming_the_setting(tmp_path: Path, setting: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"runtime\.{setting} must be an integer, got {value!r}"):
        RuntimeConfig(**{setting: value})
    with pytest.raises(ValueError, match=rf"runtime\.{setting} must be an integer"):  # LLM(...) keywords too
        LLM(tmp_path / "no-such-checkpoint", **{setting: value})


@pytest.mark.parametrize(
    ("runtime", "named"),
    [(dict(num_blocks=10**9, max_seq_len=512), "runtime.num_blocks=1000000000"),
     (dict(max_batch_size=10**7, max_seq_len=512), "runtime.max_batch_size=10000000 with runtime.max_seq_len=512")],
    ids=["num_blocks", "max_batch_size"],
)
def test_a_kv_cache_past_the_machines_memory_fails_before_loading(hf_checkpoint, tmp_path: Path, runtime,
                                                                    named: str) -> None:
    path = _copy(hf_checkpoint("llama")[0], tmp_path / "ckpt")
    (path / "model.safetensors").write_bytes(b"\0" * 64)  # an error about the weights would mean they were read first
    with pytest.raises(ValueError) as e:
        registered_pipeline_model(path, RuntimeConfig(**runtime))
    msg = str(e.value)
    assert named in msg and "available" in msg and "KV cache" in msg and str(path) in msg
