"""A test drafter that drafts *after* verification from the target's hidden states.

``echo_test`` keeps one feature per request in the shared state store: the
target's final-norm hidden state at the row that produced the step's bonus
token. It proposes the argmax of that feature through the target's own
lm_head (shared by reference), repeated γ times: under greedy decoding that
is the bonus token itself, so the next step's drafts say "the last token
repeats". Its acceptance is therefore fixed by plain decoding's output
(:func:`expected_counts`), which lets a test check that the right feature
reached the right request, step after step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.state_store import StateSpec
from specdec.sampling import SamplingTensors
from specdec.spec.metrics import SpecCounts
from specdec.spec.proposers import (
    Drafter,
    DrafterSpec,
    DraftTree,
    Proposer,
    ProposerConfig,
    ProposerDeps,
    TargetStep,
    register_proposer,
)


@dataclass(frozen=True)
class EchoConfig(ProposerConfig):
    aux_layer: int = 0  # a target layer whose input the drafter also asks for (shape-checked)


class EchoDrafter(Drafter):
    def __init__(self, lm_head: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.lm_head = lm_head  # the target's own head (shared, not copied)
        self.hidden = hidden
        self.bonus_mismatches = 0  # greedy steps whose draft was not the bonus token (must stay 0)

    def draft_after(self, step: TargetStep, gamma: int, sampling: SamplingTensors) -> DraftTree:
        b = step.num_accepted.shape[0]
        rows = torch.arange(b, device=step.hidden.device)
        assert step.aux_hidden is not None and step.aux_hidden.shape == (*step.hidden.shape[:2], self.hidden)
        step.state.scatter("feature", step.slots, step.hidden[rows, step.num_accepted])  # [B, H]
        feature = step.state.gather("feature", step.slots)  # read back by slot
        tok = self.lm_head(feature).argmax(-1)  # [B]
        if sampling.all_greedy:
            bonus = step.tokens[rows, step.num_accepted]
            self.bonus_mismatches += int((tok != bonus).sum())
        return DraftTree.chain(tok.unsqueeze(1).expand(b, gamma).contiguous())


@register_proposer("echo_test", EchoConfig)
class EchoProposer(Proposer):
    def __init__(self, config: EchoConfig, deps: ProposerDeps) -> None:
        hidden = deps.target.config.hidden_size
        self.config = config
        self.drafter = EchoDrafter(deps.target.module.lm_head, hidden)
        self._hidden = hidden

    def drafter_spec(self) -> DrafterSpec:
        return DrafterSpec(drafts_after_verify=True, target_layers=(self.config.aux_layer,))

    # Its weights are the target's own head (one matmul a step): declared free, not left to a default.
    def draft_cost(self, batch_size: int, context_len: int) -> float:
        return 0.0

    def draft_forward_time(self, ctx_len: int, repeats: int = 10, **_) -> float:
        return 0.0

    def state_specs(self) -> list[StateSpec]:
        return [StateSpec("feature", torch.float32, (self._hidden,))]


def expected_counts(output: list[int], gamma: int) -> SpecCounts:
    """The counts ``echo_test`` must record for a request whose greedy output is
    ``output``: a first step with no drafts (there is no feature yet), then each
    step drafts the last token γ' = min(γ, tokens left - 1) times and keeps the
    run of repeats that follows."""
    c = SpecCounts()
    c.record(0, 0)
    i = 1
    while i < len(output):
        g = min(gamma, len(output) - i - 1)
        k = 0
        while k < g and output[i + k] == output[i - 1]:
            k += 1
        c.record(g, k)
        i += k + 1
    return c
