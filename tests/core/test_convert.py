"""``python -m specdec.convert``: pickled checkpoints (``pytorch_model.bin``, its shards,
Medusa's ``medusa_lm_head.pt``) become safetensors directories, read with
``torch.load(weights_only=True)`` only; the converted heads and targets load bit for bit and
draft as the originals; a pickle that would run code is refused without running it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from specdec.api import LLM
from specdec.convert import ConvertError, convert_checkpoint, main
from specdec.core.checkpoint import CheckpointError, load_decoder
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.core.registry import Role
from specdec.models.config import LlamaConfig
from specdec.models.eagle import EagleHeadConfig, new_head, save_head
from specdec.models.medusa import MedusaHeadConfig, load_medusa, new_medusa, save_medusa
from specdec.spec.proposers.eagle import Eagle3Config, EagleConfig
from specdec.spec.proposers.medusa import MedusaConfig

PROMPTS = [[3, 17, 99, 5], [64, 2], [7, 7, 7, 7, 1, 120]]


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _pickled(state: dict[str, torch.Tensor], d: Path, name: str = "pytorch_model.bin",
             config: dict[str, Any] | Path | None = None) -> Path:
    """A directory holding ``state`` pickled by ``torch.save`` as ``name``, and a config.json."""
    d.mkdir(parents=True, exist_ok=True)
    torch.save(state, d / name)
    if isinstance(config, Path):
        shutil.copy(config, d / "config.json")
    elif config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


def _run(target: Path, method: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy tokens per prompt and, per request, the acceptance counts (which depend on the head)."""
    llm = LLM(str(target), method, runtime=RuntimeConfig(max_batch_size=4, max_seq_len=64, block_size=8))
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    assert all(o.error is None for o in outs)
    stats = {} if method is None else {k: (r.accepted_hist, r.reached)
                                       for k, r in llm.pipeline.stats().per_request.items()}
    return [o.token_ids for o in outs], stats


# -- published heads ------------------------------------------------------------------------------
def _eagle_head(target: Path, out: Path, kind: str) -> Path:
    """A random head for ``target`` in the published layout (an EAGLE-3 one over a draft
    vocabulary of 3/4 of the target's: d2t int64, t2d bool)."""
    tcfg = LlamaConfig.from_dict(json.loads((target / "config.json").read_text()))
    vocab = tcfg.vocab_size * 3 // 4 if kind == "eagle3" else None
    head = new_head(EagleHeadConfig.from_target(kind, tcfg, draft_vocab_size=vocab), seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3, generator=g)
        if kind == "eagle3":
            head.set_draft_vocab(torch.randperm(tcfg.vocab_size, generator=g)[:vocab])
    save_head(head, out, num_target_layers=tcfg.num_hidden_layers)
    return out


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_published_eagle_head_bin_converts_bit_for_bit_and_drafts_the_same(hf_checkpoint, tmp_path, kind):
    target, _ = hf_checkpoint("llama")
    orig = _eagle_head(target, tmp_path / "orig", kind)
    state = load_file(str(orig / "model.safetensors"))  # fc.weight, layers.0.* / midlayer.*, norm, lm_head, d2t, t2d
    src = _pickled(state, tmp_path / "bin", config=orig / "config.json")
    convert_checkpoint(src, tmp_path / "conv")
    conv = load_file(str(tmp_path / "conv" / "model.safetensors"))
    _assert_same_tensors(conv, state)
    if kind == "eagle3":
        assert conv["t2d"].dtype == torch.bool and conv["d2t"].dtype == torch.int64
    a = load_decoder(orig, role=Role.DRAFT_HEAD).module
    b = load_decoder(tmp_path / "conv", role=Role.DRAFT_HEAD).module
    _assert_same_tensors(a.state_dict(), b.state_dict())
    cfg = EagleConfig if kind == "eagle" else Eagle3Config
    plain, _ = _run(target, None)
    with_orig = _run(target, cfg(path=str(orig), num_speculative_tokens=3))
    with_conv = _run(target, cfg(path=str(tmp_path / "conv"), num_speculative_tokens=3))
    assert with_conv == with_orig and with_conv[0] == plain


