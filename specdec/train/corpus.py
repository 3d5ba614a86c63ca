"""The training corpus: the Python standard library's ``.py`` sources.

Files come from ``sysconfig.get_paths()["stdlib"]``, excluding
``site-packages`` and test directories (``test``, ``tests``, ``idle_test``).
A file is *held out* when the sha256 of its path relative to the stdlib root
falls in a fixed bucket (:func:`is_held_out`), so the split does not depend on
which other files exist. Held-out files give the evaluation text and the
built-in prompts (:func:`make_prompts`).
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
HELD_OUT_MODULUS = 20  # 1 file in 20 (5%) is held out


@dataclass(frozen=True)
class SourceFile:
    """One stdlib source file: its path relative to the stdlib root, and its text."""

    rel_path: str
    text: str


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel_path: str, modulus: int = HELD_OUT_MODULUS) -> bool:
    """True for the deterministic ~1/``modulus`` of files kept out of training."""
    h = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()
    return int(h[:8], 16) % modulus == 0


def list_sources(root: Path | None = None) -> list[str]:
    """Sorted relative paths of the ``.py`` files under ``root`` (default: the stdlib)."""
    root = root or stdlib_root()
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if f.is_file():
            out.append(rel.as_posix())
    return sorted(out)


def read_source(root: Path, rel_path: str) -> str:
    """The file's text; bytes that are not UTF-8 become U+FFFD."""
    return (root / rel_path).read_bytes().decode("utf-8", errors="replace")


def load_split(
    root: Path | None = None, modulus: int = HELD_OUT_MODULUS, max_files: int | None = None
) -> tuple[list[SourceFile], list[SourceFile]]:
    """``(train, held_out)`` source files; ``max_files`` caps each side (quick runs)."""
    root = root or stdlib_root()
    train: list[SourceFile] = []
    held: list[SourceFile] = []
    for rel in list_sources(root):
        text = read_source(root, rel)
        if not text.strip():
            continue
        (held if is_held_out(rel, modulus) else train).append(SourceFile(rel, text))
    if max_files is not None:
        train, held = train[:max_files], held[: max(1, max_files // 10)]
    return train, held


_DEF = re.compile(r"^\s*(async\s+)?def\s+\w+\s*\(")


def make_prompts(
    held_out: Sequence[SourceFile],
    count_tokens: Callable[[str], int],
    n: int = 32,
    min_tokens: int = 100,
    max_tokens: int = 300,
) -> list[dict[str, str]]:
    """Code-prefix prompts from held-out files, spread over as many files as possible.

    Each prompt ends at a line boundary right after the opening line of a
    function's docstring (``def ...:`` then a line starting with triple
    quotes), and starts at a line boundary chosen so it holds
    ``min_tokens``..``max_tokens`` tokens. Files are visited in order of the
    sha256 of their path, taking each file's first candidate, then each file's
    second, and so on until ``n``. Deterministic.
    """
    order = sorted(held_out, key=lambda f: hashlib.sha256(f.rel_path.encode()).hexdigest())
    per_file = [(f, _file_prompts(f.text, count_tokens, min_tokens, max_tokens)) for f in order]
    prompts: list[dict[str, str]] = []
    for rank in range(max((len(c) for _, c in per_file), default=0)):
        for f, cands in per_file:
            if rank < len(cands) and len(prompts) < n:
                prompts.append({"id": f"stdlib-{len(prompts):03d}", "prompt": cands[rank], "source": f.rel_path})
    return prompts


_DOC_OPEN = ('"""', "'''", 'r"""', "r'''")


def _file_prompts(text: str, count_tokens: Callable[[str], int], min_tokens: int, max_tokens: int) -> list[str]:
    """Non-overlapping prompt candidates of one file, in file order."""
    lines = text.splitlines(keepends=True)
    found: list[str] = []
    floor = 0  # a prompt starts after the previous one's end
    for i, line in enumerate(lines):
        if i < floor or not _DEF.match(line):
            continue
        j = i  # the signature may span lines: find the line ending with ':'
        while j < len(lines) and j < i + 8 and not lines[j].rstrip().endswith(":"):
            j += 1
        if j + 1 >= len(lines) or not lines[j + 1].lstrip().startswith(_DOC_OPEN):
            continue
        end = j + 2  # through the docstring's first line
        for start in range(i, floor - 1, -1):  # grow upward by whole lines
            chunk = "".join(lines[start:end])
            k = count_tokens(chunk)
            if k > max_tokens:
                break
            if k >= min_tokens:
                found.append(chunk)
                floor = end
                break
    return found
