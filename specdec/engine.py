"""The engine: continuous batching over a :class:`GenerationPipeline`.

Each :meth:`Engine.step` admits waiting requests up to ``max_batch_size``,
gives each running request its tokens for this step within a token budget
(whole decode steps first, then prefill chunks), reserves KV blocks —
preempting the newest request when blocks run out, to recompute it later —
runs one pipeline step and appends the new tokens, stopping each request
exactly at EOS, a stop id or ``max_new_tokens``.
"""

from __future__ import annotations

import itertools
import operator
import random
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from specdec.core.context import RequestError, RequestFailure, SamplingParams, Status, TextContext
from specdec.core.kv_cache import OutOfBlocks
from specdec.core.pipeline_model import GenerationPipeline


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32
    max_tokens_per_step: int = 2048  # token budget of one step (prefill chunks share it)
    seed: int = 0  # draws the seeds of requests that bring none

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"engine.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_tokens_per_step < 1:
            raise ValueError(f"engine.max_tokens_per_step must be >= 1, got {self.max_tokens_per_step}")


@dataclass
class GenerationOutput:
    request_id: str
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    error: str | None = None
    prompt_len: int = 0
    # Timing (seconds, host clock; None for a rejected request). ttft_s: queued
    # to the first emitted tokens. decode_s: from then to the end, in which the
    # request emitted decode_tokens more (the first step's are not counted).
    ttft_s: float | None = None
    decode_s: float | None = None
    decode_tokens: int = 0

    @classmethod
    def from_context(cls, ctx: TextContext, text: str | None = None) -> GenerationOutput:
        timed = None not in (ctx.t_added, ctx.t_first_token, ctx.t_finished)
        return cls(
            request_id=ctx.request_id,
            token_ids=ctx.generated,
            text=text,
            finish_reason=ctx.finish_reason,
            error=ctx.error,
            prompt_len=ctx.prompt_len,
            ttft_s=ctx.t_first_token - ctx.t_added if timed else None,  # type: ignore[operator]
            decode_s=ctx.t_finished - ctx.t_first_token if timed else None,  # type: ignore[operator]
            decode_tokens=ctx.num_generated - ctx.num_first_tokens if timed else 0,
        )


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    tokens_generated: int = 0
    step_batch_sizes: list[int] = field(default_factory=list)


