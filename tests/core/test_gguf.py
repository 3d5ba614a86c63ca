"""GGUF checkpoints: tiny Llama files written here with ``gguf``'s writer (as llama.cpp's
converter writes them: Q / K rows permuted, norms in F32), loaded by specdec and by
transformers' GGUF loader, compared on logits, greedy output, tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.core.checkpoint import CheckpointError, load_decoder, load_tokenizer

gguf = pytest.importorskip("gguf")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there!",
          "speculative decoding is exact", "12345 tokens and 678 more"] * 4
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["the lazy fox", "hello, world 42!", "decoding <|im_end|> exact"]
_GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
               "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _tokenizer():
    """A byte-level BPE trained on a tiny corpus (the kind of vocabulary SmolLM / Llama 3 ship)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    tokens = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    return tokens, merges


def _gguf_name(hf: str) -> str:
    stem, _, kind = hf.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, i, rest = stem.split(".", 3)
        return f"blk.{i}.{_GGUF_NAMES[rest]}.{kind}"
    return f"{_GGUF_NAMES[stem]}.{kind}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``write(qtype, tie=False, override={})`` -> (gguf path, the fp32 HF model it was made from)."""
    from tests.conftest import _model_cls, tiny_hf_config

    tokens, merges = _tokenizer()
    made: dict = {}

    def write(qtype: str = "F32", tie: bool = False, override: dict | None = None) -> tuple[Path, object]:
        key = (qtype, tie, json.dumps(override or {}))
        if key in made:
            return made[key]
        cfg = tiny_hf_config("llama", tie=tie, vocab_size=len(tokens), rope_parameters={"rope_type": "default",
                             "rope_theta": 10000.0})
        torch.manual_seed(0)
        hf = _model_cls("llama")(cfg).eval()
        path = tmp_path_factory.mktemp("gguf") / f"tiny-{qtype}-{int(tie)}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_block_count(cfg.num_hidden_layers)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_rope_freq_base(10000.0)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_chat_template(TEMPLATE)
        for k, v in (override or {}).items():
            w.add_uint32(k, v)
        for name, t in hf.state_dict().items():
            if tie and name == "lm_head.weight":
                continue
            a = t.float().numpy()
            if name.endswith("q_proj.weight"):
                a = _permute(a, cfg.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                a = _permute(a, cfg.num_key_value_heads)
            if a.ndim == 1 or qtype == "F32":  # llama.cpp keeps norms in F32
                w.add_tensor(_gguf_name(name), a)
            elif qtype == "F16":
                w.add_tensor(_gguf_name(name), a.astype(np.float16))
            elif qtype == "I32":  # a type no loader dequantizes
                w.add_tensor(_gguf_name(name), a.astype(np.int32))
            else:
                q = getattr(gguf.GGMLQuantizationType, qtype)
                w.add_tensor(_gguf_name(name), gguf.quants.quantize(a, q), raw_dtype=q)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        made[key] = (path, hf)
        return made[key]

    return write


def _hf_from_gguf(path: Path):
    """transformers' GGUF loader on ``path``: its config parse and its tensor conversion
    (``load_gguf_checkpoint``: dequantize, undo the Q / K permutation, rename), loaded into the
    model its config builds (``from_pretrained(gguf_file=...)`` does the same, but needs accelerate)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    model.tie_weights()
    return model.eval()


def _toks(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Relative error of each dequantized weight from the fp32 one: what each type's rounding allows.
TYPES = [("F32", 0.0), ("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 1e-2), ("Q4_1", 0.15), ("Q4_0", 0.15)]


@pytest.mark.parametrize("qtype, rel_err", TYPES)
def test_logits_match_transformers_gguf_loader(tiny, hf_logits, qtype, rel_err):
    path, hf = tiny(qtype)
    ours = load_decoder(path).module
    theirs = _hf_from_gguf(path)
    toks = _toks(1, 24, hf.config.vocab_size)
    with torch.no_grad():
        got = ours.forward_dense(torch.tensor([toks]))[0]
    assert (got - hf_logits(theirs, toks)).abs().max().item() <= 1e-4  # the same dequantized weights
    if qtype == "F32":
        assert (got - hf_logits(hf, toks)).abs().max().item() <= 1e-4
    ref = hf.state_dict()
    for name, w in ours.state_dict().items():  # (Q / K rows un-permuted: else ~1.4 off)
        if name in ref:
            assert (w - ref[name]).norm() <= rel_err * ref[name].norm(), name


def test_tied_embeddings_without_output_tensor(tiny, hf_logits):
    path, hf = tiny("F32", tie=True)
    loaded = load_decoder(path)
    assert loaded.config.tie_word_embeddings
    toks = _toks(2, 16, hf.config.vocab_size)
    with torch.no_grad():
        got = loaded.module.forward_dense(torch.tensor([toks]))[0]
    assert (got - hf_logits(hf, toks)).abs().max().item() <= 1e-4


def test_llm_greedy_equals_transformers_generate(tiny, hf_greedy):
    from specdec.api import LLM
    from specdec.core.context import SamplingParams

    path, hf = tiny("F32")
    llm = LLM(path, max_seq_len=64, block_size=4, max_batch_size=4)
    theirs = _hf_from_gguf(path)
    theirs.generation_config.eos_token_id = None  # (ours ignores EOS below: compare 12 tokens each)
    prompts = [llm.encode(t) for t in TEXTS]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(theirs, p, 12)
    assert llm.eos_token_ids == (SPECIALS.index("<|im_end|>"),)


def test_tokenizer_matches_transformers_gguf_tokenizer(tiny):
    transformers = pytest.importorskip("transformers")
    path, _ = tiny("F32")
    ours = load_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert "<|im_end|>" not in ours.decode(ours.encode(TEXTS[2]).ids)  # control tokens are special


def test_chat_template_and_special_tokens_from_metadata(tiny):
    from specdec.data.chat import load_chat_template

    path, _ = tiny("F32")
    chat = load_chat_template(path)
    assert chat.source == path
    assert chat.special_tokens["eos_token"] == "<|im_end|>"
    assert chat.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unsupported_type_names_tensor_and_type(tiny):
    path, _ = tiny("I32")
    with pytest.raises(CheckpointError, match=r"tensor 'token_embd.weight' is stored as I32"):
        load_decoder(path)


def test_rope_scaling_and_missing_file_are_refused(tiny, tmp_path):
    path, _ = tiny("F32", override={"llama.attention.sliding_window": 8})
    with pytest.raises(CheckpointError, match="sliding_window"):
        load_decoder(path)
    with pytest.raises(CheckpointError, match="GGUF file .* does not exist"):
        load_decoder(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(CheckpointError, match="bad.gguf is not a readable GGUF file"):
        load_decoder(bad)


def test_experiment_accepts_gguf_target(tiny):
    """``target.path=model.gguf`` passes the up-front checkpoint check (a directory is not required)."""
    from types import SimpleNamespace

    from specdec.experiment.rundir import check_checkpoints

    path, _ = tiny("F32")
    check_checkpoints(SimpleNamespace(target=str(path), methods={}, data=SimpleNamespace(chat=True)))


def test_nothing_holds_the_file_once_loaded_and_its_tokenizer_still_works(tiny):
    """The parsed file is kept (config, weights, tokenizer and template each read it), but as
    plain values: no ``gguf`` reader (its per-string arrays: ~160 MiB for a 49k vocabulary)
    and no map of the file (its pages count as resident memory) outlive the load."""
    import gc

    from specdec.data.chat import load_chat_template

    path, _ = tiny("Q8_0")
    module = load_decoder(path).module
    tok, chat = load_tokenizer(path), load_chat_template(path)
    gc.collect()
    where = str(path.resolve())
    readers = [o for o in gc.get_objects() if type(o) is gguf.GGUFReader
               and getattr(o.data, "filename", None) == where]
    assert not readers
    maps = Path("/proc/self/maps")
    if maps.is_file():
        assert where not in maps.read_text()
    ids = tok.encode(TEXTS[1]).ids
    assert tok.decode(ids) == TEXTS[1] and module.model.embed_tokens.weight.shape[0] == tok.get_vocab_size()
    assert chat.special_tokens["eos_token"] == "<|im_end|>"


def test_a_file_cut_short_after_it_was_parsed_names_the_tensor(tiny, tmp_path):
    """A parsed file keeps where each tensor lies; one rewritten shorter since fails at the
    load of a tensor that now ends past its end, naming it (not a numpy reshape error)."""
    from types import SimpleNamespace

    from specdec.core.gguf import GGUFCheckpoint

    path, _ = tiny("F32")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes())
    ckpt = GGUFCheckpoint(cut)
    cfg = SimpleNamespace(**ckpt.hf_config())
    cut.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(CheckpointError, match=r"cut.gguf: tensor '[\w.]+' ends past the end of the file"):
        for _, _, _, load in ckpt.iter_tensors(cfg):
            load()
