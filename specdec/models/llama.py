"""The Llama family (Llama / Llama 3, Qwen2, Qwen3, Mistral) in plain PyTorch.

One implementation, driven by :class:`~specdec.models.config.LlamaConfig`.
Parameter names follow Hugging Face's, so an HF ``state_dict`` loads as is.

Two ways to run it:

- :meth:`LlamaDecoder.forward` — a packed ragged batch with a paged KV cache
  (prefill and decode alike; see :mod:`specdec.core.inputs`). On our float32
  CPU kernels its backend is native (:mod:`specdec.core.backend`): one C++ call
  with the eager Python forward's bits; elsewhere the Python below runs;
- :meth:`LlamaDecoder.forward_dense` — ``[batch, seq]`` tokens, causal, no
  cache: for training and for quick checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from specdec.core.backend import backend_of, forward_checking_rows
from specdec.core.flex import FlexAttend
from specdec.core.inputs import DecoderInputs, DecoderOutputs, KVCacheTensors, MaskKind
from specdec.core.linear import Embedding, Linear, RMSNorm, embedding_operand, release_freed_memory
from specdec.core.registry import DecoderModule, Role, register
from specdec.models.config import LlamaConfig


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attend(Protocol):
    """How a layer's attention reads and writes keys/values for one forward."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:  # q [T, H, D], k/v [T, Hkv, D] -> [T, H*D]
        ...