class Engine:
    """Continuous batching: requests join and leave the running batch."""

    def __init__(
        self,
        pipeline: GenerationPipeline,
        config: EngineConfig = EngineConfig(),
        *,
        eos_token_ids: Sequence[int] = (),
        num_replicas: int = 1,
    ) -> None:
        self.pipeline = pipeline
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_replicas = num_replicas
        self.waiting: deque[TextContext] = deque()
        self.running: list[TextContext] = []
        self.finished: list[TextContext] = []
        self.stats = EngineStats()
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._next_replica = itertools.count()  # round-robin, apart from admission order

    # -- requests ------------------------------------------------------------------
    def add_request(
        self, prompt: Sequence[int], sampling: SamplingParams = SamplingParams(), request_id: str | None = None
    ) -> TextContext:
        """Queues a request; a bad one is rejected (``status == REJECTED``), never raised."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        tokens = list(prompt)
        try:  # numpy / torch integers -> int; anything else is left for _validate to reject
            tokens = [operator.index(t) for t in tokens]
        except TypeError:
            pass
        ctx = TextContext(
            request_id=rid, tokens=tokens, prompt_len=len(tokens), sampling=sampling,
            eos_token_ids=self.eos_token_ids,
        )
        try:
            self._validate(ctx)
        except (RequestError, ValueError, TypeError) as e:
            ctx.reject(str(e))
            self.finished.append(ctx)
            return ctx
        ctx.t_added = time.perf_counter()
        ctx.seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        ctx.replica = next(self._next_replica) % self.num_replicas
        self.waiting.append(ctx)
        return ctx

    def _validate(self, ctx: TextContext) -> None:
        rid = ctx.request_id
        try:
            ctx.sampling.validate()
        except ValueError as e:
            raise RequestError(f"request {rid!r}: {e}") from None
        if not ctx.tokens:
            raise RequestError(f"request {rid!r}: empty prompt")
        vocab = self.pipeline.vocab_size
        not_int = [t for t in ctx.tokens if not isinstance(t, int)]
        if not_int:
            raise RequestError(f"request {rid!r}: token ids must be integers, got {not_int[:5]}")
        bad = [t for t in ctx.tokens if not (0 <= t < vocab)]
        if bad:
            raise RequestError(f"request {rid!r}: token ids out of vocabulary [0, {vocab}): {bad[:5]}")
        if len(ctx.tokens) >= self.pipeline.max_seq_len:
            raise RequestError(
                f"request {rid!r}: prompt of {len(ctx.tokens)} tokens does not fit max_seq_len "
                f"{self.pipeline.max_seq_len} (needs room for at least one new token)"
            )

    # -- stepping ------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        # The pipeline's own bound (state slots, KV sizing) caps the engine's.
        limit = min(self.config.max_batch_size, self.pipeline.max_batch_size)
        while self.waiting and len(self.running) < limit:
            ctx = self.waiting.popleft()
            ctx.status = Status.RUNNING
            ctx.arrival = next(self._arrivals)
            self.running.append(ctx)

    def _preempt(self, ctx: TextContext) -> None:
        """Frees a request's KV and sends it back to the queue to recompute later."""
        self.pipeline.free(ctx)
        self.running.remove(ctx)
        ctx.status = Status.WAITING
        self.waiting.appendleft(ctx)
        self.stats.preemptions += 1

    def _schedule(self) -> tuple[list[TextContext], list[int]]:
        budget = self.config.max_tokens_per_step
        batch: list[TextContext] = []
        num_new: list[int] = []
        # Requests in decode first (oldest first), then prefills in arrival order.
        for ctx in sorted(self.running, key=lambda c: (self.pipeline.unprocessed(c) > 1, c.arrival)):
            want = self.pipeline.unprocessed(ctx)
            n = min(want, budget) if want > 1 else want
            if n < 1 or (n > budget and batch):
                continue
            batch.append(ctx)
            num_new.append(n)
            budget -= n
        return batch, num_new

    def _reserve(self, batch: list[TextContext], num_new: list[int]) -> tuple[list[TextContext], list[int]]:
        """Reserves KV for the step; on OutOfBlocks preempts the newest request and retries."""
        while True:
            try:
                for ctx, n in zip(batch, num_new):
                    self.pipeline.reserve(ctx, n)
                return batch, num_new
            except OutOfBlocks:
                victim = max(self.running, key=lambda c: c.arrival)
                if len(self.running) == 1:
                    # Alone and still too big: this request can never run. Reject
                    # it (the rest of the queue goes on) rather than fail the run.
                    self.pipeline.free(victim)
                    self.running.remove(victim)
                    victim.reject(
                        f"request {victim.request_id!r} alone needs more KV blocks than the cache has; "
                        "raise runtime.num_blocks or lower max_seq_len"
                    )
                    self.finished.append(victim)
                else:
                    self._preempt(victim)
                keep = [(c, n) for c, n in zip(batch, num_new) if c is not victim]
                batch, num_new = [c for c, _ in keep], [n for _, n in keep]

    def step(self) -> list[TextContext]:
        """One engine step; returns the requests that finished in it."""
        self._admit()
        batch, num_new = self._schedule()
        if not batch:
            return []
        batch, num_new = self._reserve(batch, num_new)
        while not batch and self.running:
            # Every scheduled request was preempted (they held too few blocks to
            # make room): schedule the running ones the budget left out, which
            # hold the blocks. Each round preempts at least one, so this ends.
            batch, num_new = self._schedule()
            if not batch:
                return []
            batch, num_new = self._reserve(batch, num_new)
        if not batch:
            return []
        new_tokens = self.pipeline.step(batch, num_new)
        now = time.perf_counter()
        self.stats.steps += 1
        self.stats.step_batch_sizes.append(len(batch))
        done = []
        for ctx, toks in zip(batch, new_tokens):
            if isinstance(toks, RequestFailure):  # this request only: the others go on
                ctx.reject(toks.reason)
                ctx.t_finished = now
                done.append(ctx)
                continue
            if not toks:
                continue
            kept = ctx.append(toks)
            if ctx.t_first_token is None:
                ctx.t_first_token, ctx.num_first_tokens = now, len(kept)
            self.stats.tokens_generated += len(kept)
            if not ctx.done and len(ctx.tokens) >= self.pipeline.max_seq_len:
                ctx.finish("length")
            if ctx.done:
                ctx.t_finished = now
                done.append(ctx)
        for ctx in done:
            self.pipeline.free(ctx)
            self.running.remove(ctx)
            self.finished.append(ctx)
        return done

    def run(self) -> list[TextContext]:
        """Steps until every request has finished; returns all finished requests."""
        while self.has_work():
            self.step()
        return self.finished


def generate_ids(
    engine: Engine,
    prompts: Iterable[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
) -> list[TextContext]:
    """Runs ``prompts`` to completion; returns their contexts in prompt order."""
    prompts = list(prompts)
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
    ctxs = [engine.add_request(p, s) for p, s in zip(prompts, params)]
    engine.run()
    return ctxs
