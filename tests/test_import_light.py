"""``import specdec`` stays light: no torch, transformers or Hydra until a model or a run needs them.

The ≤ 1 s import rests on this (torch alone takes over a second to import)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "hydra", "omegaconf", "matplotlib")


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_specdec_loads_no_heavy_package():
    code = (
        "import sys\n"
        "import specdec\n"
        "from specdec import Role, SamplingParams, register, registered_names, lookup\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "assert not heavy, heavy\n"
        "assert 'specdec.api' not in sys.modules  # specdec.LLM loads on first use\n"
    )
    r = _fresh(code)
    assert r.returncode == 0, r.stderr


def test_registry_still_registers_and_looks_up_after_a_light_import():
    code = (
        "import sys\n"
        "import specdec\n"
        "from specdec.core.registry import DecoderModule, Role, register\n"  # the base class: loads torch
        "assert 'torch' in sys.modules\n"
        "@register(Role.DRAFT_HEAD, 'FrobHead')\n"
        "class Frob(DecoderModule):\n"
        "    pass\n"
        "assert specdec.lookup('FrobHead', Role.DRAFT_HEAD) is Frob\n"
        "assert specdec.lookup('LlamaForCausalLM').__name__ == 'LlamaDecoder'\n"
        "assert specdec.LLM.__module__ == 'specdec.api'\n"
    )
    r = _fresh(code)
    assert r.returncode == 0, r.stderr


def test_no_import_cycle_through_the_experiment():
    """api and dist sit below the experiment: neither imports it, not even inside a function
    (the cycle api → dist → experiment → api)."""
    import ast
    from pathlib import Path

    import specdec

    root = Path(specdec.__file__).parent
    bad = []
    for f in [root / "api.py", root / "engine.py", *sorted((root / "dist").glob("*.py"))]:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            bad += [f"{f.name}:{node.lineno} imports {n}" for n in names if n.startswith("specdec.experiment")]
    assert not bad, bad
