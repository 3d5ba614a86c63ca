"""Independent draft model: any registered decoder sharing the target's vocabulary.

Each step the drafter (1) catches up on the request's tokens it has not seen
(the whole prompt at first, then the tokens the last step committed), which
yields the first draft token, then (2) runs ``γ - 1`` one-token steps, each
feeding the previous draft token. All positions and KV slots are packed on the
host beforehand, so the loop runs inside the draft-and-verify module without a
host round trip. Its paged KV cache is rolled back in step with the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specdec.core.context import TextContext
from specdec.core.inputs import DecoderInputs, MaskKind, move_tensors
from specdec.core.kv_cache import block_table_array
from specdec.core.pipeline_model import DecoderPipelineModel, registered_pipeline_model
from specdec.sampling import LANE_DRAFT, SamplingTensors, greedy_tokens, probs_from_logits, sample_from
from specdec.spec.forward_time import forward_time
from specdec.spec.proposers.base import (
    DraftBatch,
    Drafter,
    DraftTree,
    Proposer,
    ProposerConfig,
    ProposerDeps,
    register_proposer,
)


@dataclass(frozen=True)
class DraftModelConfig(ProposerConfig):
    path: str = ""  # the draft checkpoint directory (Hugging Face format, the target's vocabulary)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.path:
            raise ValueError("path (the draft checkpoint directory) is required")


@dataclass
class DraftModelBatch(DraftBatch):
    catch_up: DecoderInputs | None = None  # the unseen tokens of each request, logits of the last
    step_positions: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [γ-1, B] int64
    step_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [γ-1, B] int64
    gather_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [B, S] through the last draft
    max_len: int = 0  # host: the longest request's length before drafting (S = max_len + γ - 1)


class DraftModelDrafter(Drafter):
    """Device half: the draft decoder as a submodule, sampling ``γ`` tokens."""

    def __init__(self, pipeline: DecoderPipelineModel) -> None:
        super().__init__()
        self.decoder = pipeline.build_module()
        self._row_cache: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}

    def _rows(self, b: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The one-token steps' row indices for ``b`` requests (read-only, made once per size):
        ``out_index`` [B], ``logit_index`` [B], ``q_index`` [B, 1]. Distinct
        tensors: a compiled decoder guards on inputs aliasing each other."""
        rows = self._row_cache.get((b, device))
        if rows is None:
            rows = self._row_cache[(b, device)] = (
                torch.arange(b, device=device), torch.arange(b, device=device),
                torch.arange(b, device=device).unsqueeze(1))
        return rows

    def forward(self, batch: DraftModelBatch, sampling: SamplingTensors) -> DraftTree:  # type: ignore[override]
        assert batch.catch_up is not None and batch.catch_up.kv_cache is not None
        kv = batch.catch_up.kv_cache
        logits = self.decoder(batch.catch_up).logits  # [B, V]
        b = logits.shape[0]
        out_rows, logit_rows, q_index = self._rows(b, logits.device)
        toks, probs = [], []
        for j in range(batch.gamma):
            if sampling.all_greedy:
                t = greedy_tokens(logits)
            else:
                p = probs_from_logits(logits.unsqueeze(1), sampling).squeeze(1)  # [B, V]
                pos = batch.first_position + j  # [B] position the draft token will take
                t = sample_from(p, sampling.seeds, pos, LANE_DRAFT)
                probs.append(p)
            toks.append(t)
            if j + 1 < batch.gamma:
                # Keys through this step's position only: for one request that is
                # exactly its context (no mask needed); a batch masks the rest.
                n_keys = batch.max_len + j + 1
                step_pos = batch.step_positions[j]  # [B]
                step = DecoderInputs(
                    tokens=t,
                    positions=step_pos,
                    slot_mapping=batch.step_slots[j],
                    gather_slots=batch.gather_slots[:, :n_keys].contiguous(),  # strides of a view recompile
                    q_index=q_index,
                    q_pos=step_pos.unsqueeze(1),
                    out_index=out_rows,
                    logit_index=logit_rows,
                    kv_cache=kv,
                    single_request=b == 1,
                    # One request reads keys through this position only: exactly its context.
                    mask=MaskKind.NONE if b == 1 else MaskKind.EXPLICIT,
                )
                logits = self.decoder(step).logits
        return DraftTree.chain(
            torch.stack(toks, dim=1),  # [B, γ]
            torch.stack(probs, dim=1) if probs else None,  # [B, γ, V]; greedy: q one-hot, left implicit
        )


