"""The offline API::

    from specdec import LLM, SamplingParams
    llm = LLM("path/to/target", method=DraftModelConfig(path="path/to/draft"))
    outs = llm.generate(["def fib(n):"], SamplingParams(max_new_tokens=64))

``method=None`` is plain decoding of the target.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.core.checkpoint import load_tokenizer
from specdec.core.context import SamplingParams, TextContext
from specdec.core.pipeline_model import (
    GenerationPipeline,
    PlainGeneration,
    RuntimeConfig,
    registered_pipeline_model,
)
from specdec.engine import Engine, EngineConfig, GenerationOutput


def build_pipeline(target: str | Path, method: Any | None, runtime: RuntimeConfig) -> GenerationPipeline:
    """The engine's pipeline: plain decoding when ``method`` is None, else speculation.

    ``method`` is a proposer config (``NgramConfig``, ``DraftModelConfig`` …):
    its class finds the proposer in the registry.
    """
    if method is None:
        return PlainGeneration(registered_pipeline_model(target, runtime), runtime.max_seq_len)
    from specdec.spec.gamma import GammaPolicyConfig
    from specdec.spec.pipeline import SpecConfig, SpecDecodePipelineModel
    from specdec.spec.proposers import ProposerDeps, proposer_for

    gamma = method.num_speculative_tokens
    target_pm = registered_pipeline_model(target, runtime, extra_tokens=gamma + 1)
    proposer = proposer_for(method)(method, ProposerDeps(runtime=runtime, target=target_pm))
    spec = SpecConfig(num_speculative_tokens=gamma, gamma_policy=GammaPolicyConfig(adaptive=method.adaptive_gamma))
    return SpecDecodePipelineModel(target_pm, proposer, spec, max_seq_len=runtime.max_seq_len)


@dataclass
class LLM:
    """A target (and optionally a drafting method) ready to generate."""

    target: str | Path
    method: Any | None = None
    runtime: RuntimeConfig = RuntimeConfig()
    engine_config: EngineConfig = EngineConfig()

    def __post_init__(self) -> None:
        self.pipeline = build_pipeline(self.target, self.method, self.runtime)
        cfg = self._target_config()
        self.eos_token_ids = tuple(cfg.eos_token_id)
        tok_file = Path(self.target) / "tokenizer.json"
        self.tokenizer = load_tokenizer(self.target, cfg.vocab_size) if tok_file.is_file() else None

    def _target_config(self) -> Any:
        p = self.pipeline
        return p.target.config  # type: ignore[union-attr]

    def new_engine(self) -> Engine:
        return Engine(self.pipeline, self.engine_config, eos_token_ids=self.eos_token_ids)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"no tokenizer.json in {str(self.target)!r}: pass token ids instead of text")
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str | None:
        return self.tokenizer.decode(list(ids)) if self.tokenizer is not None else None

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
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
        if isinstance(prompts, (str, bytes)):
            prompts = [prompts]
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
        engine = self.new_engine()
        ctxs: list[TextContext] = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            rid = f"req-{i}"
            try:
                ids = self.encode(p) if isinstance(p, str) else p
            except ValueError as e:  # text without a tokenizer: reject this request only
                ctx = engine.add_request([], sp, request_id=rid)
                ctx.error = f"request {rid!r}: {e}"
            else:
                ctx = engine.add_request(ids, sp, request_id=rid)
            ctxs.append(ctx)
        engine.run()
        return [GenerationOutput.from_context(c, self.decode(c.generated)) for c in ctxs]
