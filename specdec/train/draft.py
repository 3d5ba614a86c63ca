"""A draft model distilled from the target (``train=draft_model``): the built-in pair's recipe.

The student is a shallower Llama of the target's width (``train.layers``),
starting from copies of the target's embedding, final norm and
``train.init_layers`` (spread evenly by default); the loss at every position is
``kd_weight · KL(p_target || p_draft) (· T²) + (1 - kd_weight) · CE`` on the
target's distributions (:func:`specdec.train.lm.distill_loss`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.llama import LlamaDecoder
from specdec.train import lm
from specdec.train.config import RecipeConfig
from specdec.train.data import EvalSet, Features, chain_tau, draft_ok, tau_summary


def evenly_spread(n_teacher: int, n_student: int) -> list[int]:
    """``n_student`` teacher layer ids from first to last (``[0, n-1]`` for 2)."""
    if n_student == 1:
        return [0]
    return [round(i * (n_teacher - 1) / (n_student - 1)) for i in range(n_student)]


class DraftRecipe:
    """Distillation of a draft model from the target."""

    capture: tuple[int, ...] = ()

    def __init__(self, rc: RecipeConfig, target: LlamaDecoder, train_stream: torch.Tensor, seed: int) -> None:
        self.rc = rc
        self.target = target
        tcfg = target.config
        scfg = dataclasses.replace(tcfg, num_hidden_layers=rc.layers, torch_dtype="float32")
        self.model = lm.build_model(scfg, seed)
        layers = list(rc.init_layers) if rc.init_layers is not None else evenly_spread(tcfg.num_hidden_layers, rc.layers)
        lm.init_from_teacher(self.model, target, layers)
        self.info: dict[str, Any] = {
            "init": f"copy of the target's embedding, final norm and layers {layers}",
            "objective": (f"{rc.kd_weight} * KL(target || draft) at T={rc.kd_temperature}"
                          + (f" + {1 - rc.kd_weight} * CE(next token)" if rc.kd_weight < 1 else "")),
            "params": lm.count_params(self.model),
        }
        for p in target.parameters():
            p.requires_grad_(False)

    @property
    def module(self) -> nn.Module:
        return self.model

    def loss(self, feats: Features, gen: torch.Generator | None) -> tuple[torch.Tensor, dict[str, float]]:
        rc = self.rc
        x, y = feats.tokens[:, :-1], feats.tokens[:, 1:]
        logits = self.model.forward_dense(x)
        t_logits = self.target.lm_head(feats.hidden[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        kd = lm.distill_loss(logits, t_logits, rc.kd_temperature)
        loss = kd if rc.kd_weight >= 1 else rc.kd_weight * kd + (1 - rc.kd_weight) * ce
        acc = (logits.argmax(-1) == t_logits.argmax(-1)).float().mean()
        return loss, {"kl": float(kd.detach()), "ce_labels": float(ce.detach()), "acc_0": float(acc)}

    @torch.no_grad()
    def eval_loss(self, feats: Features, module: nn.Module | None = None) -> dict[str, float]:
        """The loss on held-out ``feats`` (of ``module``, e.g. the saved weights read back; default: the trained one)."""
        live = self.model
        self.model = module or live
        was = self.model.training
        self.model.eval()
        try:
            loss, m = self.loss(feats, None)
        finally:
            self.model.train(was)
            self.model = live
        return {"loss": float(loss), **m}

    @torch.no_grad()
    def tau(self, ev: EvalSet, gamma: int, model: nn.Module | None = None) -> dict[str, float]:
        return draft_model_tau(model or self.model, ev, gamma)

    def save(self, out_dir: Path, target_dir: Path) -> list[Path]:
        from specdec.core.checkpoint import load_tokenizer
        from specdec.train.export import save_hf

        return save_hf(self.model, load_tokenizer(target_dir), out_dir)

    def load_saved(self, out_dir: Path) -> nn.Module:
        from specdec.core.checkpoint import load_decoder

        return load_decoder(out_dir, dtype=torch.float32).module


@torch.no_grad()
def draft_model_tau(model: nn.Module, ev: EvalSet, gamma: int) -> dict[str, float]:
    """Simulated greedy chain speculation of a draft model on the held-out set (same rule as the heads')."""
    was = model.training
    model.eval()
    seqs = ev.features.tokens
    pred = model.forward_dense(seqs).argmax(-1)  # position q predicts q + 1
    parts = [chain_tau(draft_ok(pred[n, :length], seqs[n, :length], gamma), prompt_len, gamma)
             for n, (prompt_len, length) in enumerate(ev.rows())]
    model.train(was)
    return tau_summary(parts, gamma)
