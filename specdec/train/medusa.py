"""Medusa heads trained on the frozen target's outputs (``python -m specdec.train train=medusa``).

Medusa-1: the target is frozen; only the heads learn. A batch is windows of
``S + 1`` tokens ``x_0..x_S`` with the target's final-norm hidden state
``h_t`` at every position. Head ``i`` reads ``h_t`` and is scored against the
target's own distribution at ``t + 1 + i`` (its prediction of ``x_{t+2+i}``:
soft cross-entropy, i.e. distillation of the target's next-token
distribution ``i + 1`` positions later), at every row ``t`` where that
position is inside the window (``ce_target=argmax``: against that
distribution's argmax, the target's greedy token). Loss ``Σ_i step_decay^i · CE_i``.

Initialisation as Medusa: each head's block starts at zero (the block is the
identity), an own lm head (``medusa_own_lm_head``) as a copy of the target's.
With the target's lm_head shared (the default, Medusa-2 format) the heads'
blocks are all that is trained and saved.

Held-out τ (:meth:`MedusaRecipe.tau`): greedy chain speculation simulated on
the target's own greedy continuations, draft ``s`` from root ``r`` being head
``s``'s argmax on ``h_r`` (γ = min(eval.gamma, K)). On the same continuations
each head's top-8 rank accuracies (:func:`rank_accuracy`) give the heads'
static tree (:func:`specdec.spec.tree.best_static_tree`), which the manifest
ships under ``heldout.shipped.static_tree`` with the τ it predicts per budget.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.llama import LlamaDecoder
from specdec.spec.tree import best_static_tree
from specdec.train.config import RecipeConfig
from specdec.train.data import EvalSet, Features, chain_tau, tau_summary


class MedusaRecipe:
    """K Medusa heads over a frozen target, their loss, held-out figures and output."""

    capture: tuple[int, ...] = ()  # only the final-norm hidden state is read

    def __init__(self, rc: RecipeConfig, target: LlamaDecoder, train_stream: torch.Tensor, seed: int) -> None:
        from specdec.models.medusa import MedusaHeadConfig, new_medusa

        self.rc = rc
        self.target = target
        tcfg = target.config
        hcfg = MedusaHeadConfig(num_heads=rc.medusa_num_heads, num_layers=rc.medusa_num_layers,
                                hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
                                shared_lm_head=not rc.medusa_own_lm_head)
        self.head = new_medusa(hcfg, lm_head=target.lm_head.weight.detach().float(), seed=seed)
        self.head.attach_target(target.lm_head)
        for p in target.parameters():
            p.requires_grad_(False)
        self.info: dict[str, Any] = {
            "heads": hcfg.num_heads, "layers_per_head": hcfg.num_layers,
            "lm_head": "the target's (shared, Medusa-2 format)" if hcfg.shared_lm_head
            else "own per head (Medusa-1 layout), initialised from the target's",
            "init": "ResBlock weights and biases zero (identity)",
            "objective": f"sum_i step_decay^i * CE(target {'argmax' if rc.ce_target == 'argmax' else 'distribution'}"
                         " at t+1+i, head i on h_t)",
        }

    @property
    def module(self) -> nn.Module:
        return self.head

    # -- training --------------------------------------------------------------------------
    def loss(self, feats: Features, gen: torch.Generator | None) -> tuple[torch.Tensor, dict[str, float]]:
        hidden = feats.hidden.float()  # [B, L, H]
        length = hidden.shape[1]
        k = min(self.head.num_heads, length - 1)
        with torch.no_grad():
            p_all = F.softmax(self.target.lm_head(hidden[:, 1:]).float(), dim=-1)  # [B, L-1, V]: x_{t+2} at t
        ys = self.head.features(hidden, k)  # [B, L, k, H]
        total = torch.zeros(())
        metrics: dict[str, float] = {}
        for i in range(k):
            n = length - 1 - i  # rows t = 0..n-1 have a target at t + 1 + i <= L - 1
            logq = F.log_softmax(self.head.logits_of(i, ys[:, :n, i]).float(), dim=-1)
            p = p_all[:, i : i + n]
            if self.rc.ce_target == "argmax":  # the target's greedy token: all greedy acceptance needs
                ce = -logq.gather(-1, p.argmax(-1, keepdim=True)).mean()
            else:
                ce = -(p * logq).sum(-1).mean()
            total = total + self.rc.step_decay**i * ce
            metrics[f"ce_{i}"] = float(ce.detach())
            metrics[f"acc_{i}"] = float((logq.argmax(-1) == p.argmax(-1)).float().mean())
        return total, metrics

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, feats: Features) -> dict[str, float]:
        was = self.head.training
        self.head.eval()
        loss, m = self.loss(feats, None)
        self.head.train(was)
        return {"loss": float(loss), **m}

    @torch.no_grad()
    def tau(self, ev: EvalSet, gamma: int, head: nn.Module | None = None) -> dict[str, Any]:
        """Simulated greedy chain speculation at γ = min(``gamma``, K) on the held-out set, and
        ``static_tree``: the heads' rank accuracies there and the best tree they imply."""
        head = head or self.head
        was = head.training
        head.eval()
        g = min(gamma, head.num_heads)
        feats = ev.features
        top = head(feats.hidden.float()).topk(TREE_RANKS, dim=-1).indices  # [N, L, K, R]: head s on h_r, x_{r+2+s}
        pred = top[:, :, :g, 0]  # [N, L, g]
        parts = []
        hits = torch.zeros(head.num_heads, TREE_RANKS)
        reach = torch.zeros(head.num_heads)
        for n, (prompt_len, length) in enumerate(ev.rows()):  # chat rows: each request's own span
            seq = feats.tokens[n, :length]
            ok = torch.zeros(length - 1, g, dtype=torch.bool)
            for s in range(g):
                m = length - 2 - s
                if m > 0:
                    ok[:m, s] = pred[n, :m, s] == seq[s + 2 : s + 2 + m]
            parts.append(chain_tau(ok, prompt_len, g))
            h, r = rank_counts(top[n : n + 1, :length], seq[None], prompt_len)
            hits, reach = hits + h, reach + r
        head.train(was)
        acc = (hits / reach.clamp(min=1).unsqueeze(-1)).tolist()
        choices = best_static_tree(acc, TREE_CHOICES)
        expected = {n: round(1 + sum(math.prod(acc[d][r] for d, r in enumerate(p)) for p in choices[:n]), 3)
                    for n in (1, 2, 4, 8, 16, 32) if n <= len(choices)}
        return {**tau_summary(parts, g),
                "static_tree": {"rank_accuracy": [[round(a, 4) for a in row] for row in acc],
                                "choices": [list(p) for p in choices], "expected_tau": expected,
                                "rule": "rank_accuracy[s][r]: how often head s's rank-r token is the target's, over "
                                        "held-out continuation roots whose tokens at the shallower heads were each "
                                        f"in their head's top {TREE_RANKS}; choices: tree.best_static_tree of those "
                                        "(likeliest first: method.medusa.tree.choices, any budget keeps a prefix); "
                                        "expected_tau: 1 + the sum of the first n paths' products"}}

    # -- output ------------------------------------------------------------------------------
    def save(self, out_dir: Path, target_dir: Path) -> list[Path]:
        from specdec.models.medusa import save_medusa

        return save_medusa(self.head, out_dir, tokenizer_dir=target_dir)

    def load_saved(self, out_dir: Path) -> nn.Module:
        """The saved heads read back through the loader, attached to the target (fp32)."""
        from specdec.models.medusa import load_medusa

        head = load_medusa(out_dir, target=self.target.config, dtype=torch.float32)
        head.attach_target(self.target.lm_head)
        return head


