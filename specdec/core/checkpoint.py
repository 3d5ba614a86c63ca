"""Loading checkpoints: Hugging Face directories (config.json, safetensors, tokenizer.json)
and single ``.gguf`` files (llama.cpp's format, through :mod:`specdec.core.gguf`).

:func:`load_graph_api_module` constructs a registered module as
``module_cls(config)`` with no storage (``meta`` device), then fills it one
tensor at a time straight from the safetensors files, so a checkpoint never
sits in memory twice.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec.core.registry import Role, lookup


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be loaded (names the culprit)."""


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of the checkpoint directory ``path``."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    if not cfg_file.is_file():
        raise CheckpointError(f"missing config.json in checkpoint directory {str(path)!r}")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{cfg_file} must hold a JSON object of model settings, got {json.dumps(hf)[:80]}")
    return hf


def weight_map(path: str | Path) -> dict[str, str] | None:
    """The index's ``weight_map`` (tensor name -> shard file name) of a sharded
    checkpoint; None for a single ``model.safetensors``."""
    index = Path(path) / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        wm = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
    return wm


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: one file, or the shards an index names."""
    path = Path(path)
    wm = weight_map(path)
    if wm is not None:
        index = path / "model.safetensors.index.json"
        files = [path / f for f in sorted(set(wm.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"shard {f.name} named in {index} is missing")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    pickled = [n for n in ("pytorch_model.bin.index.json", "pytorch_model.bin", "medusa_lm_head.pt")
               if (path / n).is_file()]
    hint = (f"; it holds {pickled[0]}: pickled weights, which specdec never loads (a pickle can run code); "
            f"convert them once with `python -m specdec.convert {path} <new dir>` (reads tensors only) "
            "and load <new dir>" if pickled else "")
    raise CheckpointError(
        f"no model.safetensors or model.safetensors.index.json in {str(path)!r}{hint}"
    )


def iter_tensors(files: list[Path], index: dict[str, str] | None = None) -> Iterator[tuple[str, Path, Any]]:
    """Yields ``(name, file, handle)`` for every tensor, one open file at a time.

    A name stored in two files, or in another file than the one ``index`` (the
    ``weight_map``) names, is an error: otherwise the last file read would win
    silently, whatever the index says.
    """
    from safetensors import SafetensorError, safe_open

    seen: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    if name in seen:
                        raise CheckpointError(f"tensor {name!r} is stored twice, in {seen[name]} and in {f}")
                    if index is not None and index.get(name, f.name) != f.name:
                        raise CheckpointError(f"tensor {name!r} is in {f}, but "
                                              f"{f.parent / 'model.safetensors.index.json'} maps it to {index[name]}")
                    seen[name] = f
                    yield name, f, h
        except SafetensorError as e:
            raise CheckpointError(f"corrupt or truncated safetensors file {f}: {e}") from None


def _listed(names: list[str], limit: int = 20) -> str:
    """``names`` joined, the first ``limit`` of them (a wrong config can miss millions)."""
    head = ", ".join(names[:limit])
    return head if len(names) <= limit else f"{head}, ... and {len(names) - limit} more ({len(names)} in all)"


def _header(f: Path) -> tuple[int, dict[str, Any]]:
    """The parsed JSON header of safetensors file ``f`` and where its data starts
    (raises OSError / ValueError on a header that cannot be read)."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if not 0 < n <= 1 << 28:
            raise ValueError(f"header length {n}")
        header = json.loads(fh.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return 8 + n, header


def stored_elements(files: list[Path]) -> int | None:
    """Elements of every tensor the safetensors ``files`` hold, read off their headers only
    (None: a header that cannot be read; the load then names the fault)."""
    total = 0
    for f in files:
        try:
            _, header = _header(f)
            for name, entry in header.items():
                if name != "__metadata__":
                    size = 1
                    for d in entry["shape"]:
                        size *= int(d)
                    total += size
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return total


def check_sizes_backed(config: Any, path: Path) -> None:
    """Raises :class:`CheckpointError` when ``config``'s sizes imply more weights than the
    checkpoint's files hold (``config.min_weight_elements()``, a lower bound), before a
    module is built: a mistyped ``num_hidden_layers`` fails now, not after building it."""
    need = getattr(config, "min_weight_elements", None)
    if need is None:
        return
    need = need()
    try:
        have = open_gguf(path).element_count() if is_gguf(path) else stored_elements(weight_files(path))
    except CheckpointError:
        return  # (the load names what is missing)
    if have is not None and need > have:
        sizes = ", ".join(f"{k}={getattr(config, k)}" for k in ("num_hidden_layers", "hidden_size",
                          "intermediate_size", "vocab_size") if isinstance(getattr(config, k, None), int))
        where = path if is_gguf(path) else path / "config.json"
        raise CheckpointError(f"{where}: its sizes ({sizes}) need at least {need:,} weights, but the "
                              f"checkpoint's files hold {have:,}: config.json does not describe these weights")


# safetensors dtype codes of floating-point tensors
_FLOAT_CODES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


_TORCH_TYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_CHUNK_BYTES = 4 << 20  # bytes converted at a time (see _get)


class _PlainReads:
    """Reads a safetensors file's tensors with plain reads at the offsets its header gives,
    for those converted as read: through the file's map, the stored pages would count in
    the process's resident memory while it is open (half the float32 weights again for a
    bf16 checkpoint loaded as float32), beside the converted copy."""

    def __init__(self, file: Path) -> None:
        self.file, self.fh = file, None
        self.spans: dict[str, tuple[int, int]] = {}  # (none: safetensors reads each, and names a fault)
        try:
            start, header = _header(file)
            self.spans = {k: (start + int(v["data_offsets"][0]), start + int(v["data_offsets"][1]))
                          for k, v in header.items() if k != "__metadata__"}
            self.fh = open(file, "rb", buffering=0)
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            self.spans = {}

    def read_into(self, name: str, at: int, out: torch.Tensor) -> None:
        """Fills ``out`` (contiguous) with the bytes of tensor ``name`` from byte ``at`` on."""
        buf = memoryview(out.view(-1).view(torch.uint8).numpy())
        self.fh.seek(self.spans[name][0] + at)
        done = 0
        while done < len(buf):
            n = self.fh.readinto(buf[done:])
            if not n:
                raise CheckpointError(f"truncated safetensors file {self.file}: tensor {name!r} ends past its end")
            done += n

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


def _get(handle: Any, name: str, file: Path, dtype: torch.dtype | None = None,
         reads: _PlainReads | None = None) -> torch.Tensor:
    """Tensor ``name`` as stored (a copy-on-write map of the file: its pages are the weight,
    read as used), or converted to ``dtype`` a few MiB of rows at a time, read by ``reads``,
    into the one tensor returned: no whole stored-type copy, nor the file's pages, beside it."""
    from safetensors import SafetensorError

    try:
        sl = handle.get_slice(name)
        shape = [int(d) for d in sl.get_shape()]
        stored = _TORCH_TYPES.get(str(sl.get_dtype()).upper())
        numel = 1
        for d in shape:
            numel *= d
        span = reads.spans.get(name) if reads is not None else None
        if (dtype is None or dtype == stored or stored is None or span is None
                or span[1] - span[0] != numel * stored.itemsize or sys.byteorder != "little"):
            t = handle.get_tensor(name)
            return t if dtype is None else t.to(dtype)
        out = torch.empty(shape, dtype=dtype)
        if numel == 0:
            return out
        rows = out.view(shape[0] if shape else 1, -1)
        step = max(1, _CHUNK_BYTES // max(1, rows.shape[1] * out.element_size()))
        buf = torch.empty(min(step, rows.shape[0]), rows.shape[1], dtype=stored)
        for i in range(0, rows.shape[0], step):
            part = buf[: min(step, rows.shape[0] - i)]
            reads.read_into(name, i * rows.shape[1] * stored.itemsize, part)
            rows[i : i + len(part)].copy_(part)
        return out
    except (SafetensorError, RuntimeError, OSError) as e:
        raise CheckpointError(f"corrupt or truncated safetensors file {file} (tensor {name!r}): {e}") from None


def load_state_dict_into(
    module: nn.Module,
    files: list[Path],
    *,
    strict: bool,
    dtype: torch.dtype | None,
    override_quantization_encoding: bool = False,
    device: torch.device | str = "cpu",
    index: dict[str, str] | None = None,
) -> None:
    """Fills ``module``'s parameters from safetensors ``files``, tensor by tensor.

    ``module`` may live on the ``meta`` device: each parameter gets storage as
    it is read. Errors list every missing, unexpected and mis-shaped tensor by
    name, in one message. ``override_quantization_encoding``: keep each
    tensor's checkpoint dtype; otherwise cast to ``dtype`` (the declared one).
    ``index``: the sharded checkpoint's ``weight_map`` (see :func:`iter_tensors`).
    """
    def entries() -> Iterator[tuple[str, Path, tuple[int, ...], str, bool, Callable[[], torch.Tensor]]]:
        reads: _PlainReads | None = None
        try:
            for name, file, handle in iter_tensors(files, index):
                if reads is None or reads.file != file:
                    if reads is not None:
                        reads.close()
                    reads = _PlainReads(file)
                sl = handle.get_slice(name)
                code = str(sl.get_dtype()).upper()
                yield (name, file, tuple(sl.get_shape()), code, code in _FLOAT_CODES,
                       lambda dtype=None, handle=handle, name=name, file=file, reads=reads:
                       _get(handle, name, file, dtype, reads))
        finally:
            if reads is not None:
                reads.close()

    fill_module(module, entries(), where=files[0].parent, strict=strict, dtype=dtype,
                override_quantization_encoding=override_quantization_encoding, device=device)


def fill_module(
    module: nn.Module,
    entries: Iterator[tuple[str, Path, tuple[int, ...], str, bool, Callable[[], torch.Tensor]]],
    *,
    where: Path,
    strict: bool,
    dtype: torch.dtype | None,
    override_quantization_encoding: bool = False,
    device: torch.device | str = "cpu",
) -> None:
    """Fills ``module`` from ``entries``: ``(name, file, shape, stored type, is_float, load)``
    per stored tensor, ``load(dtype)`` reading it (as ``dtype``; None: as stored) only when
    the module has a place of that shape for it (see :func:`load_state_dict_into`; ``where``
    names the checkpoint). One tensor at a time, straight into the storage the module keeps."""
    params = dict(module.named_parameters())  # tied weights appear once
    tied_aliases = {n for n, _ in module.named_parameters(remove_duplicate=False)} - set(params)
    # Persistent buffers are weights too (an EAGLE-3 head's d2t / t2d vocabulary maps).
    params.update((n, b) for n, b in module.state_dict(keep_vars=True).items()
                  if n not in params and n not in tied_aliases)
    loaded: set[str] = set()
    unexpected: list[str] = []
    misshaped: list[str] = []
    pending: dict[str, torch.Tensor] = {}
    for name, file, shape, code, is_float, load in entries:
        if name not in params:
            if name not in tied_aliases:
                unexpected.append(name)
            continue
        p = params[name]
        if shape != tuple(p.shape):
            misshaped.append(f"{name} (checkpoint {list(shape)}, model {list(p.shape)})")
            continue
        if not override_quantization_encoding and p.is_floating_point() != is_float:
            want = "floating-point" if p.is_floating_point() else f"{p.dtype} (integer)"
            raise CheckpointError(f"{file}: tensor {name!r} is stored as {code}; {type(module).__name__} needs "
                                  f"a {want} tensor there")
        # (integer and boolean tables keep their type)
        t = load(dtype if not override_quantization_encoding and dtype is not None and is_float else None)
        pending[name] = t.to(device)
        del t  # (on another device: the host copy goes now, not at the next tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    problems = []
    if missing:
        problems.append("missing: " + _listed(missing))
    if misshaped:
        problems.append("mis-shaped: " + _listed(misshaped))
    if unexpected and strict:
        problems.append("unexpected: " + _listed(sorted(unexpected)))
    if problems:
        raise CheckpointError(f"checkpoint {str(where)!r} does not fit {type(module).__name__}: " + "; ".join(problems))
    # assign=True hands over the loaded tensors without another copy.
    module.load_state_dict(pending, strict=False, assign=True)
    _retie(module)
    from specdec.core.linear import release_freed_memory

    release_freed_memory()  # (the readers' and converters' temporaries)


def _retie(module: nn.Module) -> None:
    """``assign=True`` breaks weight tying; tie the output head again."""
    cfg = getattr(module, "config", None)
    if getattr(cfg, "tie_word_embeddings", False) and hasattr(module, "lm_head"):
        module.lm_head.weight = module.model.embed_tokens.weight  # type: ignore[union-attr]


@dataclass
class LoadedDecoder:
    module: nn.Module
    config: Any
    path: Path


def load_graph_api_module(
    module_cls: type[nn.Module],
    config: Any,
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """Constructs ``module_cls(config)`` and loads the checkpoint at ``path``."""
    with torch.device("meta"):
        module = module_cls(config)
    declared = dtype or getattr(config, "dtype", None)
    how = dict(strict=getattr(module_cls, "strict_state_dict_loading", True), dtype=declared,
               override_quantization_encoding=getattr(module_cls, "override_quantization_encoding", False),
               device=device)
    if is_gguf(path):  # llama.cpp's names and quantized types, dequantized as read
        g = open_gguf(path)
        fill_module(module, ((n, g.path, shape, kind, True, load) for n, kind, shape, load in g.iter_tensors(config)),
                    where=g.path, **how)
    else:
        load_state_dict_into(module, weight_files(path), index=weight_map(path), **how)
    # Buffers made on meta (e.g. lazily built rope tables) get real storage.
    for mod in module.modules():
        for bname, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_meta:
                mod._buffers[bname] = torch.empty(0, device=device)
    return module.eval()


def load_decoder(
    path: str | Path,
    *,
    role: Role = Role.DECODER,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    check: Callable[[Any], None] | None = None,
    build: Callable[..., nn.Module] | None = None,
) -> LoadedDecoder:
    """Reads ``config.json``, finds the registered class, loads the weights.

    ``check(config)`` runs on the parsed config before any weight is read (a
    run setting the model cannot serve fails before a long load). ``build``:
    what constructs and loads the module (default :func:`load_graph_api_module`;
    tensor parallelism passes one that reads each rank's shard).
    """
    path = Path(path)
    gguf = is_gguf(path)
    if gguf and build is not None:
        raise CheckpointError(f"{path}: a GGUF file loads whole on one device; tensor parallelism needs the "
                              "Hugging Face (safetensors) checkpoint")
    hf = open_gguf(path).hf_config() if gguf else read_hf_config(path)
    where = path if gguf else path / "config.json"
    archs = hf.get("architectures") or []
    if not archs:
        raise CheckpointError(f"{where} names no 'architectures'")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{where}: 'architectures' must be a list of class names, "
                              f'e.g. ["LlamaForCausalLM"], got {json.dumps(archs)}')
    try:
        module_cls = lookup(archs[0], role)
    except KeyError as e:  # unknown architecture: name the file and the registered ones
        raise CheckpointError(f"{where}: {e.args[0]}") from None
    config_cls = getattr(module_cls, "config_cls", None)
    if config_cls is None:
        raise CheckpointError(f"{module_cls.__name__} declares no config_cls")
    try:
        config = config_cls.from_dict(hf)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{where}: {e}") from None
    check_sizes_backed(config, path)
    if check is not None:
        check(config)
    module = (build or load_graph_api_module)(module_cls, config, path, dtype=dtype, device=device)
    return LoadedDecoder(module=module, config=config, path=path)


def has_tokenizer(path: str | Path) -> bool:
    """Whether the checkpoint at ``path`` has a tokenizer: ``tokenizer.json``, or a GGUF
    file's ``tokenizer.ggml.tokens``."""
    return open_gguf(path).has_tokenizer() if is_gguf(path) else (Path(path) / "tokenizer.json").is_file()


def load_tokenizer(path: str | Path, vocab_size: int | None = None) -> Any:
    """``tokenizer.json`` through the ``tokenizers`` library (a GGUF file: built from its
    metadata); checks it fits the model."""
    from tokenizers import Tokenizer

    if is_gguf(path):
        f = Path(path)
        tok = open_gguf(f).tokenizer()
    else:
        f = Path(path) / "tokenizer.json"
        if not f.is_file():
            raise CheckpointError(f"missing tokenizer.json in {str(Path(path))!r}")
        try:
            tok = Tokenizer.from_file(str(f))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise CheckpointError(f"{f} could not be read: {e}") from None
    if vocab_size is not None and tok.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise CheckpointError(
            f"tokenizer {f} has {tok.get_vocab_size(with_added_tokens=True)} tokens, "
            f"more than the model's vocab_size {vocab_size}"
        )
    return tok


from specdec.core.gguf import is_gguf, open_gguf  # noqa: E402  (it imports CheckpointError from here)
