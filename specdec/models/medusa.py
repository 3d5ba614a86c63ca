"""Medusa heads: K parallel heads over the target's last (final-norm) hidden state.

Head ``i`` (``i = 0..K-1``) maps the target's final-norm hidden state ``h_t``
at position ``t`` to logits for the token at ``t + 2 + i`` (the target's own
lm_head gives ``t + 1``)::

    y = h_t
    repeat L_m times:  y = y + SiLU(W_i y + b_i)      one ResBlock per head, applied L_m times
    logits_i = lm_head_i(y)                           own [V, H] head, or the target's lm_head

As published (FasterDecoding/Medusa ``medusa_model.py``), a head is
``Sequential(*[ResBlock(H)] * L_m, Linear(H, V, bias=False))``: the list
multiplication repeats **one** block module, so the ``L_m`` blocks of a head
share their weights; this module is built the same way.

Two published layouts load (``load_medusa``, or ``load_decoder(path,
role=Role.MEDUSA_HEAD)`` when ``config.json`` names ``"architectures":
["MedusaModel"]``):

- **Medusa-1** (own lm head per head): tensors ``medusa_head.{i}.{j}.linear.weight
  [H, H]`` and ``.bias [H]`` for ``j < L_m`` (one copy or all ``L_m`` equal copies
  of the shared block), and ``medusa_head.{i}.{L_m}.weight [V, H]``;
- **Medusa-2 format** (``"version": "2"`` in ``config.json``, FasterDecoding/Medusa
  2b8020f): the same blocks and no ``medusa_head.{i}.{L_m}.weight``: every head
  uses the target's lm_head (borrowed by reference, :meth:`MedusaHeads.attach_target`).
  Without a ``version`` key the layout is read off the tensors (lm head weights
  present or not).

``config.json``: ``medusa_num_heads``, ``medusa_num_layers`` (as published);
optional ``hidden_size`` / ``vocab_size`` (published configs leave them to the
base model: they are then read off the tensors' shapes) and ``torch_dtype``.
A head whose hidden size or vocabulary does not match its target fails before
any weight is read, naming the mismatch (:func:`check_medusa_fits`).

On our float32 CPU kernels (packed by ``pack_layers``) the heads' backend is native
(:mod:`specdec.core.backend`): every head's blocks and logits are one C++ call
(``specdec_cpu::medusa_forward``), the eager forward's bits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.core.backend import backend_of, forget_backend
from specdec.core.linear import Linear
from specdec.core.registry import DecoderModule, Role, register
from specdec.models.config import MAX_SIZES, short_repr

MEDUSA_ARCH = "MedusaModel"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MedusaHeadConfig:
    """Shapes of a set of Medusa heads (``0`` sizes: not known yet, see :func:`resolve_config`)."""

    num_heads: int  # K
    num_layers: int = 1  # L_m ResBlock applications per head (one shared block)
    hidden_size: int = 0
    vocab_size: int = 0
    shared_lm_head: bool = False  # True: the heads use the target's lm_head (Medusa-2 format)
    torch_dtype: str = "float32"
    base_model_name_or_path: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.num_heads <= 64:
            raise ValueError(f"medusa_num_heads must be in [1, 64], got {self.num_heads}")
        if not 1 <= self.num_layers <= 64:
            raise ValueError(f"medusa_num_layers must be in [1, 64], got {self.num_layers}")
        if self.torch_dtype not in _DTYPES:
            raise ValueError(f"torch_dtype {self.torch_dtype!r} not in {sorted(_DTYPES)}")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MedusaHeadConfig:
        """Parses a Medusa ``config.json``."""
        if "medusa_num_heads" not in d:
            raise ValueError("a Medusa config.json needs 'medusa_num_heads'")
        for k, hi in (("medusa_num_heads", 64), ("medusa_num_layers", 64), ("hidden_size", MAX_SIZES["hidden_size"]),
                      ("vocab_size", MAX_SIZES["vocab_size"])):
            v = d.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi):
                raise ValueError(f"config.{k} must be an integer in [0, {hi}], got {short_repr(v)}")
        version = str(d.get("version", "")) or None
        if version not in (None, "1", "2"):
            raise ValueError(f"unknown Medusa format version {d.get('version')!r} (known: '1', '2')")
        dtype = d.get("torch_dtype") or "float32"
        return cls(num_heads=int(d["medusa_num_heads"]), num_layers=int(d.get("medusa_num_layers", 1)),
                   hidden_size=int(d.get("hidden_size") or 0), vocab_size=int(d.get("vocab_size") or 0),
                   shared_lm_head=version == "2",
                   torch_dtype=dtype if dtype in _DTYPES else "float32",
                   base_model_name_or_path=str(d.get("base_model_name_or_path") or ""))

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` of these heads (explicit sizes, architecture and format version)."""
        d: dict[str, Any] = {
            "architectures": [MEDUSA_ARCH],
            "model_type": "medusa",
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "torch_dtype": self.torch_dtype,
        }
        if self.base_model_name_or_path:
            d["base_model_name_or_path"] = self.base_model_name_or_path
        d["version"] = "2" if self.shared_lm_head else "1"
        return d


