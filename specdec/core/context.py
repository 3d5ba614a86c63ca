"""One request: its tokens, sampling parameters, status and per-model KV blocks."""

from __future__ import annotations

import enum
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


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. ``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int | None = None  # None: the engine draws one
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raises ``ValueError`` naming the first bad field."""
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"sampling.seed must be in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"


@dataclass(eq=False)
class TextContext:
    """One request as the engine and the batch processors see it.

    ``tokens`` holds the prompt then the generated tokens. Each model serving
    the request keeps a :class:`BlockTable` in ``kv`` (keyed by the cache's
    name); its ``num_tokens`` is how far that model has processed ``tokens``.
    """

    request_id: str
    tokens: list[int]
    prompt_len: int
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "error"
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

    def reject(self, error: str) -> None:
        self.status = Status.REJECTED
        self.finish_reason = "error"
        self.error = error
