"""The safetensors / config.json / tokenizer.json loader: sharding, dtypes, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specdec.core.checkpoint import (
    CheckpointError,
    load_decoder,
    load_graph_api_module,
    load_tokenizer,
    read_hf_config,
    weight_files,
)
from specdec.models.config import LlamaConfig
from specdec.models.llama import LlamaDecoder


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    return dst


def _rewrite_tensors(path: Path, edit) -> None:
    """Loads ``model.safetensors`` at ``path``, applies ``edit(dict)``, saves it back."""
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    sd = load_file(str(f))
    edit(sd)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(f), metadata={"format": "pt"})


def _config(path: Path) -> LlamaConfig:
    return LlamaConfig.from_dict(read_hf_config(path))


# -- loading ----------------------------------------------------------------------


def test_load_decoder_matches_hf_state_dict(hf_checkpoint):
    path, hf = hf_checkpoint("qwen2")
    loaded = load_decoder(path)
    assert isinstance(loaded.module, LlamaDecoder)
    assert loaded.config.architecture == "Qwen2ForCausalLM"
    assert loaded.config.attention_bias and not loaded.config.o_proj_bias
    ours = loaded.module.state_dict()
    theirs = hf.state_dict()
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v), k
    assert not any(p.is_meta for p in loaded.module.parameters())
    assert not loaded.module.training


def test_sharded_checkpoint_loads_same_logits(hf_checkpoint):
    single, _ = hf_checkpoint("llama")
    sharded, _ = hf_checkpoint("llama", max_shard_size="20KB")
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = weight_files(sharded)
    assert len(files) > 1 and len(files) == len(set(index["weight_map"].values()))
    a = load_decoder(single).module
    b = load_decoder(sharded).module
    tokens = torch.randint(0, a.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la, lb = a.forward_dense(tokens), b.forward_dense(tokens)
    assert torch.equal(la, lb)


def test_sharded_checkpoint_missing_shard_names_it(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("llama", max_shard_size="20KB")
    path = _copy_checkpoint(src, tmp_path / "ckpt")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_decoder(path)


def test_override_quantization_encoding(hf_checkpoint):
    """A bf16 checkpoint, declared fp32: cast to fp32 unless the class overrides."""

    class KeepsCheckpointDtype(LlamaDecoder):
        override_quantization_encoding = True

    path, _ = hf_checkpoint("llama", dtype=torch.bfloat16)
    config = _config(path)
    assert config.dtype == torch.bfloat16  # config.json says so
    cast = load_graph_api_module(LlamaDecoder, config, path, dtype=torch.float32)
    assert {p.dtype for p in cast.parameters()} == {torch.float32}
    kept = load_graph_api_module(KeepsCheckpointDtype, config, path, dtype=torch.float32)
    assert {p.dtype for p in kept.parameters()} == {torch.bfloat16}
    for (n, a), (_, b) in zip(cast.named_parameters(), kept.named_parameters()):
        assert torch.equal(a, b.float()), n  # bf16 -> fp32 is exact
    # No dtype given: the checkpoint's declared dtype (config.json) is used.
    assert {p.dtype for p in load_decoder(path).module.parameters()} == {torch.bfloat16}


# -- errors -----------------------------------------------------------------------


def test_missing_config_json(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("llama")
    path = _copy_checkpoint(src, tmp_path / "no-config")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError) as e:
        load_decoder(path)
    assert "config.json" in str(e.value) and str(path) in str(e.value)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does-not-exist"):
        load_decoder(tmp_path / "does-not-exist")


def test_unknown_architecture_lists_registered(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("llama")
    path = _copy_checkpoint(src, tmp_path / "unknown-arch")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FrobnicatorForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_decoder(path)
    msg = str(e.value)
    assert "FrobnicatorForCausalLM" in msg and "config.json" in msg
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert name in msg


def test_no_weights_file(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("llama")
    path = _copy_checkpoint(src, tmp_path / "no-weights")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_decoder(path)


def test_missing_and_misshaped_tensors_in_one_error(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("llama")
    path = _copy_checkpoint(src, tmp_path / "broken")

    def edit(sd):
        del sd["model.layers.0.mlp.up_proj.weight"]
        del sd["model.norm.weight"]
        sd["model.layers.1.self_attn.k_proj.weight"] = sd["model.layers.1.self_attn.k_proj.weight"][:-1]
        sd["model.extra.weight"] = torch.zeros(3)

    _rewrite_tensors(path, edit)
    with pytest.raises(CheckpointError) as e:
        load_decoder(path)
    msg = str(e.value)
    for name in (
        "model.layers.0.mlp.up_proj.weight",
        "model.norm.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.extra.weight",
        str(path),
    ):
        assert name in msg, f"{name!r} not named in: {msg}"
    assert "[15, 32]" in msg and "[16, 32]" in msg  # checkpoint vs model shape


def test_non_strict_ignores_extra_but_not_missing(hf_checkpoint, tmp_path):
    class NonStrict(LlamaDecoder):
        strict_state_dict_loading = False

    src, hf = hf_checkpoint("llama")
    extra = _copy_checkpoint(src, tmp_path / "extra")
    _rewrite_tensors(extra, lambda sd: sd.update({"medusa_head.0.weight": torch.ones(4, 4)}))
    config = _config(extra)
    module = load_graph_api_module(NonStrict, config, extra)
    assert torch.equal(module.model.norm.weight, hf.model.norm.weight)
    with pytest.raises(CheckpointError, match="medusa_head.0.weight"):
        load_graph_api_module(LlamaDecoder, config, extra)  # strict: unexpected is an error

    missing = _copy_checkpoint(src, tmp_path / "missing")
    _rewrite_tensors(missing, lambda sd: sd.pop("model.embed_tokens.weight"))
    with pytest.raises(CheckpointError, match="model.embed_tokens.weight"):
        load_graph_api_module(NonStrict, config, missing)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors_names_file(damage, hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("llama")
    path = _copy_checkpoint(src, tmp_path / damage)
    f = path / "model.safetensors"
    data = f.read_bytes()
    if damage == "truncated":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        g = torch.Generator().manual_seed(0)
        f.write_bytes(bytes(torch.randint(0, 256, (len(data),), generator=g, dtype=torch.uint8).tolist()))
    else:
        f.write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        load_decoder(path)
    assert str(f) in str(e.value)


def test_invalid_config_json(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("llama")
    path = _copy_checkpoint(src, tmp_path / "badjson")
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        load_decoder(path)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 8}))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_decoder(path)


# -- tokenizer --------------------------------------------------------------------


def _word_level_tokenizer(path: Path, words: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_tokenizer_fits_vocab(tmp_path):
    path = _word_level_tokenizer(tmp_path / "tok", ["hello", "world"])
    tok = load_tokenizer(path, vocab_size=3)
    assert tok.encode("hello world").ids == [1, 2]
    assert load_tokenizer(path).get_vocab_size() == 3


def test_tokenizer_bigger_than_model_vocab(tmp_path):
    path = _word_level_tokenizer(tmp_path / "tok", [f"w{i}" for i in range(200)])
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(path, vocab_size=128)
    msg = str(e.value)
    assert "201" in msg and "128" in msg and "tokenizer.json" in msg


def test_tokenizer_trained_bpe_bigger_than_vocab(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 4, trainer=trainer)
    (tmp_path / "bpe").mkdir()
    tok.save(str(tmp_path / "bpe" / "tokenizer.json"))
    n = tok.get_vocab_size(with_added_tokens=True)
    assert load_tokenizer(tmp_path / "bpe", vocab_size=n).get_vocab_size(with_added_tokens=True) == n
    with pytest.raises(CheckpointError, match=str(n - 1)):
        load_tokenizer(tmp_path / "bpe", vocab_size=n - 1)


def test_tokenizer_missing_or_corrupt(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{garbage")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
