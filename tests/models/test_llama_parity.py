"""Logit and greedy-output parity of the Llama family with transformers (fp32).

Each case is a tiny random HF model saved with ``save_pretrained`` and loaded
through our registry + safetensors loader:

- llama: Llama 3.1 rope scaling (``rope_parameters.rope_type == "llama3"``);
- qwen2: q/k/v bias (no o_proj bias);
- qwen3: q/k RMSNorm and an explicit head_dim (16 != 32 / 4);
- mistral: sliding window (8) smaller than every sequence here;
- llama-tied: tied input/output embeddings (no lm_head.weight in the file).
"""

from __future__ import annotations

import pytest
import torch

from specdec.core.context import SamplingParams, TextContext
from specdec.core.kv_cache import BlockTable

TOL = 1e-4
CASES = [
    pytest.param("llama", False, id="llama-llama3rope"),
    pytest.param("qwen2", False, id="qwen2-qkvbias"),
    pytest.param("qwen3", False, id="qwen3-qknorm-headdim"),
    pytest.param("mistral", False, id="mistral-slidingwindow"),
    pytest.param("llama", True, id="llama-tied"),
]
RUNTIME = dict(max_batch_size=4, max_seq_len=64, block_size=4)


def _ctx(rid: str, tokens: list[int], cache: str = "target") -> TextContext:
    c = TextContext(rid, list(tokens), len(tokens), SamplingParams(ignore_eos=True))
    c.kv[cache] = BlockTable()
    return c


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture
def pipeline(pipeline_factory):
    """A fresh-state pipeline per test: frees every table the test registered."""
    made: list = []

    def make(path):
        pm = pipeline_factory(path, **RUNTIME)
        made.append(pm)
        return pm

    yield make
    for pm in made:
        for cache in pm.caches:
            assert cache.allocator.num_free == cache.params.num_blocks, "test leaked KV blocks"


def _free(pm, ctxs):
    for c in ctxs:
        pm.free(c)


@pytest.mark.parametrize("kind, tie", CASES)
def test_prefill_logits_parity(kind, tie, hf_checkpoint, hf_logits, pipeline):
    path, hf = hf_checkpoint(kind, tie=tie)
    pm = pipeline(path)
    prompt = _tokens(1, 23, hf.config.vocab_size)  # 6 blocks of 4, > sliding window
    ctx = _ctx("a", prompt)
    try:
        batch = pm.processor.prepare_initial_token_inputs([[ctx]], return_n_logits=len(prompt))
        out = pm.execute(batch)
    finally:
        _free(pm, [ctx])
    ref = hf_logits(hf, prompt)
    assert out.logits.shape == ref.shape
    assert out.logits.dtype == torch.float32
    diff = (out.logits - ref).abs().max().item()
    assert diff <= TOL, f"{kind}: prefill max |logit diff| {diff:.3g} > {TOL}"
    assert ref.abs().max() > 1.0  # the logits are not degenerate


@pytest.mark.parametrize("kind, tie", CASES)
def test_ragged_prefill_logits_parity(kind, tie, hf_checkpoint, hf_logits, pipeline):
    """Two prompts of different lengths packed in one batch (the padded-query path)."""
    path, hf = hf_checkpoint(kind, tie=tie)
    pm = pipeline(path)
    v = hf.config.vocab_size
    prompts = [_tokens(2, 19, v), _tokens(3, 11, v), _tokens(4, 1, v)]
    ctxs = [_ctx(f"r{i}", p) for i, p in enumerate(prompts)]
    n = 5
    try:
        batch = pm.processor.prepare_initial_token_inputs([ctxs], return_n_logits=n)
        out = pm.execute(batch)
    finally:
        _free(pm, ctxs)
    assert out.logits.shape == (n * len(prompts), v)
    for i, p in enumerate(prompts):
        ref = hf_logits(hf, p)
        # Rows of request i: its last n rows (a request with fewer repeats its first row).
        want = ref[[max(len(p) - n + k, 0) for k in range(n)]]
        got = out.logits[out.logit_offsets[i] : out.logit_offsets[i + 1]]
        diff = (got - want).abs().max().item()
        assert diff <= TOL, f"{kind}: request {i} max |logit diff| {diff:.3g}"


