"""Progress a researcher can see wherever the run's output goes.

On a terminal (stderr is a TTY) a tqdm bar counts requests, with τ and
tokens/s so far; anywhere else (``make run | tee log``, CI, a job scheduler)
a bar would print nothing useful, so a plain line goes to stderr instead, at
most every :data:`INTERVAL_S` seconds and once at the end. The slow phases
outside the requests (loading, warm-up, bare forward timing) print a line when
they start and when they end, with their duration, in both cases: a run is
never silent for long.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TextIO

INTERVAL_S = 5.0  # at most one progress line per this many seconds when stderr is not a terminal
PREFIX = "specdec"


def fmt_duration(s: float) -> str:
    return f"{s:.1f}s" if s < 60 else f"{int(s // 60)}m{int(s % 60):02d}s"


def figures_line(summary: Mapping[str, Any] | None) -> str:
    """``plain 281 tok/s | draft_model 411 tok/s τ 3.89 ×1.46 | …`` from a run summary so far."""
    if not summary:
        return ""
    parts = []
    plain = (summary.get("plain") or {}).get("tokens_per_s")
    if plain:
        parts.append(f"plain {plain:.0f} tok/s")
    for name, m in (summary.get("methods") or {}).items():
        bits = [name]
        if m.get("tokens_per_s"):
            bits.append(f"{m['tokens_per_s']:.0f} tok/s")
        if m.get("tau") is not None:
            bits.append(f"τ {m['tau']:.2f}")
        if m.get("speedup"):
            bits.append(f"×{m['speedup']:.2f}")
        parts.append(" ".join(bits))
    return " | ".join(parts)


class Progress:
    """Requests done of ``total`` (``done`` of them before this session), with the figures so far.

    ``noun`` / ``unit`` / ``prefix`` name what is counted and who speaks (the
    training app counts ``step``s as ``specdec.train``)."""

    def __init__(self, total: int, done: int = 0, *, enabled: bool = True, stream: TextIO | None = None,
                 interval_s: float = INTERVAL_S, tty: bool | None = None, noun: str = "requests",
                 unit: str = "req", prefix: str = PREFIX) -> None:
        self.noun, self.unit, self.prefix = noun, unit, prefix
        self.postfix = ""  # a caller's own figures (update(postfix=...)), shown when there is no summary
        self.total = total
        self.done = done
        self.start_done = done
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.tty = bool(tty if tty is not None else getattr(self.stream, "isatty", lambda: False)())
        self._bar: Any = None
        self._t0 = time.perf_counter()
        self._last_line: float | None = None
        self._summary: Mapping[str, Any] | None = None

    def line(self, text: str) -> None:
        """One timestamped line to the stream (above the bar while one is shown)."""
        if not self.enabled:
            return
        msg = f"[{self.prefix} {time.strftime('%H:%M:%S')}] {text}"
        if self._bar is not None:
            self._bar.write(msg, file=self.stream)
        else:
            print(msg, file=self.stream, flush=True)

    @contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """A line when ``what`` starts and one when it ends, with its duration (or that it failed)."""
        self.line(f"{what} …")
        t0 = time.perf_counter()
        try:
            yield
        except BaseException:
            self.line(f"{what}: stopped after {fmt_duration(time.perf_counter() - t0)}")
            raise
        self.line(f"{what}: done in {fmt_duration(time.perf_counter() - t0)}")

    def start_requests(self, what: str) -> None:
        """Opens the bar (terminal) or prints the first line; ``what``: the pipelines and batch."""
        self.start(f"{self.noun}: {self.total - self.done} to run of {self.total} ({what})")

    def start(self, first_line: str | None = None) -> None:
        """Starts the clock, prints ``first_line`` and opens the bar on a terminal."""
        self._t0 = time.perf_counter()
        self._last_line = self._t0
        if not self.enabled:
            return
        if first_line:
            self.line(first_line)
        if self.tty:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, initial=self.done, desc=self.noun, unit=self.unit,
                             file=self.stream, dynamic_ncols=True)

    def update(self, n: int, summary: Mapping[str, Any] | None = None, *, postfix: str | None = None) -> None:
        """``n`` more done; ``summary``: the run's figures so far (for τ and tokens/s),
        or ``postfix``: a caller's own (a training loss)."""
        self.done += n
        if summary is not None:
            self._summary = summary
        if postfix is not None:
            self.postfix = postfix
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            if summary is not None or postfix is not None:
                self._bar.set_postfix_str(self._figures(), refresh=False)
            return
        now = time.perf_counter()
        if self.done >= self.total or self._last_line is None or now - self._last_line >= self.interval_s:
            self._last_line = now
            self.line(self.status())

    def status(self) -> str:
        """``requests 12/32 (38%), 41.0s, ETA 1m08s | <figures so far>``."""
        elapsed = time.perf_counter() - self._t0
        ran = self.done - self.start_done
        text = f"{self.noun} {self.done}/{self.total} ({100 * self.done / max(self.total, 1):.0f}%), {fmt_duration(elapsed)}"
        if 0 < ran and self.done < self.total:
            text += f", ETA {fmt_duration(elapsed / ran * (self.total - self.done))}"
        figs = self._figures()
        return f"{text} | {figs}" if figs else text

    def _figures(self) -> str:
        return figures_line(self._summary) if self._summary is not None else self.postfix

    def close(self) -> None:
        """Closes the bar and, on a terminal, prints where the requests ended."""
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.close()
            self.line(self.status())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
