"""GGUF files (llama.cpp's single-file format) as checkpoints, read with the ``gguf`` package.

A ``.gguf`` file holds what a Hugging Face directory spreads over several files:
the model settings (``llama.block_count`` …, mapped here to the ``config.json``
keys :class:`~specdec.models.config.LlamaConfig` reads), the weights under
llama.cpp's names (``blk.N.attn_q.weight`` …, mapped to the HF names the
decoder uses), possibly quantized (dequantized here to the runtime dtype), and
the tokenizer and chat template as metadata (``tokenizer.ggml.*``,
``tokenizer.chat_template``).

llama.cpp's converter permutes the rows of Llama's Q and K projections for its
rope kernel (``convert_hf_to_gguf.py``, ``LlamaModel.permute``); :func:`unpermute`
undoes it, as transformers' GGUF loader does. Qwen2 / Qwen3 files are not permuted.
"""

from __future__ import annotations

import functools
import mmap
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from specdec.core.checkpoint import CheckpointError

# general.architecture -> (the HF class it is, whether llama.cpp permuted its Q / K rows)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

# Tensor types this loader dequantizes (with gguf.quants, llama.cpp's reference code).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# llama.cpp's tensor names -> the HF ones (blk.N.<key> -> model.layers.N.<value>)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# tokenizer.ggml.pre -> the split regex its merges were learned with (as transformers' GGUF loader)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
_CHUNK_BYTES = 4 << 20  # float32 bytes dequantized at a time (see GGUFCheckpoint._dequantize)


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix) rather than a checkpoint directory."""
    return Path(path).suffix.lower() == ".gguf"


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes ``LlamaModel.permute`` of llama.cpp's converter on a Q or K weight (or bias) of
    ``n_head`` heads: each head's rows back from (pairs, halves) to (halves, pairs) order."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_name(name: str) -> str:
    """The HF tensor name of llama.cpp's ``name`` (unknown names are kept, and so reported)."""
    m = _LAYER_RE.fullmatch(name)
    if m and m[2] in _LAYER_NAMES:
        return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"
    stem, _, kind = name.rpartition(".")
    return f"{_TOP_NAMES[stem]}.{kind}" if stem in _TOP_NAMES else name


