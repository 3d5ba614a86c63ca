"""The training app's files: safetensors + JSON only (nothing is ever unpickled), written atomically.

* tensors with JSON metadata in one ``.safetensors`` file (:func:`write_tensors`,
  :func:`read_tensors`): the training state (module, optimizer, RNG states; step,
  history and optimizer settings in the metadata), the self-distillation text and the
  feature cache. A file that cannot be read is a :class:`TrainError` naming it.
* an output directory (the drafter) is built in a temporary sibling and renamed into
  place (:func:`staged_dir`); a non-empty one is replaced only with ``overwrite=true``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from specdec.core.staging import staged_replace

META_KEY = "specdec"
STATE_FORMAT = "specdec.train_state/1"


class TrainError(RuntimeError):
    """A run that cannot start or continue, or a file it cannot read (the message says why)."""


# --------------------------------------------------------------------------------------------
# tensors + JSON in one safetensors file
# --------------------------------------------------------------------------------------------
def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    """``tensors`` (copied: shared or strided storage is fine) and JSON ``meta`` to ``path``,
    through a temporary file in the same dir renamed over it."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        save_file({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={META_KEY: json.dumps(meta)})
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_tensors(path: Path, what: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and JSON metadata :func:`write_tensors` wrote; a missing, truncated or
    foreign file is a :class:`TrainError` naming ``path`` (``what`` it should have held)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(META_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(raw) if raw is not None else None
    except Exception as e:  # SafetensorError, OSError, JSONDecodeError: all mean the same to the user
        raise TrainError(f"{path}: not a readable {what} ({e})") from None
    if not isinstance(meta, dict):
        raise TrainError(f"{path}: not a readable {what} (no specdec metadata)")
    return tensors, meta


# --------------------------------------------------------------------------------------------
# the training state
# --------------------------------------------------------------------------------------------
def save_state(path: Path, *, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
               torch_rng: torch.Tensor, noise_rng: torch.Tensor, history: Mapping[str, Any], wall_s: float) -> None:
    """The state a resumed run continues from, bit for bit (one file, atomic)."""
    opt = optimizer.state_dict()
    tensors = {f"module/{k}": v for k, v in module.state_dict().items()}
    scalars: dict[str, dict[str, Any]] = {}
    for i, entry in opt["state"].items():
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optimizer/{i}/{k}"] = v
            else:
                scalars.setdefault(str(i), {})[k] = v
    tensors["rng/torch"], tensors["rng/noise"] = torch_rng, noise_rng
    write_tensors(path, tensors, {"format": STATE_FORMAT, "step": step, "history": history, "wall_s": wall_s,
                                  "param_groups": opt["param_groups"], "optimizer_scalars": scalars})


def read_state(path: Path) -> dict[str, Any]:
    """The state in ``path``: ``step``, ``history``, ``wall_s``, ``torch_rng``, ``noise_rng`` and
    what :func:`apply_state` loads. A missing, truncated or foreign file, or one that lacks any of
    it, is a :class:`TrainError` naming the file."""
    tensors, meta = read_tensors(path, "training state")
    if meta.get("format") != STATE_FORMAT:
        raise TrainError(f"{path}: not a training state of this specdec (format {meta.get('format')!r}, "
                         f"expected {STATE_FORMAT!r})")
    try:
        history = meta["history"]
        if not (isinstance(history, dict) and isinstance(history["train"], list) and isinstance(history["eval"], list)
                and isinstance(meta["param_groups"], list) and isinstance(meta["optimizer_scalars"], dict)):
            raise TypeError("history or optimizer settings of the wrong type")
        return {"step": int(meta["step"]), "history": history, "wall_s": float(meta.get("wall_s", 0.0)),
                "torch_rng": tensors["rng/torch"], "noise_rng": tensors["rng/noise"],
                "param_groups": meta["param_groups"], "optimizer_scalars": meta["optimizer_scalars"],
                "tensors": tensors}
    except (KeyError, ValueError, TypeError) as e:
        raise TrainError(f"{path}: an incomplete training state ({type(e).__name__}: {e})") from None


def apply_state(state: Mapping[str, Any], path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                noise_gen: torch.Generator) -> None:
    """Loads :func:`read_state`'s ``state`` (from ``path``) into ``module``, ``optimizer``, torch's
    RNG and ``noise_gen``; one that does not fit them is a :class:`TrainError` naming the file."""
    tensors = state["tensors"]
    try:
        module.load_state_dict({k[len("module/"):]: v for k, v in tensors.items() if k.startswith("module/")})
        opt_state: dict[int, dict[str, Any]] = {}
        for k, v in tensors.items():
            if k.startswith("optimizer/"):
                _, i, name = k.split("/", 2)
                opt_state.setdefault(int(i), {})[name] = v
        for i, entry in state["optimizer_scalars"].items():
            opt_state.setdefault(int(i), {}).update(entry)
        groups = [dict(g) for g in state["param_groups"]]
        for saved, fresh in zip(groups, optimizer.state_dict()["param_groups"]):
            for k, v in fresh.items():  # JSON has no tuples (betas)
                if isinstance(v, tuple) and isinstance(saved.get(k), list):
                    saved[k] = tuple(saved[k])
        optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
        torch.set_rng_state(state["torch_rng"])
        noise_gen.set_state(state["noise_rng"])
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise TrainError(f"{path}: the training state does not fit this run ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------------------------
# output directories
# --------------------------------------------------------------------------------------------
def check_out_dir(out: Path, *, overwrite: bool, key: str = "out_dir") -> None:
    """``out`` may be written: absent, empty, or ``overwrite`` (a :class:`TrainError` naming it and
    the ``overwrite`` key otherwise)."""
    if out.exists() and not out.is_dir():
        raise TrainError(f"{key} {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        names = sorted(p.name for p in out.iterdir())
        shown = ", ".join(names[:4]) + (", …" if len(names) > 4 else "")
        raise TrainError(f"{key} {out} is not empty ({shown}); set overwrite=true to replace it "
                         f"(whole: nothing of the old content is kept), or choose another {key}")


def staged_dir(out: Path, *, overwrite: bool, key: str = "out_dir") -> AbstractContextManager[Path]:
    """A temporary directory next to ``out`` that replaces it whole when the block ends
    normally, ``out`` checked again first (:func:`specdec.core.staging.staged_replace`)."""
    out = Path(out)
    return staged_replace(out, lambda: check_out_dir(out, overwrite=overwrite, key=key))