TREE_RANKS = 8  # candidates measured per head for the shipped static tree
TREE_CHOICES = 32  # paths listed (a budget up to this keeps a prefix)


def rank_accuracy(top: torch.Tensor, tokens: torch.Tensor, prompt_len: int) -> list[list[float]]:
    """``acc[s][r]``: how often head ``s``'s rank-``r`` token (``top`` [N, L, K, R], head ``s``
    on ``h_t`` predicting ``x_{t+2+s}``) equals ``tokens`` [N, L], over roots ``t`` of the
    continuation (``t >= prompt_len - 1``) where the tokens ``x_{t+2}..x_{t+1+s}`` were each
    in their head's top ``R``: the roots at which a tree could have reached depth ``s + 1``
    (the conditional :func:`specdec.spec.tree.best_static_tree` multiplies along a path)."""
    hits, reach = rank_counts(top, tokens, prompt_len)
    return (hits / reach.clamp(min=1).unsqueeze(-1)).tolist()


def rank_counts(top: torch.Tensor, tokens: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rank_accuracy`'s counts: hits [K, R] and roots reaching each depth [K], so rows of
    different spans (chat requests) add up before dividing."""
    n, length, k, r = top.shape
    roots = torch.arange(prompt_len - 1, length - 2)  # x_{t+2} exists
    at = roots.view(-1, 1) + 2 + torch.arange(k)  # [T, K] the token each head's draft is for
    valid = at < length
    want = tokens[:, at.clamp(max=length - 1)]  # [N, T, K]
    hit = (top[:, roots] == want.unsqueeze(-1)) & valid.view(1, -1, k, 1)  # [N, T, K, R]
    in_top = hit.any(-1)
    reach = torch.cat([torch.ones_like(in_top[..., :1]), in_top.int().cumprod(-1)[..., :-1].bool()], -1)
    reach &= valid
    return (hit & reach.unsqueeze(-1)).sum((0, 1)).float(), reach.sum((0, 1)).float()