class ResBlock(nn.Module):
    """``y = x + SiLU(W x + b)`` (Medusa's residual block)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


@register(Role.MEDUSA_HEAD, MEDUSA_ARCH)
class MedusaHeads(DecoderModule):
    """K Medusa heads; ``forward(h [..., H]) -> logits [..., K, V]``."""

    config_cls = MedusaHeadConfig
    native_kind = "medusa"  # its native backend runs specdec_cpu::medusa_forward

    def __init__(self, config: MedusaHeadConfig) -> None:
        super().__init__()
        if not (config.hidden_size and config.vocab_size):
            raise ValueError("MedusaHeads needs hidden_size and vocab_size (resolve_config fills them in)")
        self.config = config
        h, v = config.hidden_size, config.vocab_size
        heads = []
        for _ in range(config.num_heads):
            block = ResBlock(h)
            mods: list[nn.Module] = [block] * config.num_layers  # one module, applied L_m times (as published)
            if not config.shared_lm_head:
                mods.append(Linear(h, v, bias=False))
            heads.append(nn.Sequential(*mods))
        self.medusa_head = nn.ModuleList(heads)
        self.__dict__["_lm_head"] = None  # the target's lm_head (shared layout): not a parameter of the heads

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def attach_target(self, lm_head: nn.Module) -> None:
        """Borrows the target's lm_head (the same tensor, not a copy); the shared layout needs it."""
        self.__dict__["_lm_head"] = lm_head
        forget_backend(self)  # (its native operands include it)

    def native_operands(self) -> tuple[Any, ...] | None:
        """The heads' operands of ``specdec_cpu::medusa_forward`` (each head's block weight and
        bias, the blocks a head applies, its lm head, or the one shared, and the vocabulary),
        or None where it does not serve: a block or lm head not packed for our kernels, or a
        shared lm head with a bias or not attached."""
        blocks = [self.block(i).linear for i in range(self.num_heads)]
        if self.config.shared_lm_head:
            heads = [self._lm_head] if self._lm_head is not None else []
        else:
            heads = [self.medusa_head[i][-1] for i in range(self.num_heads)]  # type: ignore[index]
        lins = blocks + heads
        if not heads or not all(isinstance(m, Linear) and m.kernel == "specdec" for m in lins) or any(
                h.bias is not None for h in heads):
            return None
        return ([b.packed for b in blocks], [b.bias for b in blocks], self.config.num_layers,
                [h.packed for h in heads], heads[0].out_features)

    def block(self, i: int) -> ResBlock:
        return self.medusa_head[i][0]  # type: ignore[index,return-value]

    def features(self, hidden: torch.Tensor, num: int | None = None) -> torch.Tensor:
        """Each head's output before its lm head: ``hidden [..., H] -> [..., k, H]`` (the first ``num``)."""
        k = self.num_heads if num is None else min(num, self.num_heads)
        x = hidden.to(self.block(0).linear.weight.dtype)
        out = []
        for i in range(k):
            blk, y = self.block(i), x
            for _ in range(self.config.num_layers):
                y = blk(y)
            out.append(y)
        return torch.stack(out, -2)

    def logits_of(self, i: int, y: torch.Tensor) -> torch.Tensor:
        """Head ``i``'s lm head on its features ``y [..., H]`` -> ``[..., V]``."""
        if self.config.shared_lm_head:
            if self._lm_head is None:
                raise RuntimeError("Medusa heads sharing the target's lm_head: attach_target(lm_head) first")
            return self._lm_head(y)
        return self.medusa_head[i][-1](y)  # type: ignore[index]

    def head_logits(self, y: torch.Tensor) -> torch.Tensor:
        """``y [..., k, H]`` (the first ``k`` heads' features) -> logits ``[..., k, V]``."""
        if self.config.shared_lm_head:
            return self.logits_of(0, y)
        return torch.stack([self.logits_of(i, y[..., i, :]) for i in range(y.shape[-2])], -2)

    def forward(self, hidden: torch.Tensor, num: int | None = None) -> torch.Tensor:
        """Logits of the first ``num`` heads (all: None), ``[..., k, V]``: head ``i`` for ``t + 2 + i``.
        Native (module doc): one C++ call, the Python's bits."""
        k = self.num_heads if num is None else min(num, self.num_heads)
        if hidden.dtype == torch.float32 and k > 0 and not torch.is_grad_enabled():
            out = backend_of(self).medusa_heads(hidden.reshape(-1, hidden.shape[-1]), k)
            if out is not None:
                return out.view(*hidden.shape[:-1], k, out.shape[-1])
        return self.head_logits(self.features(hidden, num))