@pytest.mark.parametrize("kind, tie", CASES)
def test_cached_decode_logits_parity(kind, tie, hf_checkpoint, hf_logits, pipeline):
    """Prefill, then 8 decode steps one token at a time through the paged cache."""
    path, hf = hf_checkpoint(kind, tie=tie)
    pm = pipeline(path)
    v = hf.config.vocab_size
    steps = 8
    prompts = [_tokens(5, 13, v), _tokens(6, 6, v)]
    conts = [_tokens(7, steps, v), _tokens(8, steps, v)]
    ctxs = [_ctx(f"r{i}", p) for i, p in enumerate(prompts)]
    got: list[list[torch.Tensor]] = [[], []]
    try:
        pm.execute(pm.processor.prepare_initial_token_inputs([ctxs]))
        for s in range(steps):
            for c, cont in zip(ctxs, conts):
                c.tokens.append(cont[s])
            out = pm.execute(pm.processor.prepare_initial_token_inputs([ctxs], num_tokens=[1] * len(ctxs)))
            assert out.logits.shape == (2, v)
            for i in range(2):
                got[i].append(out.logits[i])
            for c in ctxs:
                assert c.processed() == len(c.tokens)
    finally:
        _free(pm, ctxs)
    for i in range(2):
        full = prompts[i] + conts[i]
        ref = hf_logits(hf, full)[len(prompts[i]) :]  # [steps, V]
        diff = (torch.stack(got[i]) - ref).abs().max().item()
        assert diff <= TOL, f"{kind}: request {i} decode max |logit diff| {diff:.3g}"


@pytest.mark.parametrize("kind, tie", CASES)
@pytest.mark.parametrize("decoding, groups", [(3, [3, 1]), (1, [2, 2])], ids=["lone-prompt", "lone-decoding"])
def test_decoding_requests_beside_prompts_in_attention_groups(kind, tie, decoding, groups, hf_checkpoint, hf_logits,
                                                              pipeline, monkeypatch):
    """A step where some requests decode and others feed their prompts attends in two groups
    (``DecoderInputs.attention_groups``; forced here, the sizes are small): every row's logits
    are transformers' own. Three decoding beside one prompt: the prompt alone takes the causal
    fast path. One decoding beside two prompts: it attends with a copy of itself, the prompts
    causal without a mask."""
    from functools import partial

    from specdec.core import batch_processor

    monkeypatch.setattr(batch_processor, "attention_split", partial(batch_processor.attention_split, min_saving=0))
    path, hf = hf_checkpoint(kind, tie=tie)
    pm = pipeline(path)
    v = hf.config.vocab_size
    prompts = [_tokens(11, 13, v), _tokens(12, 6, v), _tokens(13, 9, v), _tokens(14, 30, v)][: decoding] + [
        _tokens(16, 30, v), _tokens(17, 21, v)][: 4 - decoding - (decoding == 1)]
    ctxs = [_ctx(f"r{i}", p) for i, p in enumerate(prompts)]
    try:
        pm.execute(pm.processor.prepare_initial_token_inputs([ctxs[:decoding]]))
        for c, t in zip(ctxs[:decoding], _tokens(15, 3, v)):
            c.tokens.append(t)
        batch = pm.processor.prepare_initial_token_inputs([ctxs], return_n_logits=2)
        assert batch.inputs.attention_groups is not None
        assert [g.q_index.shape[0] for g in batch.inputs.attention_groups] == groups  # (copies included)
        out = pm.execute(batch)
    finally:
        _free(pm, ctxs)
    for i, c in enumerate(ctxs):
        want = hf_logits(hf, c.tokens)[[max(len(c.tokens) - 2 + k, len(c.tokens) - 1 if i < decoding else 0)
                                         for k in range(2)]]
        got = out.logits[out.logit_offsets[i] : out.logit_offsets[i + 1]]
        diff = (got - want).abs().max().item()
        assert diff <= TOL, f"{kind}: request {i} max |logit diff| {diff:.3g}"


