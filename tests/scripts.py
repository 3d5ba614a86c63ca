"""Test helper: load a script under experiments/ as a module (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path


def load_script(path: Path) -> types.ModuleType:
    """``path`` as a module, once per process (kept in ``sys.modules``: dataclasses look their module up)."""
    key = f"_script_{path.parent.name}_{path.stem}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]
