"""The run directory: where it is, what it holds, and whether a run may resume in it.

Files (names below): ``results.jsonl`` (one line per finished request,
:class:`ResultsStore`), ``summary.json`` / ``summary.txt``, ``run_config.json``
(checked on resume), ``command.txt`` (the overrides, for :func:`resume_command`),
``forward_times.json`` (the bare forward times of the analytic limit), ``plots/``,
``.lock`` (:class:`RunDirLock`: one run at a time writes the dir).

Every write names its file when it fails (:class:`RunDirError`: a full or
read-only disk), and a rewritten file goes through a temporary one that is
removed when the write fails, so the run dir never holds a half-written file
but the last line of ``results.jsonl`` (which a resume drops and redoes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shlex
import signal
import threading
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from specdec.conf_schema import ZOO_DIR, Components, RunConfig
from specdec.data.chat import load_chat_template

log = logging.getLogger(__name__)

RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "run_config.json"
TABLE_FILE = "summary.txt"
COMMAND_FILE = "command.txt"  # the overrides the run was started with (to resume it)
FORWARD_TIMES_FILE = "forward_times.json"
PLOTS_DIR = "plots"
LOCK_FILE = ".lock"  # flock()ed by the run writing the dir; holds its pid
PLAIN = "plain"  # the baseline's key in every record

# Keys that may differ between a run and its resumption (they do not change results).
RESUME_FREE_KEYS = ("name", "logger", "run_dir", "resume", "resume_dir", "progress", "plots", "data.limit",
                    "warmup", "warmup_tokens", "runtime.threads", "allow_mismatch")


class ExperimentError(ValueError):
    """A run that cannot start, resume or save its results (names the key or file at fault)."""


class RunDirError(ExperimentError):
    """A file of the run dir could not be written (disk full, read-only, gone)."""

    def __init__(self, path: Path, err: OSError) -> None:
        super().__init__(f"cannot write {path}: {err.strerror or err}")


class RunDirBusy(ExperimentError):
    """Another process holds the run dir's lock (it is running in that dir)."""


class RunDirLock:
    """The exclusive lock of a run dir: ``flock`` on its ``.lock`` file, which holds the pid.

    Two runs writing one dir (two resumes at once) would interleave their
    results; the second one to lock fails at once with :class:`RunDirBusy`,
    naming the holder's pid. The OS drops the lock when its holder exits or dies,
    so a stale lock never blocks a later resume. A file system without ``flock``
    leaves the dir unlocked (with a warning). Use it as a context manager, or
    :meth:`release` it.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        try:
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(self.path, e) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").split()
            self.release()
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                who = f"pid {holder[0]}" if holder else "another process"
                host = f" on {holder[1]}" if len(holder) > 1 and holder[1] != os.uname().nodename else ""
                raise RunDirBusy(
                    f"run dir {str(self.path.parent)!r} is in use by {who}{host} (a run writing it): "
                    f"wait for that run to end, or stop it, then resume with resume_dir={self.path.parent}"
                ) from None
            log.warning("cannot lock %s (%s): the run dir is not protected against a second run", self.path,
                        e.strerror or e)
            return
        try:  # the holder, for the error of a second run
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()} {os.uname().nodename}\n".encode(), 0)
        except OSError as e:
            self.release()
            raise RunDirError(self.path, e) from None

    def release(self) -> None:
        """Unlocks (closing the file; the file stays, so that no two runs lock two different files)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_HELD: dict[Path, RunDirLock] = {}  # run dirs this process holds until it exits (hold_run_dir)


def hold_run_dir(run_dir: str | Path) -> None:
    """Locks ``run_dir`` for the rest of this process (the command line takes it before Hydra
    writes ``.hydra/`` there); :func:`lock_run_dir` then finds it held. Raises :class:`RunDirBusy`."""
    key = Path(run_dir).resolve()
    if key not in _HELD:
        _HELD[key] = RunDirLock(run_dir)


