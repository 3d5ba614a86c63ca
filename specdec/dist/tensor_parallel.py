"""Tensor parallelism: a registered decoder split across the ranks of a group.

A decoder class declares how it splits in ``tp_plan`` (module name patterns
-> style; see :class:`~specdec.core.registry.DecoderModule`):

- ``colwise``: an ``nn.Linear`` whose output features are split (q/k/v by
  heads, gate/up by columns); each rank computes its slice;
- ``rowwise``: an ``nn.Linear`` whose input features are split (o_proj,
  down_proj); each rank's partial product is summed by the owning block's
  ``reduce`` (an all-reduce); the bias is added once (rank 0's shard holds it,
  the others hold zeros);
- ``heads``: an attention block: its ``n_heads`` / ``n_kv`` become the local
  counts and ``reduce`` is set;
- ``reduce``: a block whose output is a row-parallel sum (the MLP);
- ``vocab_embedding``: rows of the embedding split by vocabulary (padded to a
  multiple of the degree): a masked local lookup, then an all-reduce;
- ``vocab_head``: the output head split by vocabulary: local logits, then an
  all-gather (tied to the embedding's shard when the model ties them).

The decoder is built on the ``meta`` device, split by the plan, and each
parameter is read straight into the rank's shard from the safetensors files
(``get_slice``): a rank never holds the whole model. The KV cache of each rank
holds its ``num_key_value_heads / degree`` heads.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.core.linear import Linear
from specdec.core.checkpoint import CheckpointError, _retie, iter_tensors, weight_files, weight_map
from specdec.dist.group import DistContext, DistError

STYLES = ("colwise", "rowwise", "heads", "reduce", "vocab_embedding", "vocab_head")


@dataclass(frozen=True)
class Shard:
    """How one parameter is read: ``dim`` split at ``[start, stop)`` of the
    checkpoint's ``full`` shape, padded with zero rows to ``local`` rows;
    ``rank0_only``: the whole tensor on rank 0, zeros elsewhere (row-parallel bias)."""

    full: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0
    rank0_only: bool = False


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + rows)`` of a ``num_embeddings``-row embedding; the
    other rows come from the other ranks through an all-reduce."""

    def __init__(self, num_embeddings: int, dim: int, ctx: DistContext) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.rows = -(-num_embeddings // ctx.tp)  # padded: every rank holds the same count
        self.start = ctx.tp_rank * self.rows
        self.ctx = ctx
        self.weight = nn.Parameter(torch.empty(self.rows, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.ctx.all_reduce(x)


class VocabParallelHead(nn.Module):
    """Logits of this rank's vocabulary rows, all-gathered into the full ``[N, vocab]``."""

    def __init__(self, vocab_size: int, dim: int, ctx: DistContext, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // ctx.tp)
        self.start = ctx.tp_rank * self.rows
        self.ctx = ctx
        self.weight = weight if weight is not None else nn.Parameter(torch.empty(self.rows, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.ctx.all_gather_last(F.linear(h, self.weight))
        return logits[..., : self.vocab_size]


def plan_of(module_cls: type[nn.Module]) -> dict[str, str]:
    plan = getattr(module_cls, "tp_plan", None)
    if not plan:
        raise DistError(f"{module_cls.__name__} declares no tp_plan: it cannot run tensor parallel "
                        "(runtime.tensor_parallel_degree must be 1 for it)")
    bad = {k: v for k, v in plan.items() if v not in STYLES}
    if bad:
        raise DistError(f"{module_cls.__name__}.tp_plan has unknown styles {bad}; known: {', '.join(STYLES)}")
    return plan


def _style(plan: dict[str, str], name: str) -> str | None:
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return style
    return None


def _set(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def _split(n: int, ctx: DistContext, what: str) -> tuple[int, int]:
    if n % ctx.tp:
        raise DistError(f"{what} = {n} is not divisible by runtime.tensor_parallel_degree={ctx.tp}")
    k = n // ctx.tp
    return ctx.tp_rank * k, (ctx.tp_rank + 1) * k


def shard_module(module: nn.Module, ctx: DistContext) -> dict[str, Shard]:
    """Splits ``module`` (built on ``meta``) by its class's ``tp_plan`` in place;
    returns how each parameter of the result is read from the full checkpoint."""
    plan = plan_of(type(module))
    shards: dict[str, Shard] = {}
    reduce: Callable[[torch.Tensor], torch.Tensor] = ctx.all_reduce
    embedding: VocabParallelEmbedding | None = None
    for name, sub in list(module.named_modules()):
        style = _style(plan, name)
        if style is None:
            continue
        if style == "heads":
            n_heads, n_kv = sub.n_heads, sub.n_kv  # type: ignore[union-attr]
            _split(n_heads, ctx, f"{name}: num_attention_heads")
            _split(n_kv, ctx, f"{name}: num_key_value_heads")
            sub.n_heads, sub.n_kv = n_heads // ctx.tp, n_kv // ctx.tp  # type: ignore[union-attr]
            sub.reduce = reduce
        elif style == "reduce":
            sub.reduce = reduce
        elif style in ("colwise", "rowwise"):
            assert isinstance(sub, nn.Linear), f"tp_plan: {name} is {type(sub).__name__}, not nn.Linear"
            out_f, in_f, bias = sub.out_features, sub.in_features, sub.bias is not None
            if style == "colwise":
                a, b = _split(out_f, ctx, f"{name}: output features")
                new = Linear(in_f, b - a, bias=bias, device="meta")
                shards[f"{name}.weight"] = Shard((out_f, in_f), 0, a, b)
                if bias:
                    shards[f"{name}.bias"] = Shard((out_f,), 0, a, b)
            else:
                a, b = _split(in_f, ctx, f"{name}: input features")
                new = Linear(b - a, out_f, bias=bias, device="meta")
                shards[f"{name}.weight"] = Shard((out_f, in_f), 1, a, b)
                if bias:
                    shards[f"{name}.bias"] = Shard((out_f,), rank0_only=True)
            _set(module, name, new)
        elif style == "vocab_embedding":
            assert isinstance(sub, nn.Embedding)
            with torch.device("meta"):
                embedding = VocabParallelEmbedding(sub.num_embeddings, sub.embedding_dim, ctx)
            _set(module, name, embedding)
            shards[f"{name}.weight"] = Shard((sub.num_embeddings, sub.embedding_dim), 0, embedding.start,
                                             min(embedding.start + embedding.rows, sub.num_embeddings))
        elif style == "vocab_head":
            assert isinstance(sub, nn.Linear) and sub.bias is None
            tied = getattr(getattr(module, "config", None), "tie_word_embeddings", False)
            with torch.device("meta"):
                head = VocabParallelHead(sub.out_features, sub.in_features, ctx,
                                         weight=embedding.weight if tied and embedding is not None else None)
            _set(module, name, head)
            shards[f"{name}.weight"] = Shard((sub.out_features, sub.in_features), 0, head.start,
                                             min(head.start + head.rows, sub.out_features))
    module.tp = ctx  # marks a sharded module (rebuild_like reads it)
    return shards


def _read(handle: Any, name: str, sh: Shard, local: tuple[int, ...], ctx: DistContext) -> torch.Tensor:
    sl = handle.get_slice(name)
    if sh.rank0_only:
        t = sl[:]
        return t if ctx.tp_rank == 0 else torch.zeros_like(t)
    if sh.dim == 0:
        t = sl[sh.start : sh.stop] if sh.stop > sh.start else sl[0:0]
    else:
        t = sl[:, sh.start : sh.stop]
    if t.shape[0] < local[0]:  # vocabulary padding past the last row
        t = torch.cat([t, t.new_zeros(local[0] - t.shape[0], *t.shape[1:])])
    return t


def load_sharded_into(module: nn.Module, shards: dict[str, Shard], files: list[Path], *, strict: bool,
                      dtype: torch.dtype | None, override_quantization_encoding: bool = False,
                      device: torch.device | str = "cpu", index: dict[str, str] | None = None) -> None:
    """:func:`~specdec.core.checkpoint.load_state_dict_into` for a sharded module:
    each parameter reads only this rank's slice of its tensor."""
    ctx: DistContext = module.tp  # type: ignore[assignment]
    params = dict(module.named_parameters())
    tied_aliases = {n for n, _ in module.named_parameters(remove_duplicate=False)} - set(params)
    loaded: set[str] = set()
    unexpected: list[str] = []
    misshaped: list[str] = []
    pending: dict[str, torch.Tensor] = {}
    for name, file, handle in iter_tensors(files, index):
        if name not in params:
            if name not in tied_aliases:
                unexpected.append(name)
            continue
        p = params[name]
        shape = tuple(handle.get_slice(name).get_shape())
        sh = shards.get(name)
        want = sh.full if sh is not None else tuple(p.shape)
        if shape != want:
            misshaped.append(f"{name} (checkpoint {list(shape)}, model {list(want)})")
            continue
        try:
            t = _read(handle, name, sh, tuple(p.shape), ctx) if sh is not None else handle.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - safetensors raises several kinds
            raise CheckpointError(f"corrupt or truncated safetensors file {file} (tensor {name!r}): {e}") from None
        if not override_quantization_encoding and dtype is not None:
            t = t.to(dtype)
        pending[name] = t.to(device)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    problems = []
    if missing:
        problems.append("missing: " + ", ".join(missing))
    if misshaped:
        problems.append("mis-shaped: " + ", ".join(misshaped))
    if unexpected and strict:
        problems.append("unexpected: " + ", ".join(sorted(unexpected)))
    if problems:
        raise CheckpointError(f"checkpoint {str(files[0].parent)!r} does not fit {type(module).__name__}: "
                              + "; ".join(problems))
    module.load_state_dict(pending, strict=False, assign=True)
    _retie_sharded(module)


def _retie_sharded(module: nn.Module) -> None:
    _retie(module)  # lm_head.weight = embed_tokens.weight when the model ties them


def _real_buffers(module: nn.Module, device: torch.device | str) -> None:
    for mod in module.modules():
        for bname, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_meta:
                mod._buffers[bname] = torch.empty(0, device=device)


def loader(ctx: DistContext) -> Callable[..., nn.Module]:
    """A ``build`` for :func:`~specdec.core.checkpoint.load_decoder`: the rank's shard of the module."""

    def build(module_cls: type[nn.Module], config: Any, path: str | Path, *, dtype: torch.dtype | None = None,
              device: torch.device | str = "cpu") -> nn.Module:
        with torch.device("meta"):
            module = module_cls(config)
        shards = shard_module(module, ctx)
        load_sharded_into(
            module, shards, weight_files(path),
            strict=getattr(module_cls, "strict_state_dict_loading", True),
            dtype=dtype or getattr(config, "dtype", None),
            override_quantization_encoding=getattr(module_cls, "override_quantization_encoding", False),
            device=device, index=weight_map(path),
        )
        _real_buffers(module, device)
        return module.eval()

    return build


def rebuild_like(module: nn.Module) -> nn.Module:
    """``build_module`` for a sharded module: the same split, adopting ``module``'s
    (local) tensors without a copy."""
    ctx: DistContext = module.tp  # type: ignore[assignment]
    with torch.device("meta"):
        built = type(module)(module.config)  # type: ignore[operator]
    shard_module(built, ctx)
    built.load_state_dict(module.state_dict(), strict=True, assign=True)
    device = next(module.parameters()).device
    _real_buffers(built, device)
    _retie_sharded(built)
    return built.eval()
