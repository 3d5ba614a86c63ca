"""What a run ran on: ``summary.json``'s ``machine`` record.

Speed figures mean little without the machine, the torch build and the code
that made them, so every summary carries them: CPU model and cores, OS,
Python, torch version and build (``cpu`` or ``cuda <version>``), the GPU's
name when the run's device is CUDA, and the git commit of the specdec source
(with ``dirty``: tracked files changed) when that source is a git checkout
(else None; a missing ``git`` is not an error). A resumed run records the
machine of the session that wrote the summary last.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # specdec/


def _cpuinfo() -> dict[str, str]:
    """The first processor's ``/proc/cpuinfo`` fields (empty where there is none)."""
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def cpu_model() -> str:
    """The CPU's model name with its family and model numbers, which tell apart CPUs a VM names alike
    (``AMD EPYC (family 25 model 17)``); else what :mod:`platform` knows."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine() or "unknown"
    if "cpu family" in info and "model" in info:
        name += f" (family {info['cpu family']} model {info['model']})"
    return name


def cpu_isa() -> str | None:
    """The widest x86 vector extensions the CPU has (the native kernels' speed turns on them)."""
    flags = set(_cpuinfo().get("flags", "").split())
    if not flags:
        return None
    found = [f for f in ("avx512f", "avx512_bf16", "avx2", "fma") if f in flags]
    return " ".join(found) or "no AVX2"


def git_commit(source: Path = PACKAGE_DIR) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the checkout ``source`` is tracked in; None when it is not in one
    (an installed package, no ``git``)."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(source), *args], capture_output=True, text=True, timeout=10,
                              check=False)

    try:
        # tracked here: a package installed into a venv inside some other repo is not that repo's code
        if git("ls-files", "--error-unmatch", "--", "__init__.py").returncode != 0:
            return None
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


def machine_record(device: str = "cpu") -> dict[str, Any]:
    """The machine, torch build and source of a run on ``device`` (``runtime.device``)."""
    cuda = torch.version.cuda
    gpu = None
    if str(device).startswith("cuda") and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(torch.device(device))
    return {
        "cpu": cpu_model(),
        "isa": cpu_isa(),
        "cores": os.cpu_count(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_build": f"cuda {cuda}" if cuda else ("rocm " + torch.version.hip if torch.version.hip else "cpu"),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": gpu,
        "git": git_commit(),
    }
