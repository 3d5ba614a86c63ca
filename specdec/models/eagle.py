"""EAGLE-1 and EAGLE-3 draft heads: one decoder layer over the target's features.

A head drafts from pairs ``(feature_t, token x_{t+1})``: at position ``t`` it
reads the target's feature at ``t`` and the token that followed, and its
output ``h_t`` gives logits for ``x_{t+2}``. Later draft steps feed the head's
own ``h`` back as the feature, with the token just drafted. Both heads keep
their own paged KV cache (one layer) and borrow the target's embedding (and,
EAGLE-1, its lm_head) by reference: :meth:`EagleHead.attach_target`.

- **EAGLE-1** (``fc.weight [H, 2H]``, optional ``fc.bias``, ``layers.0.*``
  without ``input_layernorm``; a one-layer ``LlamaForCausalLM`` config)::

      h = layer(fc([embed(x_{t+1}); f_t]))            f_t: the target's final-norm hidden state
      logits = target.lm_head(h)                      (no norm in between)

- **EAGLE-3** (``fc.weight [H, 3H]``, ``midlayer.*``, ``norm.weight``,
  ``lm_head.weight [V_draft, H]``, ``d2t [V_draft]``, ``t2d [V]``;
  ``LlamaForCausalLMEagle3``)::

      g = fc([a_low; a_mid; a_high])                  inputs of target layers aux_layers (step 0 only)
      x = [input_layernorm(embed(x_{t+1})); hidden_norm(g)]     (2H)
      h = g + attn(x);  h = h + mlp(post_attention_layernorm(h))
      logits = lm_head(norm(h))                       over the draft vocabulary;
      target id of draft id i = i + d2t[i]

On our float32 CPU kernels (packed by ``pack_layers``) a head's backend is native
(:mod:`specdec.core.backend`): its forward is one C++ call (``specdec_cpu::eagle_forward``)
computing what the Python computes, bit for bit, and a greedy one-request chain of draft
steps one more (``eagle_steps``).

Published layouts load as they are (``load_decoder(path, role=Role.DRAFT_HEAD)``);
:func:`save_head` writes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec.core.backend import backend_of, forget_backend, forward_checking_rows
from specdec.core.inputs import DecoderInputs
from specdec.core.linear import Linear, embedding_operand
from specdec.core.registry import DecoderModule, Role, register
from specdec.models.config import MAX_SIZES, LlamaConfig, hf_config_dict, short_repr
from specdec.models.llama import (MLP, Attend, Attention, DecoderLayer, DenseCausalAttend, PagedAttend, RMSNorm,
                                  RopeTables, native_groups, paged_attend)

EAGLE3_ARCH = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class EagleHeadConfig:
    """A head's shapes. ``layer`` is the Llama config of its one decoder layer
    (hidden size, heads, MLP, rope; its ``vocab_size`` is the target's)."""

    kind: str  # "eagle" (EAGLE-1) or "eagle3"
    layer: LlamaConfig
    fc_bias: bool = True  # EAGLE-1 only: fc has a bias (the published default)
    target_hidden_size: int = 0  # 0: the head's hidden size
    draft_vocab_size: int = 0  # EAGLE-3's own vocabulary (0: the target's)
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3: target layers whose inputs are fused; None: (2, L//2, L-3)

    def __post_init__(self) -> None:
        if self.kind not in ("eagle", "eagle3"):
            raise ValueError(f"EAGLE head kind must be 'eagle' or 'eagle3', got {self.kind!r}")
        if self.kind == "eagle" and self.layer.num_hidden_layers != 1:
            raise ValueError(f"an EAGLE-1 head has one layer; config.json says num_hidden_layers="
                             f"{self.layer.num_hidden_layers}")
        if self.aux_layers is not None and len(self.aux_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses three target layers, got aux layer ids {list(self.aux_layers)}")

    # (the loader reads these through getattr, as it does a LlamaConfig's)
    @property
    def dtype(self) -> torch.dtype:
        return self.layer.dtype

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def head_dim(self) -> int:
        return self.layer.head_dim

    @property
    def rope(self) -> Any:
        return self.layer.rope

    @property
    def max_position_embeddings(self) -> int:
        return self.layer.max_position_embeddings

    @property
    def feature_size(self) -> int:
        """Width of the step-0 feature: H_t (EAGLE-1) or 3·H_t (EAGLE-3)."""
        t = self.target_hidden_size or self.hidden_size
        return t if self.kind == "eagle" else 3 * t

    @property
    def num_draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    def min_weight_elements(self) -> int:
        """A lower bound of the weights the head's files must hold (fc and its layer's
        projections; the embedding is the target's): see LlamaConfig.min_weight_elements."""
        return self.feature_size * self.hidden_size + self.layer.layer_weight_elements()

    def fused_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """Target layers whose inputs an EAGLE-3 head reads (() for EAGLE-1)."""
        if self.kind == "eagle":
            return ()
        if self.aux_layers is not None:
            return tuple(self.aux_layers)
        n = num_target_layers
        return (min(2, n - 1), n // 2, max(n - 3, 0))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EagleHeadConfig:
        """Parses a published head's ``config.json`` (the architecture tells the kind)."""
        arch = (d.get("architectures") or ["LlamaForCausalLM"])[0]
        kind = "eagle3" if arch == EAGLE3_ARCH else "eagle"
        layer = LlamaConfig.from_dict({**d, "architectures": ["LlamaForCausalLM"]})
        for k in ("target_hidden_size", "draft_vocab_size"):
            v = d.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_SIZES[
                    "hidden_size" if k == "target_hidden_size" else "vocab_size"]):
                raise ValueError(f"config.{k} must be a size (a non-negative integer within bounds), "
                                 f"got {short_repr(v)}")
        aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(kind=kind, layer=layer, fc_bias=bool(d.get("bias", True)),
                   target_hidden_size=int(d.get("target_hidden_size") or 0),
                   draft_vocab_size=int(d.get("draft_vocab_size") or 0) if kind == "eagle3" else 0,
                   aux_layers=tuple(int(i) for i in aux) if aux is not None else None)

    @classmethod
    def from_target(cls, kind: str, target: LlamaConfig, *, draft_vocab_size: int | None = None,
                    aux_layers: tuple[int, ...] | None = None, fc_bias: bool = True) -> EagleHeadConfig:
        """A head for ``target``: its layer has the target's shapes."""
        # A plain Llama layer whatever the target's family (the published heads have no biases or q/k norms).
        layer = replace(target, num_hidden_layers=1, architecture=EAGLE3_ARCH if kind == "eagle3" else
                        "LlamaForCausalLM", tie_word_embeddings=False, attention_bias=False, o_proj_bias=False,
                        mlp_bias=False, qk_norm=False)
        return cls(kind=kind, layer=layer, fc_bias=fc_bias, target_hidden_size=target.hidden_size,
                   draft_vocab_size=(draft_vocab_size or target.vocab_size) if kind == "eagle3" else 0,
                   aux_layers=tuple(aux_layers) if aux_layers is not None else None)

    def to_hf_dict(self, num_target_layers: int | None = None) -> dict[str, Any]:
        """The published ``config.json`` of this head."""
        d = hf_config_dict(self.layer)
        d["tie_word_embeddings"] = False
        d["attention_bias"] = self.layer.attention_bias  # (a Qwen2 target's head has q/k/v biases)
        d["mlp_bias"] = self.layer.mlp_bias
        if self.kind == "eagle":
            d["architectures"] = ["LlamaForCausalLM"]
            d["bias"] = self.fc_bias
        else:
            d["architectures"] = [EAGLE3_ARCH]
            d["draft_vocab_size"] = self.num_draft_vocab
            d["target_hidden_size"] = self.target_hidden_size or self.hidden_size
            ids = self.aux_layers if num_target_layers is None else self.fused_layers(num_target_layers)
            if ids is not None:
                d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True}
        return d


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: attention over [normed embedding; normed hidden] (2H)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = Attention(cfg, 0)
        a = self.self_attn
        for name, out in (("q_proj", a.n_heads), ("k_proj", a.n_kv), ("v_proj", a.n_kv)):
            setattr(a, name, Linear(2 * d, out * a.head_dim, bias=cfg.attention_bias))
        self.mlp = MLP(cfg)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # [T, 2H]
        h = hidden + self.self_attn(x, cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(RopeTables, DecoderModule):
    """What both heads share: the target's borrowed modules, rope, the paged forward."""

    config_cls = EagleHeadConfig
    attention_kernel: str | None = None  # "specdec": our CPU attention kernel (set by pack_layers)
    native_kind = "eagle"  # its native backend runs specdec_cpu::eagle_forward
    # A published EAGLE-1 file may carry the target's embedding: it is not read.
    strict_state_dict_loading = False

    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        self.config = config
        self._init_rope()
        self.__dict__["_target"] = None  # (embed, lm_head) of the target: not parameters of the head
        # Draft id -> target id, cached by prepare_for_inference (see draft_to_target).
        self.register_buffer("_ids", torch.empty(0, dtype=torch.long), persistent=False)

    # -- the target's modules, shared by reference -----------------------------------
    def attach_target(self, embed: nn.Embedding, lm_head: nn.Module) -> None:
        """Borrows the target's embedding (and lm_head): the same tensors, not copies."""
        self.__dict__["_target"] = (embed, lm_head)
        forget_backend(self)  # (its native operands include them)

    def native_operands(self) -> tuple[Any, ...] | None:
        """The head's operands of ``specdec_cpu::eagle_forward`` after the rope tables (the
        target's embedding and its rows; fc (EAGLE-1); EAGLE-3's input and hidden norms; the layer's weights,
        biases and dims; eps; EAGLE-3's norm; the lm head, its bias and vocabulary; the
        draft-to-target ids where the vocabularies differ; the target's vocabulary; the
        attention scale), or None where it does not serve: a layer, norm or head not packed
        for our kernels, no target attached, or an embedding that is not a float32 table."""
        target = self.__dict__.get("_target")
        if target is None or self.attention_kernel != "specdec":
            return None
        embed = embedding_operand(target[0])  # (a tied target's: its packed head)
        parts = self._native_parts()
        if parts is None or embed is None:
            return None
        layer, fc, in_norm, hidden_norm, final_norm, head = parts
        a, m = layer.self_attn, layer.mlp
        lins = [a.qkv, a.o_proj, m.gate_up, m.down_proj, head] + ([fc] if fc is not None else [])
        norms = [n for n in (layer.post_attention_layernorm, in_norm, hidden_norm, final_norm) if n is not None]
        if (not all(isinstance(lin, Linear) and lin.kernel == "specdec" for lin in lins)
                or not all(n.kernel == "specdec" for n in norms) or a.qk_norm or a.reduce is not None
                or m.reduce is not None or len({n.eps for n in norms}) != 1):
            return None
        v, full = head.out_features, self.config.vocab_size
        ids = self.draft_to_target if v != full else None
        return (*embed, fc.packed if fc is not None else None, fc.bias if fc is not None else None,
                in_norm.weight if in_norm is not None else None,
                hidden_norm.weight if hidden_norm is not None else None,
                [a.qkv.packed, a.o_proj.packed, layer.post_attention_layernorm.weight, m.gate_up.packed,
                 m.down_proj.packed], [a.qkv.bias, a.o_proj.bias, m.gate_up.bias, m.down_proj.bias],
                [a.n_heads, a.n_kv, a.head_dim, self.config.layer.intermediate_size], norms[0].eps,
                final_norm.weight if final_norm is not None else None, head.packed, head.bias, v, ids, full,
                a.head_dim ** -0.5)

    def _native_parts(self) -> tuple[Any, ...] | None:
        """(its layer, fc or None, input norm or None, hidden norm or None, final norm or None,
        lm head) as :meth:`native_operands` hands them to the op."""
        raise NotImplementedError

    def _native_groups(self, attend: Attend) -> list[PagedAttend] | None:
        return native_groups(attend, bool(self._rope_len))

    @property
    def embed(self) -> nn.Embedding:
        if self._target is None:
            raise RuntimeError(f"{type(self).__name__}: attach_target(embed, lm_head) first")
        return self._target[0]

    def _draft_ids(self) -> torch.Tensor:
        return torch.arange(self.config.num_draft_vocab, device=next(self.parameters()).device)

    def check_vocab_map(self) -> str:
        """What is wrong with the loaded draft-to-target vocabulary map ("" if nothing): every
        draft id must map to a distinct target id inside the target's vocabulary."""
        return ""

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[V_draft] int64: the target id of each draft id."""
        ids = self._ids
        return ids if ids.numel() == self.config.num_draft_vocab and ids.dtype == torch.long else self._draft_ids()

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.config.aux_layers or ())

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope_for(positions)

    # -- one draft step --------------------------------------------------------------
    def project(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """The step-0 feature from the target's (final-norm hidden, captured layer inputs)."""
        raise NotImplementedError

    def step(self, tokens: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             attend: Attend) -> torch.Tensor:
        """One draft step over packed rows: tokens [T], feature [T, H] -> h [T, H]."""
        raise NotImplementedError

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary, [..., V_draft]."""
        raise NotImplementedError

    def target_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary ([..., V]; -inf outside the draft vocabulary)."""
        lg = self.logits(h)
        if lg.shape[-1] == self.config.vocab_size:
            return lg
        full = lg.new_full((*lg.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, self.draft_to_target, lg)

    def forward(self, inputs: DecoderInputs, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed ragged step over the head's paged cache (``inputs.kv_cache``):
        feature [T, H] -> (h [N, H], target-vocabulary logits [N, V]) at ``logit_index``.
        Native (module doc): one C++ call, the Python's bits."""
        assert inputs.kv_cache is not None, "DecoderInputs.kv_cache is required"
        backend = backend_of(self)

        def run(isolate: bool) -> tuple[tuple[torch.Tensor, torch.Tensor | None], torch.Tensor, bool]:
            attend = paged_attend(inputs, inputs.kv_cache, None, isolate_rows=isolate, kernel=self.attention_kernel)
            groups = self._native_groups(attend)
            out = backend.eagle_step(inputs, feature, groups) if groups is not None else None
            if out is not None:
                return (out[1], out[2]), out[0], attend.rows_meet
            cos, sin = self.rope_for(inputs.positions)  # (the native call reads the tables itself)
            h = self.step(inputs.tokens, feature, cos, sin, attend)
            return (h[inputs.logit_index], None), h, attend.rows_meet

        h, logits = forward_checking_rows(run, feature.device)
        return h, logits if logits is not None else self.target_logits(h)

    def forward_dense(self, tokens: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """Causal step over ``tokens`` [B, S] and ``feature`` [B, S, H] at positions
        0..S-1, no cache (training) -> h [B, S, H]."""
        b, s = tokens.shape
        cos, sin = self._rope(torch.arange(s, device=tokens.device).repeat(b), s - 1)
        h = self.step(tokens.reshape(-1), feature.reshape(b * s, -1), cos, sin, DenseCausalAttend(b, s, None))
        return h.view(b, s, -1)


@register(Role.DRAFT_HEAD, "LlamaForCausalLM")
class Eagle1Head(EagleHead):
    """EAGLE-1: fc over [embedding; feature], one decoder layer, the target's lm_head."""

    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__(config)
        cfg = config.layer
        h, ht = cfg.hidden_size, config.target_hidden_size or cfg.hidden_size
        self.fc = Linear(h + ht, h, bias=config.fc_bias)
        layer = DecoderLayer(cfg, 0)
        del layer.input_layernorm  # the published layer 0 has none
        layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])

    def project(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        return hidden

    def step(self, tokens: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             attend: Attend) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed(tokens).to(feature.dtype), feature], dim=-1))
        return self.layers[0](x, cos, sin, attend)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._target[1](h)

    def _native_parts(self) -> tuple[Any, ...] | None:
        return self.layers[0], self.fc, None, None, None, self._target[1]

    def prepare_for_inference(self) -> Eagle1Head:
        self.layers[0].self_attn.fuse()
        self.layers[0].mlp.fuse()
        self._ids = self._draft_ids()
        return self


@register(Role.DRAFT_HEAD, EAGLE3_ARCH)
class Eagle3Head(EagleHead):
    """EAGLE-3: fc fuses three target layers; midlayer over [emb; hidden]; own norm and head."""

    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__(config)
        cfg = config.layer
        h = cfg.hidden_size
        self.fc = Linear(config.feature_size, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = Linear(h, config.num_draft_vocab, bias=False)
        nd = config.num_draft_vocab
        self.register_buffer("d2t", torch.zeros(nd, dtype=torch.long))  # target id - draft id
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool) if nd == cfg.vocab_size
                             else torch.zeros(cfg.vocab_size, dtype=torch.bool))  # target id in the draft vocab

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary: ``target_ids`` [V_draft], sorted (e.g. the most frequent tokens)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values
        if ids.numel() != self.config.num_draft_vocab:
            raise ValueError(f"draft vocabulary has {ids.numel()} ids, the head {self.config.num_draft_vocab}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True
        self._ids = self._draft_ids()
        forget_backend(self)  # (its native operands hold the map)

    def project(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        if aux is None:
            raise ValueError("an EAGLE-3 head reads the inputs of three target layers (aux hidden states)")
        return self.fc(aux)

    def step(self, tokens: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             attend: Attend) -> torch.Tensor:
        return self.midlayer(self.embed(tokens).to(feature.dtype), feature, cos, sin, attend)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def _native_parts(self) -> tuple[Any, ...] | None:
        m = self.midlayer
        return m, None, m.input_layernorm, m.hidden_norm, self.norm, self.lm_head

    def prepare_for_inference(self) -> Eagle3Head:
        self.midlayer.self_attn.fuse()
        self.midlayer.mlp.fuse()
        self._ids = self._draft_ids()
        return self

    def _draft_ids(self) -> torch.Tensor:
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def check_vocab_map(self) -> str:
        """``d2t`` (target id = draft id + d2t[id]) must land every draft id on a distinct id of
        the target's vocabulary: otherwise the first step fails in ``index_copy_``."""
        ids = self._draft_ids()
        v = self.config.vocab_size
        out = ((ids < 0) | (ids >= v)).nonzero().flatten()
        if out.numel():
            i = int(out[0])
            return (f"tensor 'd2t' maps draft id {i} to target id {int(ids[i])} (d2t[{i}] = {int(self.d2t[i])}), "
                    f"outside the target's vocabulary 0..{v - 1} ({out.numel()} draft ids out of range)")
        if torch.unique(ids).numel() != ids.numel():
            return "tensor 'd2t' maps two draft ids to one target id (target ids must be distinct)"
        return ""


def new_head(config: EagleHeadConfig, seed: int = 0) -> EagleHead:
    """A randomly initialised head (fp32), e.g. to train."""
    cls = Eagle3Head if config.kind == "eagle3" else Eagle1Head
    g = torch.Generator().manual_seed(seed)
    head = cls(config)
    for name, p in head.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 2:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.zero_()
    return head


def check_head_fits(head_config: EagleHeadConfig, target: LlamaConfig, where: str) -> None:
    """Raises ``ValueError`` naming the mismatch when a head cannot serve ``target``."""
    problems = []
    th = head_config.target_hidden_size or head_config.hidden_size
    if th != target.hidden_size:
        problems.append(f"it reads target hidden size {th}, the target has {target.hidden_size}")
    if head_config.hidden_size != target.hidden_size:  # it borrows the target's embedding
        problems.append(f"its hidden_size is {head_config.hidden_size}, the target's embedding has "
                        f"{target.hidden_size}")
    if head_config.vocab_size != target.vocab_size:
        problems.append(f"its vocab_size is {head_config.vocab_size}, the target's {target.vocab_size}")
    if head_config.num_draft_vocab > target.vocab_size:
        problems.append(f"its draft vocabulary ({head_config.num_draft_vocab}) is larger than the target's")
    n = target.num_hidden_layers  # id n: the last layer's output (before the final norm)
    bad = [i for i in head_config.fused_layers(n) if not 0 <= i <= n]
    if bad:
        problems.append(f"its aux layer ids {bad} are not layers of the target (inputs of 0..{n - 1}, "
                        f"or {n}: the last layer's output)")
    if problems:
        raise ValueError(f"EAGLE head {where} does not fit the target: " + "; ".join(problems))


def head_state_dict(head: EagleHead) -> dict[str, torch.Tensor]:
    """The published layout's tensors (floating weights in bf16)."""
    out = {}
    for k, v in head.state_dict().items():
        out[k] = v.detach().to(torch.bfloat16).contiguous() if v.is_floating_point() else v.detach().contiguous()
    return out


def save_head(head: EagleHead, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
              num_target_layers: int | None = None) -> list[Path]:
    """Writes ``config.json`` + ``model.safetensors`` in the published layout (bf16)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = head.config.to_hf_dict(num_target_layers)
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(head_state_dict(head), str(out / "model.safetensors"))
    files = [out / "config.json", out / "model.safetensors"]
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
        import shutil

        shutil.copy(Path(tokenizer_dir) / "tokenizer.json", out / "tokenizer.json")
        files.append(out / "tokenizer.json")
    return files


__all__ = ["EAGLE3_ARCH", "Eagle1Head", "Eagle3Head", "EagleHead", "EagleHeadConfig", "check_head_fits",
           "new_head", "save_head"]