def lock_run_dir(run_dir: Path) -> contextlib.AbstractContextManager[Any]:
    """The lock a run holds while it writes ``run_dir`` (:class:`RunDirLock`), unless this
    process already holds it (:func:`hold_run_dir`). Raises :class:`RunDirBusy`."""
    return contextlib.nullcontext() if Path(run_dir).resolve() in _HELD else RunDirLock(run_dir)


def failed(rec: Mapping[str, Any]) -> bool:
    """Whether plain decoding or any method ended this request with an error."""
    return bool(rec[PLAIN].get("error")) or any(e.get("error") for e in rec["methods"].values())


class ResultsStore:
    """``results.jsonl``: one line per finished request (done or failed), keyed by request id."""

    def __init__(self, run_dir: Path, *, resume: bool) -> None:
        self.path = Path(run_dir) / RESULTS_FILE
        self.records: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            if not resume:
                raise ExperimentError(
                    f"{self.path} already holds results: pass resume=true (or resume_dir=...) to continue "
                    "that run, or choose another run_dir"
                )
            self._load()

    def _load(self) -> None:
        text = self.path.read_text(encoding="utf-8")
        keep: list[str] = []
        dropped = 0
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                rid = str(rec["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                dropped += 1  # cut short by an interruption: redone
                continue
            if rid in self.records:
                dropped += 1
                continue
            self.records[rid] = rec
            keep.append(line)
        if dropped or (text and not text.endswith("\n")):
            if dropped:
                log.warning("%s: dropped %d incomplete or duplicate line(s); those requests are redone",
                            self.path, dropped)
            write_text(self.path, "".join(line + "\n" for line in keep))

    def discard_failed(self) -> list[str]:
        """Drops the records of failed requests, so that resuming runs them again; returns their ids."""
        ids = [rid for rid, rec in self.records.items() if failed(rec)]
        if ids:
            for rid in ids:
                del self.records[rid]
            write_text(self.path, "".join(json.dumps(rec) + "\n" for rec in self.records.values()))
        return ids

    def append(self, rec: dict[str, Any]) -> None:
        """Appends one request's record (flushed and fsynced: an interruption loses at most the
        batch in flight). Ctrl-C and SIGTERM wait for it: the line and the record in memory (which
        the summary and the resume hint count) are saved together."""
        with _signals_deferred():
            try:
                with self.path.open("a", encoding="utf-8") as fh:
                    fh.write(json.dumps(rec) + "\n")
                    fh.flush()
                    os.fsync(fh.fileno())
            except OSError as e:
                raise RunDirError(self.path, e) from None
            self.records[str(rec["id"])] = rec


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM that arrive inside the block act when it ends. (Python runs signal
    handlers in the main thread, whichever thread the signal reached, so the handlers are
    swapped, not the thread's signal mask.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)
        for s in caught:
            signal.raise_signal(s)  # now, through the usual handler


def write_text(path: Path, text: str) -> None:
    """Writes ``text`` atomically: a temporary file, synced, then a rename; a failed write
    removes the temporary file and leaves ``path`` as it was."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # a disk error, or Ctrl-C / SIGTERM landing mid-write
        with contextlib.suppress(OSError):  # a read-only dir: no temporary file was made
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise RunDirError(path, e) from None
        raise


def write_json(path: Path, data: Any) -> None:
    """Writes ``data`` atomically (:func:`write_text`)."""
    write_text(path, json.dumps(data, indent=2) + "\n")


def make_run_dir(path: Path) -> None:
    """Creates the run dir (and its parents) if missing."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(path, e) from None


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, Mapping) and v:
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out


def check_resume_config(run_dir: Path, cfg: dict[str, Any]) -> None:
    """Resuming: ``cfg`` must match the saved ``run_config.json`` (if any) in every key that changes results."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return
    saved = _flat(json.loads(path.read_text()))
    now = _flat(cfg)

    def free(k: str) -> bool:
        return any(k == f or k.startswith(f + ".") for f in RESUME_FREE_KEYS)

    diff = sorted(k for k in set(saved) | set(now) if not free(k) and saved.get(k) != now.get(k))
    if diff:
        lines = "; ".join(f"{k}: {saved.get(k)!r} (saved) vs {now.get(k)!r} (now)" for k in diff[:8])
        raise ExperimentError(
            f"cannot resume the run in {run_dir}: its config differs in {lines}. "
            f"Resume with the original overrides: {resume_command(run_dir)}"
        )


def save_command(run_dir: Path, has_results: bool) -> None:
    """Writes ``command.txt`` (this job's Hydra overrides) unless a run with results already wrote it."""
    f = run_dir / COMMAND_FILE
    if not f.is_file() or not has_results:
        write_text(f, shlex.join(_task_overrides() or []) + "\n")


def _task_overrides() -> list[str] | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except (ValueError, AttributeError):
        return None


def resume_command(run_dir: Path) -> str:
    """The command line that continues the run in ``run_dir``."""
    f = Path(run_dir) / COMMAND_FILE
    drop = ("resume=", "resume_dir=", "run_dir=", "hydra.run.dir=")
    args = [a for a in (shlex.split(f.read_text()) if f.is_file() else []) if not a.startswith(drop)]
    return shlex.join(["specdec", *args, f"resume_dir={run_dir}"])


def check_resume_dir(resume_dir: str | Path) -> Path:
    """``resume_dir`` must be a run dir this package made (it holds ``run_config.json``): a
    missing dir is not made and a checkpoint dir is not written into."""
    p = Path(resume_dir)
    if not p.is_dir():
        why = "is not a directory" if p.exists() else "does not exist"
        raise ExperimentError(f"resume_dir {str(p)!r} {why}: give the run dir of the run to continue")
    if not (p / CONFIG_FILE).is_file():
        raise ExperimentError(
            f"resume_dir {str(p)!r} is not a specdec run dir: it has no {CONFIG_FILE} (nothing was written there)"
        )
    return p


def resolve_run_dir(rc: RunConfig, run_dir: str | Path | None = None) -> Path:
    """Explicit argument > ``resume_dir`` > ``run_dir`` > Hydra's run dir > ``outputs/<name>/<stamp>_<uid>``."""
    if run_dir is not None:
        return Path(run_dir)
    if rc.resume_dir:
        return check_resume_dir(rc.resume_dir)
    if rc.run_dir:
        return Path(rc.run_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except (ValueError, AttributeError):
        stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        return Path("outputs") / rc.name / f"{stamp}_{secrets.token_hex(3)}"


def hydra_job() -> tuple[str | None, str | None]:
    """(override string of this job, sweep dir name) when running under Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        sweep = Path(str(hc.sweep.dir)).name if hc.mode == RunMode.MULTIRUN else None
        return (hc.job.override_dirname or None), sweep
    except (ValueError, AttributeError):
        return None, None


def check_checkpoints(comps: Components) -> None:
    """Every checkpoint directory the run loads exists (else the error names its key), and
    with ``data.chat`` the target has a chat template: checked before the run dir is used."""
    paths = {"target.path": comps.target}
    for name, m in comps.methods.items():
        if getattr(m, "path", None):
            paths[f"method.{name}.path"] = m.path
    for key, p in paths.items():
        if not (Path(p).is_dir() or Path(p).suffix.lower() == ".gguf" and Path(p).is_file()):  # dir or GGUF file
            hint = (" (the built-in pair is made by `python experiments/train_zoo.py --out specdec/zoo`)"
                    if Path(p).parent == ZOO_DIR else "")
            raise ExperimentError(f"{key}: checkpoint directory {str(p)!r} does not exist{hint}")
    if comps.data.chat:
        load_chat_template(comps.target)  # ChatTemplateError names the file