class _Tensor(NamedTuple):
    """Where one tensor's bytes lie in the file, and how the ``gguf`` reader would view them."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    n_elements: int
    offset: int  # bytes from the start of the file
    n_bytes: int
    view_dtype: np.dtype  # (quantized: bytes, viewed as (rows, bytes of a row))
    view_shape: tuple[int, ...]


class GGUFCheckpoint:
    """One ``.gguf`` file: its settings as a ``config.json`` dict, its weights, tokenizer and chat template.

    The file is parsed once, into plain values (the metadata, each tensor's place); the
    ``gguf`` reader is dropped then: its per-string field arrays hold some 160 MiB for a
    49k-token vocabulary. Weights are read through a map of the file opened per
    :meth:`iter_tensors`, so nothing maps the file once a load is done."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file {str(self.path)!r} does not exist")
        try:
            from gguf import GGUFReader

            reader = GGUFReader(str(self.path))
            self._meta = {key: field.contents() for key, field in reader.fields.items()}
            tensors = [_Tensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape), int(t.n_elements),
                               int(t.data_offset), int(t.n_bytes), t.data.dtype, tuple(t.data.shape))
                       for t in reader.tensors]
        except ImportError:
            raise CheckpointError(f"{self.path}: loading GGUF files needs the 'gguf' package "
                                  "(pip install gguf)") from None
        except Exception as e:  # the reader raises ValueError, struct / numpy errors on a corrupt file
            raise CheckpointError(f"{self.path} is not a readable GGUF file: {type(e).__name__}: {e}") from None
        finally:
            reader = None  # (the field arrays and the file's map go with it)
        self.arch = str(self.meta("general.architecture", ""))
        self.tensors = {t.name: t for t in tensors}

    def meta(self, key: str, default: Any = None) -> Any:
        """The metadata value ``key`` (a number, string or list), or ``default``."""
        return self._meta.get(key, default)

    def _arch_meta(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        value = self.meta(f"{self.arch}.{key}", default)
        if required and value is None:
            raise CheckpointError(f"{self.path}: metadata {self.arch}.{key} is missing")
        return value

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of this model (the keys ``LlamaConfig.from_dict`` reads)."""
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(f"{self.path}: general.architecture {self.arch!r} is not supported "
                                  f"(supported: {', '.join(ARCHITECTURES)})")
        if "rope_freqs.weight" in self.tensors or self._arch_meta("rope.scaling.type", "none") not in ("none", None):
            raise CheckpointError(f"{self.path}: rope scaling (rope_freqs / {self.arch}.rope.scaling.*) is not "
                                  "supported for GGUF files; use the Hugging Face checkpoint")
        if self._arch_meta("attention.sliding_window") is not None:
            raise CheckpointError(f"{self.path}: {self.arch}.attention.sliding_window is not supported for GGUF files")
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise CheckpointError(f"{self.path}: tensor 'token_embd.weight' is missing")
        heads = self._arch_meta("attention.head_count", required=True)
        hidden = self._arch_meta("embedding_length", required=True)
        eos = self.meta("tokenizer.ggml.eos_token_id")
        return {
            "architectures": [ARCHITECTURES[self.arch][0]],
            "model_type": self.arch,
            "vocab_size": int(embd.shape[-1]),  # GGUF shapes are innermost-first: (hidden, vocab)
            "hidden_size": hidden,
            "intermediate_size": self._arch_meta("feed_forward_length", required=True),
            "num_hidden_layers": self._arch_meta("block_count", required=True),
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch_meta("attention.head_count_kv", heads),
            "head_dim": self._arch_meta("attention.key_length") or self._arch_meta("rope.dimension_count"),
            "rms_norm_eps": self._arch_meta("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self._arch_meta("rope.freq_base", 10000.0),
            "max_position_embeddings": self._arch_meta("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": self.meta("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos,
            "pad_token_id": self.meta("tokenizer.ggml.padding_token_id"),
        }

    def element_count(self) -> int:
        """Elements of all tensors the file holds (for the config-vs-weights size check)."""
        return sum(t.n_elements for t in self.tensors.values())

    def iter_tensors(self, config: Any) -> Iterator[tuple[str, str, tuple[int, ...], Any]]:
        """``(hf_name, ggml_type, shape, load)`` per tensor; ``load(dtype)`` dequantizes it to
        ``dtype`` (None: float32) and undoes the Q / K permutation. An unsupported type fails
        at ``load``, naming the tensor and its type."""
        permuted = ARCHITECTURES.get(self.arch, ("", False))[1]
        try:
            data = np.memmap(self.path, mode="r")  # (closed when this generator and its loads are gone)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.path} could not be read: {e}") from None
        for t in self.tensors.values():
            kind = t.tensor_type.name
            shape = tuple(reversed(t.shape))  # GGUF lists the innermost dimension first
            heads = None
            if permuted and ".attn_q." in t.name:
                heads = config.num_attention_heads
            elif permuted and ".attn_k." in t.name:
                heads = config.num_key_value_heads

            def load(dtype: torch.dtype | None = None, t: _Tensor = t, kind: str = kind, shape: tuple = shape,
                     heads: int | None = heads) -> torch.Tensor:
                if kind not in SUPPORTED_TYPES:
                    raise CheckpointError(f"{self.path}: tensor {t.name!r} is stored as {kind}, which this loader "
                                          f"does not dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
                if t.offset + t.n_bytes > data.size:
                    raise CheckpointError(f"{self.path}: tensor {t.name!r} ends past the end of the file "
                                          "(truncated or rewritten since it was opened)")
                raw = data[t.offset : t.offset + t.n_bytes].view(t.view_dtype).reshape(t.view_shape)
                try:
                    return self._dequantize(raw, t.tensor_type, shape, heads, dtype or torch.float32)
                finally:
                    _drop_pages(data)

            yield hf_name(t.name), kind, shape, load

    @staticmethod
    def _dequantize(raw: np.ndarray, qtype: Any, shape: tuple[int, ...], heads: int | None,
                    dtype: torch.dtype) -> torch.Tensor:
        """The tensor stored as ``raw`` (the file's bytes, viewed as the ``gguf`` reader views
        them) in ``dtype``, dequantized a few MiB of rows at a time straight into the one
        tensor returned: the temporaries (numpy's float32 blocks, a Q / K head's unpermuted
        rows) stay small however large the tensor (an embedding: 0.1 GiB in SmolLM2)."""
        from gguf.quants import dequantize

        out = torch.empty(shape, dtype=dtype)
        if out.dim() < 2:  # (a norm or bias: small)
            w = torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32).reshape(shape))
            return out.copy_(unpermute(w, heads) if heads else w)
        rows = out.view(-1, shape[-1])
        data = raw.reshape(rows.shape[0], -1)  # (rows, bytes or values of a row)
        unit = rows.shape[0] // heads if heads else 1  # (a permuted head's rows unpermute together)
        step = max(1, (_CHUNK_BYTES // max(1, 4 * rows.shape[1])) // unit) * unit
        for i in range(0, rows.shape[0], step):
            a = np.asarray(dequantize(data[i : i + step], qtype), dtype=np.float32)
            w = torch.from_numpy(a if a.flags.writeable else a.copy()).view(-1, rows.shape[1])  # (F32: the file's map)
            if heads:
                w = unpermute(w, w.shape[0] // unit)
            rows[i : i + step].copy_(w)
        return out

    # -- tokenizer and chat template ------------------------------------------------------

    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.tokens" in self._meta

    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` the metadata describes (byte-level BPE, ``tokenizer.ggml.model``
        ``gpt2``: Llama 3, Qwen, SmolLM …); other tokenizer models fail naming the key."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

        model = self.meta("tokenizer.ggml.model")
        if model != "gpt2":
            raise CheckpointError(f"{self.path}: tokenizer.ggml.model {model!r} is not supported (only 'gpt2', "
                                  "byte-level BPE); pass token ids, or use the Hugging Face checkpoint")
        tokens = [str(t) for t in self.meta("tokenizer.ggml.tokens")]
        merges = [tuple(str(m).split(" ", 1)) for m in self.meta("tokenizer.ggml.merges", [])]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        pre = str(self.meta("tokenizer.ggml.pre", "default"))
        if pre in _SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), "isolated"),
                                                         pre_tokenizers.ByteLevel(False, use_regex=False)])
        elif pre == "smollm":  # llama.cpp: every digit alone, then GPT-2's split (SmolLM's tokenizer.json)
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(False, use_regex=True)])
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        types = list(self.meta("tokenizer.ggml.token_type", []))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])
        bos = self.meta("tokenizer.ggml.bos_token_id")
        if self.meta("tokenizer.ggml.add_bos_token", False) and bos is not None:
            b = tokens[bos]
            tok.post_processor = processors.TemplateProcessing(single=f"{b} $A", pair=f"{b} $A {b} $B",
                                                               special_tokens=[(b, bos)])
        return tok

    def chat_template(self) -> str | None:
        t = self.meta("tokenizer.chat_template")
        return str(t) if t is not None else None

    def special_tokens(self) -> dict[str, str]:
        """``bos_token`` / ``eos_token`` … as text (what chat templates read), from their ids."""
        tokens = self.meta("tokenizer.ggml.tokens") or []
        out = {}
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
            i = self.meta(f"tokenizer.ggml.{key}")
            if isinstance(i, int) and 0 <= i < len(tokens):
                out[name] = str(tokens[i])
        return out


def _drop_pages(data: np.memmap) -> None:
    """Lets the kernel drop the file's pages this process has read (they stay in the page
    cache): the quantized bytes of a tensor already loaded would otherwise count in the
    process's resident memory (0.09 GiB for SmolLM2-135M's Q4_1 file) while the map is open."""
    m = getattr(data, "_mmap", None)
    if m is not None and hasattr(m, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        try:
            m.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int, size: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """The parsed file at ``path`` (kept for a few loads: config, weights, tokenizer and
    chat template each read it; a file rewritten since is parsed again)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        raise CheckpointError(f"GGUF file {str(p)!r} does not exist") from None
    return _open(str(p.resolve()), st.st_mtime_ns, st.st_size)
