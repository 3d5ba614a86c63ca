"""The drafters shipped for SmolLM2 (``specdec/zoo/smollm2-eagle3``, ``smollm2-medusa``): their files
are the ones their manifests record, their shapes fit the target the manifest names, the loader
reads them, and ``target=smollm2`` with ``method=eagle3`` / ``method=medusa`` drafts with them by
default. Never fetches the target."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdec.conf_schema import ZOO_DIR, ConfigError, build_components, config_dir, to_run_config
from specdec.zoo_fetch import MODELS

HEAD = ZOO_DIR / "smollm2-eagle3"
MEDUSA = ZOO_DIR / "smollm2-medusa"


def _manifest(head=HEAD) -> dict:
    return json.loads((head / "manifest.json").read_text())


def _check_files(head) -> dict:
    """The manifest of ``head``, whose files are the ones it records, made for the GGUF SmolLM2 fetches."""
    m = _manifest(head)
    for name, rec in m["files"].items():
        data = (head / name).read_bytes()
        assert len(data) == rec["bytes"], name
        assert hashlib.sha256(data).hexdigest() == rec["sha256"], name
    assert m["target"]["name"] == "smollm2" and m["target"]["gguf_sha256"] == MODELS["smollm2"].sha256
    return m


def _components(overrides: list[str]):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return build_components(to_run_config(compose("run", overrides=overrides)))


def test_smollm2_head_files_match_manifest_and_fit_its_target() -> None:
    m = _check_files(HEAD)
    assert sum(rec["bytes"] for rec in m["files"].values()) <= 30 * 2**20
    t = m["target"]
    cfg = json.loads((HEAD / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["target_hidden_size"] == cfg["hidden_size"] == t["hidden"] == 576
    assert cfg["vocab_size"] == t["vocab"] == 49152
    assert cfg["num_attention_heads"] == t["heads"] and cfg["num_key_value_heads"] == t["kv_heads"]
    assert cfg["draft_vocab_size"] < t["vocab"]
    assert all(0 <= i <= t["layers"] for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])


def test_smollm2_head_loads_with_its_draft_vocabulary() -> None:
    from specdec.core.checkpoint import load_decoder
    from specdec.core.registry import Role

    cfg = json.loads((HEAD / "config.json").read_text())
    head = load_decoder(HEAD, role=Role.DRAFT_HEAD, dtype=torch.float32).module
    d2t = head.draft_to_target
    assert d2t.numel() == cfg["draft_vocab_size"]
    assert bool((d2t[1:] > d2t[:-1]).all()) and 0 <= int(d2t[0]) and int(d2t[-1]) < cfg["vocab_size"]
    assert tuple(head.lm_head.weight.shape) == (cfg["draft_vocab_size"], cfg["hidden_size"])


def test_smollm2_eagle3_takes_the_smollm2_head_by_default() -> None:
    comps = _components(["target=smollm2", "method=[eagle3,ngram]", "data=spec_bench", "logger=none"])
    assert comps.target == "smollm2"  # (not fetched: a name until the run loads it)
    assert comps.methods["eagle3"].path == str(HEAD)
    # A method with no SmolLM2 head still names the mismatch rather than loading the code target's.
    with pytest.raises(ConfigError, match="method.eagle.path"):
        _components(["target=smollm2", "method=[eagle]", "logger=none"])


def test_the_python_api_takes_the_smollm2_head_by_default_too() -> None:
    from specdec.api import method_for

    assert method_for("smollm2", "eagle3").path == str(HEAD)  # (nothing fetched: the name is not resolved here)
    with pytest.raises(ValueError, match="method.eagle3.path"):  # another target has no head by default
        method_for("specdec/zoo/code-target", "eagle3")
    mine = method_for("smollm2", {"name": "eagle3", "path": "/ckpt/my-head"})
    assert mine.path == "/ckpt/my-head"  # a path the user gave is theirs


def test_smollm2_medusa_files_match_manifest_and_load_sharing_the_targets_lm_head() -> None:
    from specdec.models.medusa import load_medusa

    m = _check_files(MEDUSA)
    assert sum(rec["bytes"] for rec in m["files"].values()) <= 8 * 2**20  # ResBlocks only: no lm head stored
    cfg = json.loads((MEDUSA / "config.json").read_text())
    assert cfg["version"] == "2" and cfg["hidden_size"] == m["target"]["hidden"] == 576
    heads = load_medusa(MEDUSA, dtype=torch.float32)
    assert heads.config.shared_lm_head and heads.config.num_heads == cfg["medusa_num_heads"] >= 3
    assert heads.config.vocab_size == m["target"]["vocab"] == 49152


def test_smollm2_medusa_takes_the_smollm2_heads_by_default() -> None:
    comps = _components(["target=smollm2", "method=[medusa,eagle3]", "data=spec_bench", "logger=none"])
    assert comps.methods["medusa"].path == str(MEDUSA)
    assert comps.methods["eagle3"].path == str(HEAD)
