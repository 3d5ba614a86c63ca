"""Converts pickled PyTorch checkpoints into safetensors directories that specdec loads.

specdec itself never unpickles: a pickle can run code as it loads. Published EAGLE /
EAGLE-3 / Medusa heads and many older Hugging Face checkpoints ship as pickles, so this
converts them once::

    specdec convert SRC DST [--overwrite]     # or: python -m specdec.convert SRC DST

``SRC`` is a directory holding ``pytorch_model.bin``, or shards named by
``pytorch_model.bin.index.json``, or Medusa's ``medusa_lm_head.pt`` (its keys get the
``medusa_head.`` prefix the Medusa loader expects), or one such file. Every file is read
with ``torch.load(weights_only=True)`` only: that unpickler builds tensors, dicts and plain
values and refuses anything else, so a file that would run code fails, naming the file,
and is not loaded. ``DST`` gets ``model.safetensors`` (shards plus
``model.safetensors.index.json`` above ``max_shard_bytes``), the tensors bit for bit in
their stored dtypes, and the text files beside the weights (config.json, tokenizer and
generation files; never another pickle). It is written in a sibling directory and renamed
into place; a non-empty ``DST`` is replaced only with ``overwrite``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.core.checkpoint import CheckpointError
from specdec.core.staging import staged_replace

BIN_INDEX = "pytorch_model.bin.index.json"
BIN = "pytorch_model.bin"
MEDUSA_LEGACY = "medusa_lm_head.pt"  # FasterDecoding/Medusa: the heads' state dict, keys without "medusa_head."
# Text files a checkpoint directory carries beside its weights; copied as they are.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
              "chat_template.jinja", "chat_template.json", "README.md", "LICENSE")
MAX_SHARD_BYTES = 5_000_000_000  # Hugging Face's default shard size ("5GB")


class ConvertError(CheckpointError):
    """A checkpoint that cannot be converted, or a destination that cannot be written (names it)."""


@dataclass
class Converted:
    """What :func:`convert_checkpoint` wrote."""

    dst: Path
    weight_files: list[str]
    tensors: int
    total_bytes: int
    copied: list[str] = field(default_factory=list)  # side files
    untied: list[str] = field(default_factory=list)  # names dropped as aliases of a tied tensor


# -- reading -----------------------------------------------------------------------------------
def _inputs(src: Path) -> tuple[list[Path], dict[str, str] | None, Path]:
    """The pickled files to read, the shard index's weight map (None: no index), the directory
    whose side files go along."""
    if src.is_file():
        return [src], None, src.parent
    if not src.is_dir():
        raise ConvertError(f"{str(src)!r} does not exist")
    index = src / BIN_INDEX
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConvertError(f"{index} is not a valid shard index: {e!r}") from None
        if not isinstance(wm, dict) or not all(isinstance(v, str) and Path(v).name == v for v in wm.values()):
            raise ConvertError(f"{index}: 'weight_map' must map tensor names to shard file names in {src}")
        files = [src / f for f in sorted(set(wm.values()))]
        for f in files:
            if not f.is_file():
                raise ConvertError(f"shard {f.name} named in {index} is missing")
        return files, wm, src
    for name in (BIN, MEDUSA_LEGACY):
        if (src / name).is_file():
            return [src / name], None, src
    found = sorted(p.name for p in src.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    hint = f" (it holds {', '.join(found)}; pass one of them as SRC to convert that file)" if found else ""
    raise ConvertError(f"no {BIN}, {BIN_INDEX} or {MEDUSA_LEGACY} in {str(src)!r}{hint}")


def _weights_only_reason(e: pickle.UnpicklingError) -> str:
    """torch's refusal without its boilerplate (which suggests weights_only=False: never here)."""
    parts = [p.strip() for p in str(e).split("\n\n")]
    kept = [p for p in parts if p and not p.startswith(("Weights only load failed", "Check the documentation"))]
    return " ".join(kept) or str(e)