# -- loading ------------------------------------------------------------------------------------
def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from specdec.core.checkpoint import iter_tensors, weight_files, weight_map

    return {name: tuple(h.get_slice(name).get_shape())
            for name, _, h in iter_tensors(weight_files(path), weight_map(path))}


def resolve_config(config: MedusaHeadConfig, path: str | Path, *, hf: dict[str, Any] | None = None,
                   shapes: dict[str, tuple[int, ...]] | None = None) -> MedusaHeadConfig:
    """Fills in what a published ``config.json`` leaves out, from the tensors' shapes:
    ``hidden_size`` (``medusa_head.0.0.linear.weight``), ``vocab_size`` (a head's own lm
    head), and the layout when the config has no ``version``."""
    shapes = _tensor_shapes(Path(path)) if shapes is None else shapes
    lm_key = f"medusa_head.0.{config.num_layers}.weight"
    shared = config.shared_lm_head
    if hf is not None and "version" not in hf:
        shared = lm_key not in shapes
    h = config.hidden_size
    if not h and "medusa_head.0.0.linear.weight" in shapes:
        h = shapes["medusa_head.0.0.linear.weight"][1]
    v = config.vocab_size
    if not v and not shared and lm_key in shapes:
        v = shapes[lm_key][0]
    return replace(config, hidden_size=h, vocab_size=v, shared_lm_head=shared)


def check_medusa_fits(config: MedusaHeadConfig, target: Any, where: str) -> None:
    """Raises ``ValueError`` naming the mismatch when the heads cannot serve ``target`` (a LlamaConfig)."""
    problems = []
    if config.hidden_size and config.hidden_size != target.hidden_size:
        problems.append(f"its hidden_size is {config.hidden_size}, the target's {target.hidden_size}")
    if config.vocab_size and config.vocab_size != target.vocab_size:
        problems.append(f"its vocab_size is {config.vocab_size}, the target's {target.vocab_size}")
    if problems:
        raise ValueError(f"Medusa heads {where} do not fit the target: " + "; ".join(problems))


def _check_shared_blocks(module: MedusaHeads, path: Path) -> None:
    """A file storing each of the L_m block applications must store the same weights
    (published heads share one block); distinct ones would be silently dropped."""
    n = module.config.num_layers
    if n == 1:
        return
    from specdec.core.checkpoint import CheckpointError, iter_tensors, weight_files, weight_map

    for name, _, h in iter_tensors(weight_files(path), weight_map(path)):
        parts = name.split(".")
        if len(parts) == 5 and parts[0] == "medusa_head" and parts[3] == "linear" and parts[2] != "0":
            i = int(parts[1])
            ref = getattr(module.block(i).linear, parts[4])
            if not torch.equal(h.get_tensor(name).to(ref.dtype).to(ref.device), ref.detach()):
                raise CheckpointError(f"checkpoint {str(path)!r}: {name} differs from medusa_head.{i}.0.linear."
                                      f"{parts[4]}; Medusa heads repeat one shared block (medusa_num_layers={n})")