def test_published_medusa_lm_head_pt_converts_and_drafts_the_same(hf_checkpoint, tmp_path):
    # Published Medusa: config.json with medusa_num_heads / _layers only, and medusa_lm_head.pt,
    # the torch state dict of model.medusa_head (keys without the prefix; the L_m = 2
    # applications of each head's one block share storage).
    target, hf = hf_checkpoint("llama")
    h, v = hf.config.hidden_size, hf.config.vocab_size
    heads = new_medusa(MedusaHeadConfig(num_heads=3, num_layers=2, hidden_size=h, vocab_size=v), seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0.0, 0.2, generator=g)
    heads = heads.to(torch.bfloat16)
    save_medusa(heads, tmp_path / "orig")
    state = {k.removeprefix("medusa_head."): t for k, t in heads.state_dict().items()}
    assert state["0.0.linear.weight"].data_ptr() == state["0.1.linear.weight"].data_ptr()
    published = {"medusa_num_heads": 3, "medusa_num_layers": 2, "base_model_name_or_path": "tiny"}
    src = _pickled(state, tmp_path / "bin", name="medusa_lm_head.pt", config=published)
    convert_checkpoint(src, tmp_path / "conv")
    conv = load_file(str(tmp_path / "conv" / "model.safetensors"))  # every key, shared blocks copied
    _assert_same_tensors(conv, {f"medusa_head.{k}": t for k, t in state.items()})
    tcfg = load_decoder(target).config
    a = load_medusa(tmp_path / "orig", target=tcfg, dtype=torch.float32)
    b = load_medusa(tmp_path / "conv", target=tcfg, dtype=torch.float32)
    _assert_same_tensors(a.state_dict(), b.state_dict())
    with_orig = _run(target, MedusaConfig(path=str(tmp_path / "orig"), num_speculative_tokens=3))
    with_conv = _run(target, MedusaConfig(path=str(tmp_path / "conv"), num_speculative_tokens=3))
    assert with_conv == with_orig