@pytest.mark.parametrize("kind, tie", CASES)
def test_greedy_generate_parity(kind, tie, hf_checkpoint, hf_greedy, pipeline):
    """32 greedy tokens via Engine/PlainGeneration == HF generate(do_sample=False)."""
    from specdec.core.pipeline_model import PlainGeneration
    from engine_helpers import generate_ids  # tests/engine_helpers.py
    from specdec.engine import Engine, EngineConfig

    path, hf = hf_checkpoint(kind, tie=tie)
    pm = pipeline(path)
    n = 32
    prompts = [_tokens(9, 10, hf.config.vocab_size), _tokens(10, 3, hf.config.vocab_size)]
    engine = Engine(PlainGeneration(pm, RUNTIME["max_seq_len"]), EngineConfig(max_batch_size=4))
    ctxs = generate_ids(engine, prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    for p, c in zip(prompts, ctxs):
        assert c.error is None
        assert c.finish_reason == "length"
        assert c.generated == hf_greedy(hf, p, n), f"{kind}: greedy output differs from HF"


def test_tied_embeddings_share_storage(hf_checkpoint):
    """A tied checkpoint has no lm_head.weight; the loaded head is the embedding."""
    from safetensors import safe_open

    from specdec.core.checkpoint import load_decoder

    path, hf = hf_checkpoint("llama", tie=True)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    module = load_decoder(path).module
    assert module.lm_head.weight is module.model.embed_tokens.weight
    torch.testing.assert_close(module.lm_head.weight, hf.lm_head.weight, rtol=0, atol=0)


def test_llama3_rope_frequencies_parity(hf_checkpoint):
    """Our Llama 3.1 inverse frequencies equal transformers' (all three bands occur)."""
    from specdec.core.checkpoint import load_decoder

    path, hf = hf_checkpoint("llama")
    cfg = load_decoder(path).config
    assert cfg.rope.rope_type == "llama3"
    ours = cfg.rope.inv_freq(cfg.head_dim).float()
    theirs = hf.model.rotary_emb.inv_freq.float()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    default = 1.0 / (cfg.rope.theta ** (torch.arange(0, cfg.head_dim, 2).double() / cfg.head_dim))
    ratio = (default / ours.double()).tolist()
    assert ratio[0] == pytest.approx(1.0)  # high frequency kept
    assert ratio[-1] == pytest.approx(cfg.rope.factor)  # low frequency divided by factor
    assert any(1.0 + 1e-6 < r < cfg.rope.factor - 1e-6 for r in ratio)  # blended band


def test_dense_forward_parity(hf_checkpoint, hf_logits):
    """``forward_dense`` (training path, with the sliding window mask) matches HF."""
    from specdec.core.checkpoint import load_decoder

    path, hf = hf_checkpoint("mistral")
    module = load_decoder(path).module
    toks = [_tokens(11, 20, hf.config.vocab_size), _tokens(12, 20, hf.config.vocab_size)]
    with torch.no_grad():
        out = module.forward_dense(torch.tensor(toks))
    for i in range(2):
        assert (out[i] - hf_logits(hf, toks[i])).abs().max().item() <= TOL


# -- config.json layouts ------------------------------------------------------------


def test_config_transformers4_layout_matches_transformers5(hf_checkpoint):
    """transformers 4.x writes rope_theta + rope_scaling; 5.x folds them into rope_parameters."""
    from specdec.core.checkpoint import read_hf_config
    from specdec.models.config import LlamaConfig

    path, _ = hf_checkpoint("llama")
    v5 = read_hf_config(path)
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    rp = dict(v5["rope_parameters"])
    v4["rope_theta"] = rp.pop("rope_theta")
    v4["rope_scaling"] = rp
    v4["torch_dtype"] = v4.pop("dtype", "float32")
    a, b = LlamaConfig.from_dict(v5), LlamaConfig.from_dict(v4)
    assert a == b
    assert a.rope.rope_type == "llama3" and a.rope.factor == 8.0
    assert a.rope.original_max_position_embeddings == 64
    # Old-style "type" key and a null rope_scaling.
    assert LlamaConfig.from_dict({**v4, "rope_scaling": {**rp, "type": rp["rope_type"]}}).rope == a.rope
    assert LlamaConfig.from_dict({**v4, "rope_scaling": None}).rope.rope_type == "default"


def test_unsupported_rope_type_is_a_clear_load_error(hf_checkpoint, tmp_path):
    import json
    import shutil

    from specdec.core.checkpoint import CheckpointError, load_decoder

    src, _ = hf_checkpoint("llama")
    shutil.copytree(src, tmp_path / "yarn")
    cfg = json.loads((tmp_path / "yarn" / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (tmp_path / "yarn" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="yarn"):
        load_decoder(tmp_path / "yarn")


def test_qwen2_sliding_window_only_on_some_layers(hf_checkpoint, hf_logits):
    """Qwen2 with use_sliding_window: HF windows only the layers >= max_window_layers.

    Loading must either match HF or refuse with a clear error, never be silently wrong.
    """
    from specdec.core.checkpoint import CheckpointError, load_decoder

    path, hf = hf_checkpoint("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    try:
        module = load_decoder(path).module
    except CheckpointError as e:
        assert "sliding" in str(e)
        return
    toks = _tokens(13, 20, hf.config.vocab_size)
    with torch.no_grad():
        ours = module.forward_dense(torch.tensor([toks]))[0]
    assert (ours - hf_logits(hf, toks)).abs().max().item() <= TOL


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("llama", {"attention_bias": True, "mlp_bias": True}),  # bias on q/k/v/o and the MLP
        ("qwen3", {"attention_bias": True}),  # Qwen3's attention_bias covers o_proj too
        ("mistral", {"num_key_value_heads": 4}),  # no GQA
        ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),  # MQA, tied
    ],
    ids=["llama-bias", "qwen3-bias", "mistral-mha", "qwen2-mqa-tied"],
)
def test_config_variants_logits_parity(kind, overrides, hf_checkpoint, hf_logits, pipeline):
    path, hf = hf_checkpoint(kind, **overrides)
    pm = pipeline(path)
    prompt = _tokens(14, 21, hf.config.vocab_size)
    ctx = _ctx("a", prompt)
    try:
        out = pm.execute(pm.processor.prepare_initial_token_inputs([[ctx]], return_n_logits=len(prompt)))
    finally:
        _free(pm, [ctx])
    assert (out.logits - hf_logits(hf, prompt)).abs().max().item() <= TOL
