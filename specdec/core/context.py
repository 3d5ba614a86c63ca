"""One request: its tokens, sampling parameters, status and per-model KV blocks."""

from __future__ import annotations

import enum
import itertools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.core.kv_cache import BlockTable


class RequestError(ValueError):
    """A request that cannot run (names the request and the reason)."""


@dataclass(frozen=True)
class RequestFailure:
    """What a pipeline's step gives back, instead of new tokens, for a request it
    could not step (its logits went non-finite …): the engine ends that request
    with ``reason`` as its error, and every other request goes on untouched."""

    reason: str  # names the request and what failed


def _is_int(x: object) -> bool:
    """An integer (Python, numpy …) and not a bool: ``True`` is neither a count nor a token id."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_finite(x: object) -> bool:
    """A finite real number, not a bool (``inf`` temperature would sample uniform noise)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. ``temperature == 0`` is greedy.

    ``deadline_s``: seconds after the request is queued past which the engine
    ends it (finish_reason ``"deadline"``, its tokens so far kept), checked
    between steps; None: no deadline.

    ``stop``: strings (or one string) that end the output where the first of
    them appears in its text (finish_reason ``"stop"``): the text ends just
    before it, the token ids are those whose text precedes it (see
    :class:`specdec.detokenize.RequestText` for a token the stop starts
    inside). Needs the model's tokenizer.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int | None = None  # None: the engine draws one
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    deadline_s: float | None = None
    stop: tuple[str, ...] = ()

    def validate(self) -> None:
        """Raises ``ValueError`` naming the first bad field. Checked here, at
        admission, so a wrong type never reaches a step (where ``2.5`` tokens
        would fail the whole batch): integers are integers (bool excluded),
        reals are finite."""
        checks = (
            ("temperature", _is_finite(self.temperature) and self.temperature >= 0, "a finite number >= 0"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "an integer >= 0"),
            ("top_p", _is_finite(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("seed", self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
             "an integer in [0, 2**63) or None"),
            ("max_new_tokens", _is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "an integer >= 1"),
            ("stop_token_ids", isinstance(self.stop_token_ids, Sequence)
             and not isinstance(self.stop_token_ids, (str, bytes))
             and all(_is_int(t) for t in self.stop_token_ids), "a list or tuple of integer token ids"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "True or False"),
            ("deadline_s", self.deadline_s is None or (_is_finite(self.deadline_s) and self.deadline_s > 0),
             "a finite number of seconds > 0 or None"),
            ("stop", (isinstance(self.stop, str) and self.stop != "")
             or (isinstance(self.stop, Sequence) and not isinstance(self.stop, (str, bytes))
                 and all(isinstance(s, str) and s != "" for s in self.stop)),
             "a non-empty string or a list or tuple of them"),
        )
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"sampling.{name} must be {want}, got {getattr(self, name)!r}")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (one string is one stop string)."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"


_keys = itertools.count()  # TextContext.key: one process-wide sequence


@dataclass(eq=False)
class TextContext:
    """One request as the engine and the batch processors see it.

    ``tokens`` holds the prompt then the generated tokens. Each model serving
    the request keeps a :class:`BlockTable` in ``kv`` (keyed by the cache's
    name); its ``num_tokens`` is how far that model has processed ``tokens``.

    ``key`` is unique to this context in the process: pipelines and proposers
    key their per-request bookkeeping by it, never by ``request_id``, which
    only the engine that queued the request keeps unique (two engines, or
    two calls, on one pipeline may reuse an id while both run).
    """

    request_id: str
    tokens: list[int]
    prompt_len: int
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "error" | "abort" | "deadline"
    error: str | None = None
    slot: int | None = None  # state-store slot while running
    kv: dict[str, BlockTable] = field(default_factory=dict)
    seed: int = 0  # the effective RNG seed (sampling.seed or one the engine drew)
    # Speculation bookkeeping, filled by the speculative pipeline.
    num_speculative_tokens: int | None = None  # None: the method's default γ
    arrival: int = 0  # admission order (preemption picks the newest)
    replica: int = 0  # data-parallel replica serving this request
    # Host clock (time.perf_counter), set by the engine: queued, first tokens
    # emitted (how many that step emitted: speculation may emit several), done.
    t_added: float | None = None
    t_first_token: float | None = None
    num_first_tokens: int = 0
    t_finished: float | None = None
    key: int = field(default_factory=lambda: next(_keys), init=False, repr=False)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def processed(self, cache: str = "target") -> int:
        """How many tokens the model behind ``cache`` has in its KV cache."""
        table = self.kv.get(cache)
        return 0 if table is None else table.num_tokens

    def max_length(self, max_seq_len: int) -> int:
        """The most tokens it can reach: prompt + max_new_tokens, capped at ``max_seq_len``."""
        return min(self.prompt_len + self.sampling.max_new_tokens, max_seq_len)

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.REJECTED)

    def append(self, new_tokens: list[int]) -> list[int]:
        """Appends tokens up to the first stop condition; returns those kept.

        Stops at EOS (unless ``ignore_eos``), a stop id, or ``max_new_tokens``,
        and sets ``finish_reason``. Tokens after the stop are dropped.
        """
        sp = self.sampling
        kept: list[int] = []
        for t in new_tokens:
            kept.append(t)
            self.tokens.append(t)
            if not sp.ignore_eos and t in self.eos_token_ids:
                self.finish("eos")
                break
            if t in sp.stop_token_ids:
                self.finish("stop")
                break
            if self.num_generated >= sp.max_new_tokens:
                self.finish("length")
                break
        return kept

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason

    def end_early(self, reason: str, error: str) -> None:
        """Ends it before a stop condition (``"abort"``, ``"deadline"``): the
        tokens so far are kept, ``error`` says why."""
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error

    def reject(self, error: str) -> None:
        self.status = Status.REJECTED
        self.finish_reason = "error"
        self.error = error
