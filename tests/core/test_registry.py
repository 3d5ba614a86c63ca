"""Registration by role and HF architecture name; DecoderModule's class attributes."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from specdec.core import registry
from specdec.core.registry import DecoderModule, Role, lookup, register, registered_names
from specdec.models.config import LlamaConfig
from specdec.models.llama import LlamaDecoder

BUILTIN = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@pytest.fixture
def scratch_registry(monkeypatch):
    """A private copy of the registry so test registrations do not leak."""
    registered_names()  # built-ins first, so the copy holds them
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return registry._REGISTRY


def test_builtin_architectures_registered():
    names = registered_names(Role.DECODER)
    assert names == sorted(names)
    for name in BUILTIN:
        assert name in names
        assert lookup(name) is LlamaDecoder
        assert lookup(name, Role.DECODER) is LlamaDecoder
    assert LlamaDecoder.role is Role.DECODER
    assert set(BUILTIN) <= set(LlamaDecoder.architectures)
    assert set(registered_names()) >= set(names)


def test_lookup_unknown_lists_registered():
    with pytest.raises(KeyError) as e:
        lookup("GPTFrobForCausalLM")
    msg = str(e.value)
    assert "GPTFrobForCausalLM" in msg
    for name in BUILTIN:
        assert name in msg


def test_lookup_is_by_role():
    # One HF name, two roles: a Llama decoder, and an EAGLE-1 head (its
    # published config.json says LlamaForCausalLM too); no Medusa head by that name.
    from specdec.models.eagle import Eagle1Head
    from specdec.models.llama import LlamaDecoder

    assert lookup("LlamaForCausalLM", Role.DECODER) is LlamaDecoder
    assert lookup("LlamaForCausalLM", Role.DRAFT_HEAD) is Eagle1Head
    with pytest.raises(KeyError, match="medusa_head"):
        lookup("LlamaForCausalLM", Role.MEDUSA_HEAD)


def test_register_and_lookup_new_class(scratch_registry):
    @register(Role.DRAFT_HEAD, "TinyHeadForTest", "TinyHeadForTestAlias")
    class TinyHead(DecoderModule):
        pass

    assert lookup("TinyHeadForTest", Role.DRAFT_HEAD) is TinyHead
    assert lookup("TinyHeadForTestAlias", Role.DRAFT_HEAD) is TinyHead
    assert TinyHead.role is Role.DRAFT_HEAD
    assert TinyHead.architectures == ("TinyHeadForTest", "TinyHeadForTestAlias")
    assert "TinyHeadForTest" in registered_names(Role.DRAFT_HEAD)
    assert "TinyHeadForTest" not in registered_names(Role.DECODER)
    with pytest.raises(KeyError):
        lookup("TinyHeadForTest", Role.DECODER)
    # Registering the same class again under the same name is a no-op.
    register(Role.DRAFT_HEAD, "TinyHeadForTest")(TinyHead)
    assert TinyHead.architectures == ("TinyHeadForTest", "TinyHeadForTestAlias")


def test_register_subclass_architectures_are_its_own(scratch_registry):
    """A registered subclass lists only the names it was registered under."""

    @register(Role.DECODER, "NonStrictLlamaForTest")
    class NonStrictLlama(LlamaDecoder):
        strict_state_dict_loading = False

    assert lookup("NonStrictLlamaForTest") is NonStrictLlama
    assert lookup("LlamaForCausalLM") is LlamaDecoder
    assert NonStrictLlama.architectures == ("NonStrictLlamaForTest",)


def test_duplicate_registration_to_other_class_fails(scratch_registry):
    with pytest.raises(ValueError) as e:

        @register(Role.DECODER, "LlamaForCausalLM")
        class Impostor(DecoderModule):
            pass

    assert "LlamaForCausalLM" in str(e.value) and "LlamaDecoder" in str(e.value)
    assert lookup("LlamaForCausalLM") is LlamaDecoder  # unchanged
    # The same name under another role is a different key.

    @register(Role.MEDUSA_HEAD, "LlamaForCausalLM")
    class MedusaForTest(DecoderModule):
        pass

    assert lookup("LlamaForCausalLM", Role.MEDUSA_HEAD) is MedusaForTest


def test_register_needs_a_name():
    with pytest.raises(ValueError):
        register(Role.DECODER)


def _tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=4)


def test_build_module_without_state_dict():
    cfg = _tiny_llama_config()
    m = LlamaDecoder.build_module(SimpleNamespace(config=cfg), LlamaConfig)
    assert isinstance(m, LlamaDecoder) and m.config is cfg
    # A dict config is parsed with config_cls.from_dict.
    m2 = LlamaDecoder.build_module({"config": {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 16, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4}}, LlamaConfig)
    assert isinstance(m2, LlamaDecoder) and m2.config.qk_norm


def test_build_module_shares_loaded_weights_and_runs(hf_checkpoint, hf_logits):
    """The target a speculative module builds shares the loaded weights and gives
    the same logits through the paged path (its rope tables built on demand)."""
    from specdec.core.checkpoint import load_decoder
    from specdec.core.context import SamplingParams, TextContext
    from specdec.core.kv_cache import BlockTable
    from specdec.core.pipeline_model import RuntimeConfig, registered_pipeline_model

    path, hf = hf_checkpoint("qwen3")
    loaded = load_decoder(path)
    sd = loaded.module.state_dict()
    built = LlamaDecoder.build_module(SimpleNamespace(config=loaded.config, state_dict=sd), LlamaConfig)
    assert built.model.embed_tokens.weight.data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
    pm = registered_pipeline_model(loaded, RuntimeConfig(max_batch_size=1, max_seq_len=32, block_size=4))
    # The pipeline model builds its target module once, over its own weights, and executes it from then on.
    target = pm.build_module()
    assert isinstance(target, LlamaDecoder) and pm.build_module() is target and pm.module is target
    assert target.model.embed_tokens.weight.data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
    prompt = list(range(3, 20))
    for module in (built, target):
        ctx = TextContext("a", prompt, len(prompt), SamplingParams())
        ctx.kv["target"] = BlockTable()
        batch = pm.prepare([ctx], return_n_logits=len(prompt))
        with torch.no_grad():
            out = module(batch.inputs)
        assert (out.logits - hf_logits(hf, prompt)).abs().max().item() <= 1e-4
        pm.free(ctx)


def test_import_specdec_does_not_import_transformers():
    code = (
        "import sys\n"
        "import specdec, specdec.engine, specdec.core.pipeline_model, specdec.core.checkpoint\n"
        "import specdec.models\n"
        "specdec.lookup('LlamaForCausalLM')\n"
        "bad = sorted(m for m in sys.modules if m == 'transformers' or m.startswith('transformers.'))\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
