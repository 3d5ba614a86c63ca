"""specdec's own C++ kernels, built on first use by the machine's C++ compiler.

:func:`cpu_kernels_available` builds ``cpu.cpp`` (torch's extension builder, a few
seconds, once: the library is cached under torch's extensions folder, ``$TORCH_EXTENSIONS_DIR``
or ``~/.cache/torch_extensions``) and loads it, which registers the float32 CPU ops
``torch.ops.specdec_cpu.row_linear`` (with ``row_linear_pack``), ``rms_norm``,
``paged_attention``, ``decoder_forward`` (a Llama forward on them in one call),
``decoder_steps`` (a greedy draft chain's steps), ``eagle_forward`` / ``eagle_steps`` (an
EAGLE head's forward, its greedy chain's steps), ``medusa_forward`` (Medusa heads' pass) and
``huge_empty`` (memory on huge pages). The layers call the first three
(:mod:`specdec.core.linear`, the attention in :mod:`specdec.models.llama`); the
whole-forward ops are called only by a module's native backend (:mod:`specdec.core.backend`). The build is for this CPU
(``-march=native``), so its name carries a digest of the source, the flags, torch's version
and the CPU's model and feature flags: another CPU, or an edited source, builds afresh.
Where no compiler or OpenMP is at hand it returns False, with a warning, and the callers
keep another kernel (:mod:`specdec.core.linear`).
"""

from __future__ import annotations

import functools
import hashlib
import platform
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu.cpp")
CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(keep))  # the first processor's lines; all cores alike


def build_name() -> str:
    """The extension's name: ``specdec_cpu_<digest of source, flags, torch, CPU>``."""
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), torch.__version__.encode(),
                 _cpu_identity().encode()):
        h.update(part)
    return f"specdec_cpu_{h.hexdigest()[:16]}"


@functools.cache
def cpu_kernels_available() -> bool:
    """Whether ``torch.ops.specdec_cpu`` is loaded here; builds it on the first call."""
    try:
        from torch.utils.cpp_extension import load

        load(build_name(), [str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
             is_python_module=False)
    except Exception as e:  # no compiler, no OpenMP, a read-only cache: keep another kernel
        warnings.warn(f"specdec's CPU kernels ({SOURCE}) did not build here "
                      f"({type(e).__name__}: {str(e)[-500:]}); the layers keep torch's kernels (oneDNN for linears)", stacklevel=2)
        return False

    @torch.library.register_fake("specdec_cpu::row_linear")
    def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("specdec_cpu::rms_norm")
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("specdec_cpu::paged_attention")
    def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
          mask: torch.Tensor | None, causal: bool, scale: float) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    return True
