"""Writing a directory whole or not at all: build it aside, then rename it into place."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_replace(out: Path, recheck: Callable[[], None]) -> Iterator[Path]:
    """Yields a temporary sibling of ``out``; when the block ends normally, ``recheck()`` runs
    again (something may have written ``out`` meanwhile) and the sibling replaces ``out`` (the
    old one moved aside, then removed; put back if the rename fails). An exception or an
    interrupt in the block leaves ``out`` as it was and removes the sibling."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    old = out.with_name(f".{out.name}.old{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        recheck()
        moved = out.exists()
        if moved:
            os.replace(out, old)
        try:
            os.replace(tmp, out)
        except BaseException:
            if moved:
                os.replace(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