def load_tensors(f: Path) -> dict[str, torch.Tensor]:
    """The state dict pickled in ``f``, read with ``torch.load(weights_only=True)`` (memory-mapped
    when the file is in torch's zip format): a dict of names to tensors, or a :class:`ConvertError`."""
    try:
        sd = torch.load(f, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(f))
    except pickle.UnpicklingError as e:
        reason = _weights_only_reason(e)
        if "GLOBAL" in reason:  # the pickle names a function or class: what a planted payload does
            why = f"it names Python objects beyond tensors and plain values ({reason}); unpickling them could run code"
        else:
            why = f"torch.load(weights_only=True) cannot read it ({reason}): corrupt, or not a torch checkpoint"
        raise ConvertError(f"{f}: refused, not loaded: {why}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ConvertError(f"{f}: not a readable torch checkpoint (corrupt or truncated?): "
                           f"{type(e).__name__}: {e}") from None
    if not isinstance(sd, dict):
        raise ConvertError(f"{f}: holds a {type(sd).__name__}, not a state dict (a dict of tensor names to tensors)")
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if not isinstance(k, str):
            raise ConvertError(f"{f}: key {k!r} is a {type(k).__name__}; a state dict's keys are tensor names")
        if not isinstance(v, torch.Tensor):
            what = ("a nested dict (a training checkpoint? convert its model state dict)" if isinstance(v, dict)
                    else f"{type(v).__name__} {repr(v)[:40]}")
            raise ConvertError(f"{f}: {k!r} holds {what}, not a tensor")
        if v.layout != torch.strided or v.is_quantized:
            raise ConvertError(f"{f}: tensor {k!r} is {'quantized' if v.is_quantized else v.layout}; "
                               "only dense tensors convert")
        out[k] = v.detach()
    if not out:
        raise ConvertError(f"{f}: holds no tensors")
    return out


def _state(files: list[Path], index: dict[str, str] | None) -> dict[str, torch.Tensor]:
    """Every file's tensors in one dict; a name in two files, or in a file its index does not
    map it to, or named by the index and stored nowhere, is an error."""
    state: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for f in files:
        sd = load_tensors(f)
        if f.name == MEDUSA_LEGACY:  # Medusa loads it into model.medusa_head (strict=False)
            sd = {k if k.startswith("medusa_head.") else f"medusa_head.{k}": v for k, v in sd.items()}
        for k, v in sd.items():
            if k in state:
                raise ConvertError(f"tensor {k!r} is stored twice, in {where[k]} and in {f}")
            if index is not None and index.get(k, f.name) != f.name:
                raise ConvertError(f"tensor {k!r} is in {f}, but {f.parent / BIN_INDEX} maps it to {index[k]}")
            state[k], where[k] = v, f
    if index is not None:
        missing = sorted(set(index) - set(state))
        if missing:
            shown = ", ".join(missing[:10]) + (f", ... ({len(missing)} in all)" if len(missing) > 10 else "")
            raise ConvertError(f"{files[0].parent / BIN_INDEX} names tensors none of its shards holds: {shown}")
    return state