def load_medusa(path: str | Path, *, target: Any = None, dtype: torch.dtype | None = None,
                device: torch.device | str = "cpu") -> MedusaHeads:
    """Loads Medusa heads in either published layout; ``target`` (a LlamaConfig) fills in
    sizes the checkpoint does not state and is checked against them before any weight is read.

    A ``config.json`` without ``architectures`` (as published) is read as ``MedusaModel``.
    """
    from specdec.core.checkpoint import CheckpointError, load_graph_api_module, read_hf_config
    from specdec.core.registry import lookup

    path = Path(path)
    hf = read_hf_config(path)
    archs = hf.get("architectures") or [MEDUSA_ARCH]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{path / 'config.json'}: 'architectures' must be a list of class names")
    try:
        cls = lookup(archs[0], Role.MEDUSA_HEAD)
    except KeyError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e.args[0]}") from None
    try:
        config = cls.config_cls.from_dict(hf)  # type: ignore[attr-defined]
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    config = resolve_config(config, path, hf=hf)
    if target is not None:
        check_medusa_fits(config, target, repr(str(path)))
        config = replace(config, hidden_size=config.hidden_size or target.hidden_size,
                         vocab_size=config.vocab_size or target.vocab_size)
    if not (config.hidden_size and config.vocab_size):
        raise CheckpointError(f"{path}: cannot tell the heads' hidden_size / vocab_size; state them in "
                              "config.json or load with the target")
    module = load_graph_api_module(cls, config, path, dtype=dtype, device=device)
    _check_shared_blocks(module, path)  # type: ignore[arg-type]
    return module  # type: ignore[return-value]


# -- creating and saving --------------------------------------------------------------------------
def new_medusa(config: MedusaHeadConfig, lm_head: torch.Tensor | None = None, seed: int = 0) -> MedusaHeads:
    """Fresh heads (fp32) as Medusa initialises them: block weights zero (each block starts
    as the identity), bias zero; an own lm head starts as a copy of ``lm_head`` [V, H] when given."""
    heads = MedusaHeads(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i in range(config.num_heads):
            heads.block(i).linear.weight.zero_()
            heads.block(i).linear.bias.zero_()
            if not config.shared_lm_head:
                w = heads.medusa_head[i][-1].weight  # type: ignore[index]
                if lm_head is not None:
                    w.copy_(lm_head)
                else:
                    w.normal_(0.0, 0.02, generator=g)
    return heads


def medusa_state_dict(heads: MedusaHeads, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The published tensors: ``medusa_head.{i}.0.linear.*`` (the shared block, stored once)
    and, Medusa-1, ``medusa_head.{i}.{L_m}.weight``; floating weights in ``dtype``."""
    out = {}
    for k, v in heads.named_parameters():  # shared blocks appear once
        out[k] = v.detach().to(dtype).contiguous()
    return out


def save_medusa(heads: MedusaHeads, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
                dtype: torch.dtype = torch.bfloat16) -> list[Path]:
    """Writes ``config.json`` + ``model.safetensors`` (bf16 by default)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = {v: k for k, v in _DTYPES.items()}[dtype]
    cfg = replace(heads.config, torch_dtype=name).to_hf_dict()
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(medusa_state_dict(heads, dtype), str(out / "model.safetensors"))
    files = [out / "config.json", out / "model.safetensors"]
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
        import shutil

        shutil.copy(Path(tokenizer_dir) / "tokenizer.json", out / "tokenizer.json")
        files.append(out / "tokenizer.json")
    return files


__all__ = ["MEDUSA_ARCH", "MedusaHeadConfig", "MedusaHeads", "ResBlock", "check_medusa_fits", "load_medusa",
           "new_medusa", "resolve_config", "save_medusa"]