# -- targets --------------------------------------------------------------------------------------
def test_sharded_tied_target_bin_converts_via_the_cli_and_gives_the_same_logits(hf_checkpoint, tmp_path, capsys):
    # pytorch_model-0000x-of-00002.bin + index, with lm_head.weight sharing the embedding's storage
    # (tie_word_embeddings): the output is sharded safetensors without the tied alias.
    path, hf = hf_checkpoint("llama", tie=True)
    sd = hf.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
    names = list(sd)
    first = {"model.embed_tokens.weight", "lm_head.weight", *names[: len(names) // 2]}
    src = tmp_path / "bin"
    wm = {}
    for i, part in enumerate(([k for k in names if k in first], [k for k in names if k not in first])):
        f = f"pytorch_model-0000{i + 1}-of-00002.bin"
        _pickled({k: sd[k] for k in part}, src, name=f)
        wm.update(dict.fromkeys(part, f))
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": wm}))
    for n in ("config.json", "generation_config.json"):
        if (path / n).is_file():
            shutil.copy(path / n, src / n)
    assert main([str(src), str(tmp_path / "conv"), "--max-shard-size", "20KB"]) == 0
    assert "lm_head.weight tied" in capsys.readouterr().out
    index = json.loads((tmp_path / "conv" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and "lm_head.weight" not in index
    assert (tmp_path / "conv" / "config.json").read_bytes() == (path / "config.json").read_bytes()
    a, b = load_decoder(path).module, load_decoder(tmp_path / "conv").module
    _assert_same_tensors(a.state_dict(), b.state_dict())
    tokens = torch.randint(0, a.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(a.forward_dense(tokens), b.forward_dense(tokens))


def test_loading_a_bin_directory_says_how_to_convert_it(hf_checkpoint, tmp_path):
    path, hf = hf_checkpoint("llama")
    src = _pickled(hf.state_dict(), tmp_path / "bin", config=path / "config.json")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin.*python -m specdec.convert"):
        LLM(str(src), runtime=RuntimeConfig(max_batch_size=2, max_seq_len=32))


# -- refused input --------------------------------------------------------------------------------
class _Planted:
    """Unpickling this runs ``os.system(command)`` (what an unrestricted ``torch.load`` would do)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (self.command,)


def test_a_pickle_that_would_run_code_is_refused_and_not_run(tmp_path, capsys):
    marker = tmp_path / "ran"
    src = _pickled({"fc.weight": torch.ones(2, 2), "x": _Planted(f"touch {marker}")}, tmp_path / "evil")
    with pytest.raises(ConvertError) as e:
        convert_checkpoint(src, tmp_path / "out")
    msg = str(e.value)
    assert str(src / "pytorch_model.bin") in msg and "not loaded" in msg and "GLOBAL" in msg and "system" in msg
    assert "weights_only=False" not in msg  # never the advice torch's own message gives
    assert main([str(src), str(tmp_path / "out")]) == 2
    assert "not loaded" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))  # no staged directory left behind


def test_the_specdec_command_converts_with_its_convert_subcommand(tmp_path, monkeypatch):
    from specdec.run import main as specdec

    src = _pickled({"w": torch.arange(6.0).view(2, 3)}, tmp_path / "bin", config={"a": 1})
    monkeypatch.setattr("sys.argv", ["specdec", "convert", str(src), str(tmp_path / "out")])
    with pytest.raises(SystemExit) as e:
        specdec()
    assert e.value.code == 0
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["w"], torch.arange(6.0).view(2, 3))


def test_a_value_that_is_not_a_tensor_is_named(tmp_path):
    src = _pickled({"fc.weight": torch.ones(2, 2), "step": 1200}, tmp_path / "bin")
    with pytest.raises(ConvertError, match=r"pytorch_model.bin: 'step' holds int 1200, not a tensor"):
        convert_checkpoint(src, tmp_path / "out")


def test_a_non_empty_destination_is_replaced_only_with_overwrite(tmp_path):
    src = _pickled({"w": torch.arange(6.0).view(2, 3)}, tmp_path / "bin", config={"a": 1})
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ConvertError, match=r"out is not empty \(keep.txt\); pass --overwrite"):
        convert_checkpoint(src, dst)
    assert [p.name for p in dst.iterdir()] == ["keep.txt"] and (dst / "keep.txt").read_text() == "mine"
    convert_checkpoint(src, dst, overwrite=True)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_file(str(dst / "model.safetensors"))["w"], torch.arange(6.0).view(2, 3))
    with pytest.raises(ConvertError, match="holds the source"):
        convert_checkpoint(src / "pytorch_model.bin", src, overwrite=True)
    assert (src / "pytorch_model.bin").is_file()


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda wm: wm.update(b="pytorch_model-00001-of-00002.bin"),
     "tensor 'b' is in .*00002-of-00002.bin, but .*pytorch_model.bin.index.json maps it to .*00001-of-00002.bin"),
    (lambda wm: wm.update(d="pytorch_model-00002-of-00002.bin"), "names tensors none of its shards holds: d"),
    (lambda wm: wm.update(d="pytorch_model-00003-of-00003.bin"), "shard pytorch_model-00003-of-00003.bin named in"),
], ids=["wrong-shard", "unstored", "missing-shard"])
def test_a_shard_index_that_disagrees_with_the_shards_is_named(tmp_path, edit, needle):
    src = tmp_path / "bin"
    wm = {}
    for i, names in enumerate(("a", "bc")):
        f = f"pytorch_model-0000{i + 1}-of-00002.bin"
        _pickled({k: torch.ones(i + 1) for k in names}, src, name=f)
        wm.update(dict.fromkeys(names, f))
    edit(wm)
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(ConvertError, match=needle):
        convert_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