def _unshare(state: dict[str, torch.Tensor], config: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """safetensors stores no shared memory. A tied output head (``lm_head.weight`` sharing
    ``model.embed_tokens.weight``'s storage under ``tie_word_embeddings: true``) is dropped, as
    Hugging Face saves it (the loader ties it again); any other tensor sharing storage (Medusa's
    repeated block), not contiguous, or a view of a larger storage is copied."""
    untied: list[str] = []
    emb, head = state.get("model.embed_tokens.weight"), state.get("lm_head.weight")
    if (config.get("tie_word_embeddings") is True and emb is not None and head is not None
            and head.untyped_storage().data_ptr() == emb.untyped_storage().data_ptr() and torch.equal(head, emb)):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        untied.append("lm_head.weight")
    owners: dict[int, str] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        ptr = v.untyped_storage().data_ptr()
        shared = v.numel() > 0 and ptr in owners
        whole = v.is_contiguous() and v.storage_offset() == 0 and v.untyped_storage().nbytes() == v.nbytes
        out[k] = v.contiguous().clone() if shared or not whole else v
        owners.setdefault(ptr, k)
    return out, untied


# -- writing -----------------------------------------------------------------------------------
def _check_dst(dst: Path, src: Path, overwrite: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise ConvertError(f"destination {dst} is a file, not a directory")
    if dst.resolve() == src.resolve() or dst.resolve() in src.resolve().parents:
        raise ConvertError(f"destination {dst} holds the source {src}; choose another directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        names = sorted(p.name for p in dst.iterdir())
        shown = ", ".join(names[:4]) + (", …" if len(names) > 4 else "")
        raise ConvertError(f"destination {dst} is not empty ({shown}); pass --overwrite (overwrite=True) to "
                           "replace it whole, or choose another directory")


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names in order, cut into groups of at most ``max_bytes`` (a bigger tensor goes alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for k, v in state.items():
        if groups[-1] and size + v.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += v.nbytes
    return groups


def convert_checkpoint(src: str | Path, dst: str | Path, *, overwrite: bool = False,
                       max_shard_bytes: int = MAX_SHARD_BYTES) -> Converted:
    """Writes the pickled checkpoint at ``src`` (see the module doc) as a safetensors
    directory ``dst``; raises :class:`ConvertError` naming the file, tensor or directory at fault."""
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    files, index, side_dir = _inputs(src)
    _check_dst(dst, src, overwrite)  # before reading gigabytes
    config: dict[str, Any] = {}
    if (side_dir / "config.json").is_file():
        try:
            config = json.loads((side_dir / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise ConvertError(f"{side_dir / 'config.json'} is not valid JSON: {e}") from None
    state, untied = _unshare(_state(files, index), config if isinstance(config, dict) else {})
    groups = _shards(state, max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    total = sum(v.nbytes for v in state.values())
    copied = [n for n in SIDE_FILES if (side_dir / n).is_file()]
    with staged_replace(dst, lambda: _check_dst(dst, src, overwrite)) as tmp:
        for name, group in zip(names, groups):
            try:
                save_file({k: state[k] for k in group}, str(tmp / name), metadata={"format": "pt"})
            except (ValueError, RuntimeError, TypeError) as e:
                raise ConvertError(f"{src}: cannot write its tensors {group[0]!r}… as safetensors: {e}") from None
        if len(groups) > 1:
            wm = {k: name for name, group in zip(names, groups) for k in group}
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2) + "\n")
        for n in copied:
            shutil.copyfile(side_dir / n, tmp / n)
    return Converted(dst=dst, weight_files=names, tensors=len(state), total_bytes=total, copied=copied,
                     untied=untied)


# -- command line ------------------------------------------------------------------------------
def _size(text: str) -> int:
    units = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "b": 1, "": 1}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    try:
        n = int(float(num) * units[t[len(num):]])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r}")
    return n


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specdec.convert SRC DST [--overwrite] [--max-shard-size 5GB]``: exit 0, or 2
    with ``specdec convert: error: ...`` on stderr."""
    p = argparse.ArgumentParser(prog="specdec convert", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help=f"directory with {BIN} / {BIN_INDEX} / {MEDUSA_LEGACY}, or one such file")
    p.add_argument("dst", help="new directory for the safetensors checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty DST whole")
    p.add_argument("--max-shard-size", type=_size, default=MAX_SHARD_BYTES, help="shard above this (default 5GB)")
    args = p.parse_args(argv)
    try:
        r = convert_checkpoint(args.src, args.dst, overwrite=args.overwrite, max_shard_bytes=args.max_shard_size)
    except CheckpointError as e:
        print(f"specdec convert: error: {e}", file=sys.stderr)
        return 2
    extra = f"; {', '.join(r.untied)} tied to the embedding, not stored" if r.untied else ""
    print(f"wrote {r.dst}: {r.tensors} tensors, {r.total_bytes / 1e6:.1f} MB in {', '.join(r.weight_files)}"
          f"; copied {', '.join(r.copied) or 'no side files'}{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