class PagedAttend:
    """Ragged batch over a paged cache: write the new k/v, gather, attend.

    Masking is by selection. A row's gathered keys include slots it must not
    see: padding (another request's block), stale slots of freed blocks and
    rejected drafts, later rows of its own request. A mask only adds -inf to
    their scores, and ``NaN + -inf`` and ``0 × NaN`` are NaN, so one
    non-finite value there would reach every row. Instead, such slots are not
    read at all: the gather reads the request's own first slot in their place
    (masked as before). When a request feeds several rows (a prefill, or a
    verification whose later drafts may be rejected), a row that *sees* a
    non-finite key or value of this forward gets NaN, as it would unmasked,
    and the rows before it stay clean; the step then fails that request only
    if it uses such a row. All of it is index arithmetic on ``[B, S]``: no
    pass over the gathered keys and values. That per-row hiding
    (``isolate_rows``) is the costly part (about 15% of a verification forward
    on CPU), so an eager CPU forward runs without it and again with it only
    when some row went non-finite (``backend.forward_checking_rows``).

    Two kernels attend. SDPA over gathered copies of the keys and values, or,
    with ``kernel="specdec"`` on a float32 CPU cache (head_dim a multiple of
    16), ``specdec_cpu::paged_attention``: each row reads its visible keys by
    slot straight from the cache (skipping the rest, so the substitution above
    costs nothing there) and sums them in one fixed order, so a verified row
    gets the bits it gets decoded alone. On a 2-core AMD EPYC (Zen 1) it took
    the built-in target's one-token forward at context 120 from 8.6 to 7.0 ms
    eager and 3.0 to 2.55 compiled.
    """

    def __init__(self, inputs: DecoderInputs, cache: KVCacheTensors, window: int | None,
                 isolate_rows: bool = True, kernel: str | None = None) -> None:
        self.inputs = inputs
        self.isolate_rows = isolate_rows
        self.cache = cache
        # Our CPU kernel (specdec_cpu::paged_attention) reads keys and values by slot, no gathered copy.
        self.own_kernel = (kernel == "specdec" and cache.k.device.type == "cpu" and cache.k.dtype == torch.float32
                           and cache.k.shape[-1] % 16 == 0)
        self.single = inputs.single_request  # one request: no packing
        self.causal = False
        self.mask: torch.Tensor | None = None
        self.slots = inputs.gather_slots  # [B, S]
        # Host-decided (see MaskKind), so a compiled forward guards on a flag, not on sizes.
        tree = inputs.tree_mask  # [B, Q, Q] or None: a token-tree step (DecoderInputs.tree_mask)
        if window is None and inputs.mask != MaskKind.EXPLICIT and tree is None:
            # NONE: one query that sees every gathered key, nothing to hide.
            # CAUSAL: every request fed from 0: its gathered keys are its new rows, in order.
            self.causal = inputs.mask == MaskKind.CAUSAL
            if self.causal and not self.single:  # prompts, each fed from 0: key j is its row j
                self.slots = self._own_context(inputs)[1]  # (past it: hidden by causality)
            return
        # One row per request (decode): its only query sees all its new keys, nothing to hide per row.
        self.per_row = inputs.q_index.shape[1] > 1
        if inputs.key_mask is not None and window is None and tree is None:
            # The packer's mask, every gathered key in context: nothing to build (a one-request
            # step's verification or catch-up, no tensor op here).
            self.mask, self.slots, self.in_context = inputs.key_mask, inputs.gather_slots, None
            return
        s = inputs.gather_slots.shape[1]
        key_pos = torch.arange(s, device=inputs.q_pos.device)
        q_pos = inputs.q_pos.unsqueeze(-1)  # [B, Q, 1]
        mask = key_pos <= q_pos  # [B, Q, S]
        if tree is not None:
            mask &= self._tree_visible(tree, key_pos, inputs.q_pos)
        if window is not None and tree is None:
            mask &= key_pos > q_pos - window
        elif window is not None:  # the window counts rope positions: a key's is its row's
            key_rope = key_pos.expand(inputs.q_pos.shape[0], s).index_put(self._row_keys(), inputs.positions)  # [B, S]
            q_rope = key_rope.gather(1, inputs.q_pos)  # [B, Q]
            mask &= key_rope.unsqueeze(1) > (q_rope - window).unsqueeze(-1)
        self.mask = mask.unsqueeze(1)  # [B, 1, Q, S]
        self.in_context, self.slots = self._own_context(inputs)  # (past it: masked)

    def _row_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([T] request of each new row, [T] its key index): its position, except in a tree
        step (rope positions are root + depth there; q_pos keeps the key index)."""
        inp = self.inputs
        row_key = inp.positions if inp.tree_mask is None else inp.q_pos.reshape(-1)[inp.out_index]
        return inp.out_index // inp.q_index.shape[1], row_key

    @staticmethod
    def _own_context(inputs: DecoderInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(``[B, S]`` key within the request's context, ``[B, S]`` slots to gather): past its
        context a request reads its own first slot (written, so finite) instead."""
        key_pos = torch.arange(inputs.gather_slots.shape[1], device=inputs.q_pos.device)
        in_context = key_pos <= inputs.q_pos.amax(1, keepdim=True)
        return in_context, torch.where(in_context, inputs.gather_slots, inputs.gather_slots[:, :1])

    @staticmethod
    def _tree_visible(tree: torch.Tensor, key_pos: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """``[B, Q, S]``: key ``j`` is cached context (before the request's first
        new row, key index ``q_pos[b, 0]``) or a new row query ``i`` sees in ``tree``."""
        rel = key_pos - q_pos[:, :1]  # [B, S] new-row index of each key (< 0: cached context)
        idx = rel.clamp(0, tree.shape[2] - 1).unsqueeze(1).expand(-1, tree.shape[1], -1)  # [B, Q, S]
        return (rel < 0).unsqueeze(1) | tree.gather(2, idx)

    @property
    def rows_meet(self) -> bool:
        """Whether rows of one request see each other's new keys in this forward."""
        return self.causal or self.mask is not None and self.per_row

    def _hide(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The slots to gather ``[B, S]`` (a non-finite new row replaced like
        padding) and the queries that see one (to be NaN; None: nothing to hide)."""
        if not (self.isolate_rows and self.rows_meet):
            return self.slots, None
        # Per new row: NaN and ±inf survive a sum (one fp32 reduction; isfinite().all() is ~15x slower on CPU).
        ok = (k.sum((1, 2), dtype=torch.float32) + v.sum((1, 2), dtype=torch.float32)).isfinite()  # [T]
        if self.causal:  # key j of request b is its row j (q_index[b, j], padding its last row)
            q_index = self.inputs.q_index  # [B, Q], Q >= S (one request: [1, T], its rows in order)
            ok_q = ok.index_select(0, q_index.reshape(-1)).view(q_index.shape)  # [B, Q]
            slots = torch.where(ok_q[:, : self.slots.shape[1]], self.slots, self.slots[:, :1])
            return slots, (ok_q.cumprod(1) == 0).unsqueeze(1).unsqueeze(-1)  # [B, 1, Q, 1]
        in_context = self.in_context if self.in_context is not None else torch.ones_like(self.slots, dtype=torch.bool)
        seen = in_context.index_put(self._row_keys(), ok)  # [B, S] in context and finite
        poisoned = (self.mask > seen[:, None, None, :]).any(-1, keepdim=True)  # [B, 1, Q, 1] sees a bad row
        return torch.where(seen, self.slots, self.slots[:, :1]), poisoned

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        inp = self.inputs
        if torch.compiler.is_compiling():
            # Index the whole [layers, slots, …] input, not a layer's view:
            # compiled, that stays one in-place scatter (a view's write was
            # copied back wrongly, or as a copy of the whole cache).
            li = torch.full_like(inp.slot_mapping, layer)
            self.cache.k.index_put_((li, inp.slot_mapping), k)
            self.cache.v.index_put_((li, inp.slot_mapping), v)
        else:
            self.cache.k[layer].index_copy_(0, inp.slot_mapping, k)
            self.cache.v[layer].index_copy_(0, inp.slot_mapping, v)
        kc, vc = self.cache.k[layer], self.cache.v[layer]  # [slots, Hkv, D]
        slots, poisoned = self._hide(k, v)
        if self.single:
            qp = q.unsqueeze(0)  # [1, T, H, D]
        else:
            qp = q.index_select(0, inp.q_index.reshape(-1)).view(*inp.q_index.shape, *q.shape[1:])  # [B, Q, H, D]
        if self.own_kernel:
            out = torch.ops.specdec_cpu.paged_attention.default(
                qp, kc, vc, slots, self.mask, self.causal, q.shape[-1] ** -0.5)  # [B, Q, H, D]
        else:
            b, n_keys = slots.shape
            flat = slots.reshape(-1)  # index_select: far faster than advanced indexing on CPU
            keys = kc.index_select(0, flat).view(b, n_keys, *kc.shape[1:]).transpose(1, 2)  # [B, Hkv, S, D]
            vals = vc.index_select(0, flat).view(b, n_keys, *vc.shape[1:]).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                qp.transpose(1, 2), keys, vals, attn_mask=self.mask, is_causal=self.causal, enable_gqa=True
            ).transpose(1, 2)  # [B, Q, H, D]
        if poisoned is not None:
            out = out.masked_fill(poisoned.transpose(1, 2), float("nan"))  # [B, Q, 1, 1]
        b, nq, h, d = out.shape
        out = out.reshape(b * nq, h * d)
        return out if self.single else out.index_select(0, inp.out_index)  # [T, H*D]


class GroupedAttend:
    """Attention of a batch packed in groups (``DecoderInputs.attention_groups``):
    each group's rows, in order, through its own :class:`PagedAttend`."""

    def __init__(self, groups: list[PagedAttend]) -> None:
        self.groups = groups
        # Rows per group, from tensor sizes (symbolic when compiled: no guard on the values).
        self.sizes = [g.inputs.positions.shape[0] for g in groups]

    @property
    def rows_meet(self) -> bool:
        return any(g.rows_meet for g in self.groups)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for g, n in zip(self.groups, self.sizes):  # (slices: ``split`` would fix the sizes in a compiled graph)
            outs.append(g(layer, q[start : start + n], k[start : start + n], v[start : start + n]))
            start = start + n
        return torch.cat(outs)


def native_groups(attend: Attend, rope_ready: bool) -> list[PagedAttend] | None:
    """The attention groups a forward hands to its native backend's one call, or None where
    the Python runs this call: gradients, another attention, rope tables not built yet, or a
    forward that hides each row's non-finite new keys (PagedAttend._hide reads them between layers)."""
    if torch.is_grad_enabled() or not rope_ready:
        return None
    groups = attend.groups if isinstance(attend, GroupedAttend) else [attend]
    if not all(isinstance(g, PagedAttend) and g.own_kernel and not (g.isolate_rows and g.rows_meet)
               for g in groups):
        return None
    return groups


def paged_attend(inputs: DecoderInputs, cache: KVCacheTensors, window: int | None,
                 isolate_rows: bool = True, kernel: str | None = None) -> PagedAttend | GroupedAttend | FlexAttend:
    """The paged attention of one forward: in the packer's groups when it made any.
    ``kernel="specdec"``: our CPU kernel where it serves (float32 CPU cache), else SDPA;
    ``kernel="flex"`` (``runtime.attention``): flex attention over the whole cache, one
    call per layer for the whole batch (:mod:`specdec.core.flex`)."""
    if kernel == "flex":
        return FlexAttend(inputs, cache, window)
    if inputs.attention_groups:
        return GroupedAttend([PagedAttend(g, cache, window, isolate_rows, kernel) for g in inputs.attention_groups])
    return PagedAttend(inputs, cache, window, isolate_rows, kernel)


class DenseCausalAttend:
    """``[batch, seq]`` causal attention without a cache (training)."""

    def __init__(self, batch: int, seq: int, window: int | None) -> None:
        self.batch, self.seq, self.window = batch, seq, window
        self.mask = None
        if window is not None:
            i = torch.arange(seq)
            self.mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s = self.batch, self.seq
        q, k, v = (t.view(b, s, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        if self.mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask.to(q.device), enable_gqa=True)
        return out.transpose(1, 2).reshape(b * s, -1)


class Attention(nn.Module):
    # Tensor parallelism (specdec.dist) sets a sum over ranks of o_proj's output; None: one device.
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = Linear(d, self.n_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = Linear(d, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = Linear(d, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, d, bias=cfg.o_proj_bias)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head before rope
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.qkv: Linear | None = None  # set by fuse(): [q; k; v] rows, outside the state_dict

    def fuse(self) -> None:
        self.qkv = Linear.fused([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        h, kv, hd = self.n_heads, self.n_kv, self.head_dim  # x [T, d]; cos/sin [T, 1, D]
        if self.qkv is not None:
            qkv = self.qkv(x)  # [T, (H + 2 Hkv) D]
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        qk = qkv[:, : (h + kv) * hd].unflatten(-1, (h + kv, hd))  # [T, H + Hkv, D]
        v = qkv[:, (h + kv) * hd :].unflatten(-1, (kv, hd))  # [T, Hkv, D]
        if self.qk_norm:
            q, k = qk.split([h, kv], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        qk = qk * cos + rotate_half(qk) * sin  # rope on q and k at once
        q, k = qk.split([h, kv], dim=1)
        out = self.o_proj(attend(self.layer, q, k, v))
        return out if self.reduce is None else self.reduce(out)  # tensor parallel: sum the ranks' partial rows


class MLP(nn.Module):
    # Tensor parallelism (specdec.dist) sets a sum over ranks of down_proj's output; None: one device.
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, f, bias=cfg.mlp_bias)
        self.up_proj = Linear(d, f, bias=cfg.mlp_bias)
        self.down_proj = Linear(f, d, bias=cfg.mlp_bias)
        self.gate_up: Linear | None = None  # set by fuse(): [gate; up] rows, outside the state_dict

    def fuse(self) -> None:
        self.gate_up = Linear.fused([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        out = self.down_proj(F.silu(gate) * up)
        return out if self.reduce is None else self.reduce(out)  # tensor parallel: sum the ranks' partial rows


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class RopeTables(nn.Module):
    """Rotary cos/sin tables grown on demand, for a module with ``config``
    (``rope``, ``head_dim``, ``max_position_embeddings``) whose weights set the dtype."""

    _rope_len: int
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def _init_rope(self) -> None:
        self._rope_len = 0
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def _rope(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions`` [T] -> [T, 1, head_dim], tables grown on demand."""
        if max_pos >= self._rope_len or self.rope_cos.device != positions.device:
            cfg = self.config  # type: ignore[attr-defined]
            n = max(max_pos + 1, cfg.max_position_embeddings, 2 * self._rope_len)
            inv = cfg.rope.inv_freq(cfg.head_dim).float()
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv)
            emb = torch.cat((freqs, freqs), dim=-1)
            dtype = next(p for p in self.parameters()).dtype
            self.rope_cos = emb.cos().to(device=positions.device, dtype=dtype)
            self.rope_sin = emb.sin().to(device=positions.device, dtype=dtype)
            self._rope_len = n
        # (index_select: the rows ``table[positions]`` gives, at a third of its eager cost)
        return (self.rope_cos.index_select(0, positions).unsqueeze(1),
                self.rope_sin.index_select(0, positions).unsqueeze(1))

    def rope_for(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of ``positions`` [T]; after :meth:`ensure_rope`, without a host sync."""
        max_pos = self._rope_len - 1 if self._rope_len else int(positions.max())
        return self._rope(positions, max_pos)

    def ensure_rope(self, max_positions: int, device: torch.device | str = "cpu") -> None:
        """Builds the rope tables for positions ``< max_positions`` (call once)."""
        self._rope(torch.zeros(1, dtype=torch.long, device=device), max_positions - 1)


@register(Role.DECODER, "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
class LlamaDecoder(RopeTables, DecoderModule):
    """A Llama-family causal LM over a paged KV cache."""

    config_cls = LlamaConfig
    # "specdec": our CPU attention kernel (set by pack_layers); "flex": flex attention (runtime.attention)
    attention_kernel: str | None = None
    supports_data_parallel = True  # stateless between steps: replicas just split the batch
    # Tensor parallelism (styles: specdec/dist/tensor_parallel.py): heads and MLP columns split,
    # row-parallel o_proj / down_proj summed by an all-reduce, vocabulary-parallel embedding and head.
    tp_plan = {
        "model.embed_tokens": "vocab_embedding",
        "model.layers.*.self_attn": "heads",
        "model.layers.*.self_attn.[qkv]_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp": "reduce",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "vocab_head",
    }

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._init_rope()

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def first_layers(self, k: int) -> LlamaDecoder:
        """A decoder of this one's first ``k`` layers, then its final norm and head, over the
        very same modules (weights, fused and packed projections, kernels: no copy), for
        layer-skip self-speculation (``specdec/spec/proposers/layer_skip.py``). It is already
        prepared: fusing or packing it again would give it weights of its own."""
        if not 1 <= k <= self.num_layers:
            raise ValueError(f"first_layers: k must be in 1..{self.num_layers}, got {k!r}")
        view = type(self).__new__(type(self))
        nn.Module.__init__(view)
        view.config = dataclasses.replace(self.config, num_hidden_layers=k)
        view.model = LlamaModel.__new__(LlamaModel)
        nn.Module.__init__(view.model)
        view.model.embed_tokens = self.model.embed_tokens
        view.model.layers = nn.ModuleList(list(self.model.layers)[:k])
        view.model.norm = self.model.norm
        view.lm_head = self.lm_head
        view._init_rope()
        view.attention_kernel = self.attention_kernel
        return view.eval()

    def _layers(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
        capture: tuple[int, ...] = (), rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Runs every layer; returns the final-norm output and, for each layer in
        ``capture``, its input at ``rows`` ([N, d] each; ``capture`` may name
        ``num_layers``: the last layer's output before the final norm)."""
        # (A list filled by position, not a dict keyed by layer: dynamo mis-traced the
        # dict, a KeyError that sent the whole compiled forward back to eager.)
        seen: list[torch.Tensor | None] = [None] * len(capture)
        for i, layer in enumerate([*self.model.layers, None]):
            for k, c in enumerate(capture):
                if c == i:
                    seen[k] = x if rows is None else x[rows]
            if layer is not None:
                x = layer(x, cos, sin, attend)
        return self.model.norm(x), [h for h in seen if h is not None]

    def native_operands(self) -> tuple[Any, ...] | None:
        """The module's operands of ``specdec_cpu::decoder_forward`` (embedding and its rows, weights,
        biases, dims, eps, final norm, head, its bias, vocabulary, attention scale), for
        :mod:`specdec.core.backend` to gather once after packing; None where it does not
        serve this module: a layer or the head not packed for our kernels (or not fused),
        Qwen3's q/k norms, tensor parallelism (its embedding, head and sums are not ours)."""
        weights: list[torch.Tensor] = []
        biases: list[torch.Tensor | None] = []
        eps = {self.model.norm.eps}
        embed = embedding_operand(self.model.embed_tokens)  # (a tied model's: its packed head)
        ok = (self.attention_kernel == "specdec" and self.model.norm.kernel == "specdec" and embed is not None
              and isinstance(self.lm_head, Linear) and self.lm_head.kernel == "specdec")
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            lins = (a.qkv, a.o_proj, m.gate_up, m.down_proj)
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            ok = ok and not a.qk_norm and a.reduce is None and m.reduce is None \
                and all(lin is not None and lin.kernel == "specdec" for lin in lins) \
                and all(n.kernel == "specdec" for n in norms)
            if not ok:
                break
            eps |= {n.eps for n in norms}
            weights += [norms[0].weight, lins[0].packed, lins[1].packed, norms[1].weight, lins[2].packed,
                        lins[3].packed]
            biases += [lin.bias for lin in lins]
        a0 = self.model.layers[0].self_attn if len(self.model.layers) else None
        ok = ok and a0 is not None and len(eps) == 1
        if ok:
            dims = [a0.n_heads, a0.n_kv, a0.head_dim, self.config.intermediate_size, len(self.model.layers)]
            return (*embed, weights, biases, dims, eps.pop(), self.model.norm.weight,
                    self.lm_head.packed, self.lm_head.bias, self.lm_head.out_features, a0.head_dim ** -0.5)
        return None

    def _native_groups(self, attend: Attend) -> list[PagedAttend] | None:
        return native_groups(attend, bool(self._rope_len))

    def forward(self, inputs: DecoderInputs) -> DecoderOutputs:
        """Packed ragged forward over the paged cache in ``inputs.kv_cache``.

        On our CPU kernels (float32, packed by ``pack_layers``) its backend is native: the
        whole forward is one C++ call computing what the Python below computes, bit for bit.
        Each row's non-finite new keys are hidden from the rows before it as
        :func:`~specdec.core.backend.forward_checking_rows` decides."""
        assert inputs.kv_cache is not None, "DecoderInputs.kv_cache is required"
        backend = backend_of(self)
        rows = None if inputs.all_hidden else inputs.logit_index  # where captured layers are kept

        def run(isolate: bool) -> tuple[tuple[Any, ...], torch.Tensor, bool]:
            attend = paged_attend(inputs, inputs.kv_cache, self.config.sliding_window, isolate_rows=isolate,
                                  kernel=self.attention_kernel)
            groups = self._native_groups(attend)
            out = backend.stack(inputs, groups, rows) if groups is not None else None
            if out is None:
                x, cos, sin = self._embed(inputs)
                h, aux = self._layers(x, cos, sin, attend, inputs.capture_layers, rows)
                out = (h, None, None, aux)
            return out, out[0], attend.rows_meet

        h, hl, logits, aux = forward_checking_rows(run, inputs.tokens.device, inputs.isolate_rows)
        aux_t = torch.cat(aux, dim=-1) if aux else None
        if hl is None or logits is None:
            hl = h[inputs.logit_index]  # [N, d]
            logits = self.lm_head(hl)
        if not inputs.all_hidden:
            return DecoderOutputs(logits=logits, hidden_states=hl, aux_hidden_states=aux_t)
        return DecoderOutputs(logits=logits, hidden_states=hl,
                              aux_hidden_states=aux_t[inputs.logit_index] if aux_t is not None else None,
                              row_hidden_states=h, row_aux_hidden_states=aux_t)

    def _embed(self, inputs: DecoderInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The token embeddings [T, d] and the rope cos/sin [T, 1, head_dim] of ``inputs``."""
        # Positions grow one step at a time; the table is sized up front by
        # ``ensure_rope`` so no host sync is needed here. A module that never
        # had ``ensure_rope`` (``load_decoder``, ``build_module``) builds the
        # table on its first call, with one host sync.
        return self.model.embed_tokens(inputs.tokens), *self.rope_for(inputs.positions)

    def prepare_for_inference(self) -> LlamaDecoder:
        """Fuses q/k/v and gate/up projections (their weights become views of the fused
        ones), a layer at a time, handing what each frees back to the system: the model
        never holds more than one layer twice. Call after loading, not before training:
        the fused tensors are not trained."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
            release_freed_memory()
        return self

    def forward_dense(self, tokens: torch.Tensor) -> torch.Tensor:
        """Causal forward of ``tokens`` [B, S] without a cache -> logits [B, S, V]."""
        b, s = tokens.shape
        pos = torch.arange(s, device=tokens.device).repeat(b)
        cos, sin = self._rope(pos, s - 1)
        x = self.model.embed_tokens(tokens.reshape(-1))
        h, _ = self._layers(x, cos, sin, DenseCausalAttend(b, s, self.config.sliding_window))
        return self.lm_head(h).view(b, s, -1)