@register_proposer("draft_model", DraftModelConfig)
class DraftModelProposer(Proposer):
    """Host half: the draft's batch processor and KV bookkeeping."""

    def __init__(self, config: DraftModelConfig, deps: ProposerDeps) -> None:
        self.config = config
        self.pipeline = registered_pipeline_model(
            config.path, deps.runtime, cache_name="draft", extra_tokens=config.num_speculative_tokens + 1
        )
        self.pipeline.build_module()  # the module the drafter calls is the one timed and executed
        vocab = self.pipeline.config.vocab_size
        target_vocab_size = deps.target.config.vocab_size
        target_tokenizer = deps.target.path / "tokenizer.json" if deps.target.path else None
        if vocab != target_vocab_size:
            raise ValueError(
                f"draft {config.path!r} has vocab_size {vocab}, the target has {target_vocab_size}: "
                "a draft model must share the target's vocabulary"
            )
        if target_tokenizer is not None:
            _check_same_tokenizer(Path(config.path), target_tokenizer)
        self.drafter = DraftModelDrafter(self.pipeline)

    @property
    def cache_name(self) -> str:
        return self.pipeline.cache_name

    def reserve(self, ctx: TextContext, gamma: int) -> None:
        self.pipeline.reserve(ctx, self.kv_tokens(len(ctx.tokens), gamma))

    def kv_tokens(self, num_tokens: int, gamma: int) -> int:
        return num_tokens + max(gamma - 1, 0)  # catch up on every unseen token, then γ - 1 drafts

    def prepare(self, batch: list[TextContext], gamma: int, num_draft: list[int]) -> DraftModelBatch:
        packed = self.pipeline.prepare(batch)  # the catch-up; its KV cache serves every step
        bs = self.pipeline.caches[0].block_size
        steps = max(gamma - 1, 0)
        # Positions and KV slots of the γ-1 one-token steps, on the host (numpy).
        lens = np.asarray([len(c.tokens) for c in batch], dtype=np.int64)  # [B] first draft position
        tbl = block_table_array([c.kv[self.cache_name].blocks for c in batch])  # [B, max_blocks]
        p = np.arange(int(lens.max()) + steps)
        gather = tbl[:, np.minimum(p // bs, tbl.shape[1] - 1)] * bs + p % bs  # [B, S] slot of each position
        pos = lens[None, :] + np.arange(steps)[:, None]  # [γ-1, B]
        slots = gather[np.arange(len(batch))[None, :], pos]  # [γ-1, B]
        for c in batch:
            c.kv[self.cache_name].num_tokens += steps
        return move_tensors(DraftModelBatch(
            gamma=gamma,
            num_draft=torch.tensor(num_draft, dtype=torch.long),
            first_position=torch.from_numpy(lens),
            catch_up=packed.inputs,
            step_positions=torch.from_numpy(pos),
            step_slots=torch.from_numpy(slots),
            gather_slots=torch.from_numpy(np.ascontiguousarray(gather)),  # fancy indexing may give F order
            max_len=int(lens.max()),
        ), self.pipeline.device)

    def draft_cost(self, batch_size: int, context_len: int) -> float:
        return forward_time(self.pipeline, batch_size, max(context_len, batch_size), repeats=7, stat="min")

    @property
    def draft_model(self) -> DecoderPipelineModel:
        return self.pipeline

    def commit(self, ctx: TextContext, num_committed: int) -> None:
        # Keep the fed draft tokens that were accepted (they equal committed tokens);
        # the last committed token is fed next step.
        self.pipeline.truncate(ctx, min(ctx.processed(self.cache_name), num_committed - 1))

    def free(self, ctx: TextContext) -> None:
        self.pipeline.free(ctx)


def _check_same_tokenizer(draft_dir: Path, target_tok: Path) -> None:
    draft_tok = draft_dir / "tokenizer.json"
    if not (draft_tok.is_file() and target_tok.is_file()):
        return
    import json

    dv = json.loads(draft_tok.read_text()).get("model", {}).get("vocab")
    tv = json.loads(target_tok.read_text()).get("model", {}).get("vocab")
    if dv != tv:
        raise ValueError(f"draft tokenizer {draft_tok} differs from the target's {target_tok}")
