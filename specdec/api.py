"""The offline API::

    from specdec import LLM, SamplingParams
    llm = LLM("path/to/target", method="ngram", max_seq_len=512)
    outs = llm.generate(["def fib(n):"], SamplingParams(max_new_tokens=64, stop=["\\n\\n"]))
    for chunk in llm.stream("def fib(n):"):
        print(chunk.text, end="", flush=True)

``method=None`` is plain decoding of the target.
"""

from __future__ import annotations

import difflib
import itertools
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from specdec.core.checkpoint import has_tokenizer, load_tokenizer
from specdec.core.context import SamplingParams, TextContext
from specdec.core.pipeline_model import (
    GenerationPipeline,
    PlainGeneration,
    RuntimeConfig,
    registered_pipeline_model,
)
from specdec.engine import Engine, EngineConfig, GenerationOutput, drain
from specdec.spec.proposers import ProposerConfig, config_class, registered_proposers
from specdec.zoo_fetch import resolve_target

Prompt = str | Sequence[int]
Method = ProposerConfig | str | Mapping[str, Any] | None


def _did_you_mean(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def method_config(method: Method) -> ProposerConfig | None:
    """A drafting method's config from what ``LLM(method=...)`` accepts.

    None (plain decoding) and a config object pass through; a name gives that
    method's defaults; a dict gives its ``name`` and options. Names and option
    keys are checked against the proposer registry, so a typo fails here,
    before any model loads, naming what is wrong.
    """
    if method is None or isinstance(method, ProposerConfig):
        return method
    if isinstance(method, str):
        name, options = method, {}
    elif isinstance(method, Mapping):
        options = dict(method)
        name = options.pop("name", None)
        if not isinstance(name, str):
            raise ValueError(f"method {method!r} needs a 'name': one of {', '.join(registered_proposers())}")
    else:
        raise TypeError(f"method must be None, a drafting method's name, a dict with its 'name' and options, "
                        f"or its config object, got {type(method).__name__}")
    try:
        cls = config_class(name)
    except KeyError as e:
        raise ValueError(f"method: {e.args[0]}{_did_you_mean(name, registered_proposers())}") from None
    known = [f.name for f in fields(cls) if f.init]
    for key in options:
        if key not in known:
            raise TypeError(f"method {name!r} has no option {key!r}{_did_you_mean(key, known)}; "
                            f"its options: {', '.join(known)}")
    try:
        return cls(**options)
    except (TypeError, ValueError) as e:
        raise type(e)(f"method {name!r}: {e}") from None


def method_for(target: str | Path, method: Method) -> ProposerConfig | None:
    """:func:`method_config` for ``target``: a fetchable target (``"smollm2"``) drafts with its own
    shipped checkpoint (``specdec/zoo/smollm2-eagle3``) where the method would take the built-in
    target's and one exists, as the run config does (:func:`specdec.conf_schema.target_heads`)."""
    from specdec.conf_schema import target_heads, zoo_drafter
    from specdec.zoo_fetch import MODELS

    if isinstance(method, str):
        method = {"name": method}
    if isinstance(method, Mapping) and "path" not in method and str(target) in MODELS:
        own = zoo_drafter(str(method.get("name")), str(target))
        if own is not None:
            method = {**method, "path": str(own)}
    cfg = method_config(method)
    if cfg is None:
        return None

    return target_heads(str(target), {cfg.method_name: cfg})[cfg.method_name]


_RUNTIME_KEYS = tuple(f.name for f in fields(RuntimeConfig))
_ENGINE_KEYS = tuple(f.name for f in fields(EngineConfig))


def split_settings(
    runtime: RuntimeConfig | None, engine_config: EngineConfig | None, settings: Mapping[str, Any]
) -> tuple[RuntimeConfig, EngineConfig]:
    """``runtime`` and ``engine_config`` (defaults when None) with the keyword
    ``settings`` put into whichever has the field (``max_batch_size``: both);
    a keyword neither has is a ``TypeError`` naming it."""
    for key in settings:
        if key not in _RUNTIME_KEYS and key not in _ENGINE_KEYS:
            raise TypeError(
                f"LLM() got an unexpected keyword argument {key!r}{_did_you_mean(key, _RUNTIME_KEYS + _ENGINE_KEYS)}: "
                f"runtime settings are {', '.join(_RUNTIME_KEYS)}; engine settings are {', '.join(_ENGINE_KEYS)}"
            )
    rt = replace(runtime or RuntimeConfig(), **{k: v for k, v in settings.items() if k in _RUNTIME_KEYS})
    ec = replace(engine_config or EngineConfig(), **{k: v for k, v in settings.items() if k in _ENGINE_KEYS})
    return rt, ec


def build_pipeline(target: str | Path, method: ProposerConfig | None, runtime: RuntimeConfig) -> GenerationPipeline:
    """The engine's pipeline: plain decoding when ``method`` is None, else speculation.

    ``method`` is a proposer config (``NgramConfig``, ``DraftModelConfig`` …):
    its class finds the proposer in the registry.
    """
    if runtime.data_parallel_degree > 1:
        from specdec.dist.replicas import Replicas, replica_devices

        devices = replica_devices(runtime.device, runtime.data_parallel_degree)
        # One speculative pipeline per replica (specdec/dist/replicas.py), each on its device; plain
        # decoding's replicas share one pipeline (the batch processor's splits) only on one device.
        if method is not None or len(set(devices)) > 1:
            one = replace(runtime, data_parallel_degree=1)
            return Replicas.build(runtime.data_parallel_degree,
                                  lambda r: build_pipeline(target, method, replace(one, device=devices[r])))
    if method is None:
        return PlainGeneration(registered_pipeline_model(target, runtime), runtime.max_seq_len)
    from specdec.spec.gamma import GammaPolicyConfig
    from specdec.spec.pipeline import SpecConfig, SpecDecodePipelineModel
    from specdec.spec.proposers import ProposerDeps, proposer_for

    gamma = method.num_speculative_tokens
    target_pm = registered_pipeline_model(target, runtime, extra_tokens=gamma + 1)
    proposer = proposer_for(method)(method, ProposerDeps(runtime=runtime, target=target_pm))
    gamma = min(gamma, proposer.spec.max_speculative_tokens or gamma)  # e.g. Medusa: K heads
    spec = SpecConfig(num_speculative_tokens=gamma, gamma_policy=GammaPolicyConfig(adaptive=method.adaptive_gamma))
    return SpecDecodePipelineModel(target_pm, proposer, spec, max_seq_len=runtime.max_seq_len)


@dataclass(frozen=True)
class StreamChunk:
    """What one engine step added to a streamed request.

    ``token_ids`` and ``text`` are new since the previous chunk (a speculative
    step may bring several tokens; ``text`` is None without a tokenizer). The
    last chunk has ``finish_reason`` (and ``error`` when the request failed).
    """

    request_id: str
    token_ids: list[int]
    text: str | None
    finish_reason: str | None = None
    error: str | None = None


def _requests(prompts: Prompt | Sequence[Prompt],
              sampling: SamplingParams | Sequence[SamplingParams]) -> tuple[list[Prompt], list[SamplingParams]]:
    """The prompts as a list (one string is one prompt) and one sampling per prompt; a ``TypeError``
    or ``ValueError`` that names the argument at fault."""
    if isinstance(prompts, (str, bytes)):
        prompts = [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be a list of prompts (text or token ids), got {type(prompts).__name__}")
    prompts = list(prompts)
    if isinstance(sampling, SamplingParams):
        params = [sampling] * len(prompts)
    elif isinstance(sampling, Sequence) and not isinstance(sampling, str):
        params = list(sampling)
    else:
        raise TypeError(f"sampling must be a SamplingParams or a list of one per prompt, "
                        f"got {type(sampling).__name__}")
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
    return prompts, params


class LLM:
    """A target (and optionally a drafting method) ready to generate.

    ``target``: a checkpoint directory, a ``.gguf`` file, or a model fetched by name on first
    use (``"smollm2"``: :mod:`specdec.zoo_fetch`).

    ``method``: None (plain decoding of the target), a registered drafting
    method's name (``"ngram"``: its defaults), a dict of its ``name`` and
    options (``{"name": "draft_model", "path": ..., "num_speculative_tokens": 3}``)
    or its config object (``NgramConfig(max_n=3)``).

    ``settings``: fields of :class:`RuntimeConfig` (``device``, ``dtype``,
    ``compile``, ``threads``, ``max_seq_len``, ``num_blocks`` …) or of
    :class:`EngineConfig` (``max_tokens_per_step``, ``seed``) as keywords;
    ``max_batch_size`` sets both. They override the same fields of ``runtime``
    / ``engine_config`` when those are given too. ``threads`` sets torch's
    (process-wide) thread count here. ``dtype`` defaults to "auto": float32 on CPU,
    bfloat16 on CUDA (``LLM(target, device="cuda")`` runs in bfloat16; pass
    ``dtype="float32"``, and ``tf32=False`` for float32 products to the last bit).

    Its requests are numbered ``req-0``, ``req-1`` … across all its calls and
    streams, never reused. Open streams, ``generate`` calls and engines of
    :meth:`new_engine` may run on it together: each request gives the tokens
    it gives alone (seeded sampling too, unless ``adaptive_gamma``: its γ,
    and so the sampled tokens, follow what else runs).
    """

    def __init__(
        self,
        target: str | Path,
        method: Method = None,
        runtime: RuntimeConfig | None = None,
        engine_config: EngineConfig | None = None,
        **settings: Any,
    ) -> None:
        self.method = method_for(target, method)  # checked before anything loads
        self.target = target = resolve_target(target)  # a fetchable name ("smollm2"): its cached file
        self._ids = itertools.count()  # request numbers, unique across this LLM's calls and streams
        self.runtime, self.engine_config = split_settings(runtime, engine_config, settings)
        from specdec.dist.data_parallel import localize

        # Under torchrun: join the launch; data parallelism is then across processes (generate shards).
        self.dist, self.runtime = localize(self.runtime)
        if self.runtime.threads:
            import torch

            torch.set_num_threads(self.runtime.threads)
        if self.runtime.keep_allocations and self.runtime.device == "cpu":
            from specdec.core.pipeline_model import keep_large_allocations

            keep_large_allocations()
        self.pipeline = build_pipeline(target, self.method, self.runtime)
        cfg = self.pipeline.target.config  # type: ignore[attr-defined]
        self.eos_token_ids = tuple(cfg.eos_token_id)
        self.tokenizer = load_tokenizer(target, cfg.vocab_size) if has_tokenizer(target) else None

    def __repr__(self) -> str:
        return f"LLM(target={str(self.target)!r}, method={self.method!r})"

    def request_ids(self, n: int) -> list[str]:
        """``n`` fresh request ids of this LLM (``req-N``: unique across its calls and streams)."""
        return [f"req-{next(self._ids)}" for _ in range(n)]

    def new_engine(self, clock: Callable[[], float] = time.perf_counter) -> Engine:
        return Engine(self.pipeline, self.engine_config, eos_token_ids=self.eos_token_ids, tokenizer=self.tokenizer,
                      num_replicas=self.runtime.data_parallel_degree, clock=clock)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"no tokenizer.json in {str(self.target)!r}: pass token ids instead of text")
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str | None:
        return self.tokenizer.decode(list(ids)) if self.tokenizer is not None else None

    def _add(self, engine: Engine, prompt: Prompt, sampling: SamplingParams, rid: str,
             detokenize: bool = False) -> TextContext:
        """Queues one prompt; text without a tokenizer rejects this request only."""
        try:
            ids = self.encode(prompt) if isinstance(prompt, str) else prompt
        except ValueError as e:
            ctx = engine.add_request([], sampling, request_id=rid)
            ctx.error = f"request {rid!r}: {e}"
            return ctx
        return engine.add_request(ids, sampling, request_id=rid, detokenize=detokenize)

    def _text(self, engine: Engine, ctx: TextContext) -> str | None:
        """The output text: as followed while generating (cut at a stop string), else decoded whole."""
        followed = engine.output_text(ctx)
        if followed is None:
            return self.decode(ctx.generated)
        followed.close()
        return followed.text

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    ) -> list[GenerationOutput]:
        """Generates for every prompt (text or token ids); outputs in prompt order.

        A single string is one prompt. ``sampling``: one for every prompt, or a
        list of one per prompt (another length is a ``ValueError``). A bad prompt
        or sampling value ends that request only (its output has ``error`` set,
        finish_reason ``"error"``); the others run as they would without it.
        Whatever raises inside (an exception, KeyboardInterrupt) frees every KV
        block and state slot of the call before it propagates: this LLM then
        serves the next call as a fresh one would.
        """
        prompts, params = _requests(prompts, sampling)
        if self.dist.dp > 1:  # torchrun: this replica's share, every replica's outputs merged
            from specdec.dist.data_parallel import generate_sharded

            return generate_sharded(self, prompts, params)
        return drain(self._generate_steps(prompts, params, time.perf_counter))

    def generate_steps(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> Generator[None, None, list[GenerationOutput]]:
        """:meth:`generate`, one engine step per ``next()``; the outputs are the
        generator's return value (``StopIteration.value``). ``clock`` times the
        requests (``ttft_s``, ``decode_s``): a benchmark that runs several of these
        by turns (:func:`specdec.measure.lockstep`) gives each a clock that runs
        only during its own steps. Closing it early aborts the requests left."""
        prompts, params = _requests(prompts, sampling)
        if self.dist.dp > 1:
            raise ValueError("generate_steps runs one process's engine: under torchrun data parallelism use generate")
        return self._generate_steps(prompts, params, clock)

    def _generate_steps(self, prompts: list[Prompt], params: list[SamplingParams],
                        clock: Callable[[], float]) -> Generator[None, None, list[GenerationOutput]]:
        engine = self.new_engine(clock)
        ctxs = [self._add(engine, p, sp, rid) for p, sp, rid in zip(prompts, params, self.request_ids(len(prompts)))]
        for _ in engine.steps():
            yield
        return [GenerationOutput.from_context(c, self._text(engine, c)) for c in ctxs]

    def stream(self, prompt: Prompt, sampling: SamplingParams = SamplingParams()) -> Iterator[StreamChunk]:
        """Generates for one prompt (text or token ids), yielding tokens as they are accepted.

        Each chunk holds the token ids and text one step added (a speculative
        step: all its accepted tokens); text is held back while it ends in an
        incomplete UTF-8 character or may be the start of a stop string, so
        the chunks concatenate to what :meth:`generate` returns for the same
        request. The last chunk carries ``finish_reason``; a bad request gives
        that one chunk, with ``error``. Leaving the loop early (``break``,
        an exception, closing the generator) aborts the request and frees its
        KV blocks and state slot; a generator kept unclosed holds them until
        it is garbage-collected (``contextlib.closing`` makes that explicit).
        """
        engine = self.new_engine()
        ctx = self._add(engine, prompt, sampling, self.request_ids(1)[0], detokenize=True)
        text = engine.output_text(ctx)
        sent = 0  # token ids given out (no tokenizer: straight from ctx)
        try:
            while True:
                if not ctx.done:
                    engine.step()
                if text is not None:
                    ids, piece = text.take(final=ctx.done)
                else:
                    ids, piece, sent = ctx.generated[sent:], None, ctx.num_generated
                if ctx.done:
                    yield StreamChunk(ctx.request_id, ids, piece, ctx.finish_reason, ctx.error)
                    return
                if ids or piece:
                    yield StreamChunk(ctx.request_id, ids, piece)
        finally:
            if not ctx.done:
                engine.abort(ctx.request_id)
