"""Model shapes, the training loop (next-token CE, or distillation), evaluation.

Training uses :meth:`specdec.models.llama.LlamaDecoder.forward_dense` on random
fixed-length windows of one concatenated token stream. A draft is distilled
from a frozen target by minimizing ``KL(p_target || p_draft)`` at every
position (optionally mixed with the hard-label loss). Everything draws its
randomness from explicit ``torch.Generator``s, so a run is deterministic given
its seed (and the thread count).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.config import LlamaConfig, RopeConfig
from specdec.models.llama import LlamaDecoder


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-architecture model."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool = True
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    def config(self, vocab_size: int, bos_token_id: int, eos_token_id: int) -> LlamaConfig:
        """The :class:`LlamaConfig` of this shape (fp32 in memory; saved as bf16)."""
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.hidden_size // self.num_attention_heads,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            rope=RopeConfig(theta=self.rope_theta),
            torch_dtype="float32",
            bos_token_id=bos_token_id,
            eos_token_id=[eos_token_id],
        )


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer and schedule of one training run."""

    steps: int
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    # distillation (used when a teacher is given)
    kd_weight: float = 1.0  # weight of KL(teacher || student); (1 - kd_weight) on hard labels
    kd_temperature: float = 1.0


@dataclass
class TrainStats:
    """What a run did: losses at the end, tokens seen, wall time."""

    steps: int
    tokens_seen: int
    wall_time_s: float
    final_train_loss: float
    loss_curve: list[tuple[int, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_model(cfg: LlamaConfig, seed: int) -> LlamaDecoder:
    """A fresh :class:`LlamaDecoder`, GPT-2 style init (std 0.02, residual outputs scaled)."""
    g = torch.Generator().manual_seed(seed)
    model = LlamaDecoder(cfg)
    resid_std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                continue  # norms stay at 1
            std = resid_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def init_from_teacher(student: LlamaDecoder, teacher: LlamaDecoder, layers: Sequence[int]) -> None:
    """Copies the teacher's embedding, final norm and ``layers`` into ``student`` (same width).

    ``student.model.layers[i]`` starts as ``teacher.model.layers[layers[i]]``;
    e.g. ``[0, n - 1]`` gives a 2-layer draft the target's first and last layer.
    """
    if student.config.hidden_size != teacher.config.hidden_size:
        raise ValueError("init_from_teacher needs equal hidden sizes")
    if len(layers) != student.config.num_hidden_layers:
        raise ValueError(f"{len(layers)} layers named for a {student.config.num_hidden_layers}-layer student")
    with torch.no_grad():
        student.model.embed_tokens.weight.copy_(teacher.model.embed_tokens.weight)
        student.model.norm.weight.copy_(teacher.model.norm.weight)
        if not student.config.tie_word_embeddings:
            student.lm_head.weight.copy_(teacher.lm_head.weight)
        for i, j in enumerate(layers):
            student.model.layers[i].load_state_dict(teacher.model.layers[j].state_dict())


def count_params(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


def sample_windows(tokens: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``seq + 1`` tokens from the stream ``tokens`` [N]."""
    starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq + 1)[None, :]
    return tokens[idx]


def eval_windows(tokens: torch.Tensor, seq: int, max_windows: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping windows of ``seq + 1`` tokens [W, seq + 1]."""
    n = (tokens.numel() - 1) // seq
    if max_windows is not None:
        n = min(n, max_windows)
    return torch.stack([tokens[i * seq : i * seq + seq + 1] for i in range(n)])


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warmup then cosine decay to ``min_lr_ratio * lr``."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    t = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _optimizer(model: nn.Module, tc: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=tc.betas)


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over positions of ``KL(softmax(t/T) || softmax(s/T))``, times ``T**2``."""
    v = student_logits.shape[-1]
    s = F.log_softmax(student_logits.reshape(-1, v).float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.reshape(-1, v).float() / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


def train_lm(
    model: LlamaDecoder,
    train_tokens: torch.Tensor,
    tc: TrainConfig,
    teacher: LlamaDecoder | None = None,
    desc: str = "train",
    log_every: int = 50,
) -> TrainStats:
    """Trains ``model`` in place on random windows of ``train_tokens``.

    Without ``teacher``: next-token cross-entropy. With one: the teacher runs
    frozen on the same windows and the loss is
    ``kd_weight * KL(teacher || model) + (1 - kd_weight) * CE``.
    Shows a tqdm bar; returns :class:`TrainStats`.
    """
    from tqdm import tqdm

    torch.manual_seed(tc.seed)
    gen = torch.Generator().manual_seed(tc.seed)
    model.train()
    if teacher is not None:
        teacher.eval()
    opt = _optimizer(model, tc)
    curve: list[tuple[int, float]] = []
    ema: float | None = None
    t0 = time.perf_counter()
    bar = tqdm(range(tc.steps), desc=desc, dynamic_ncols=True, mininterval=2.0)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        w = sample_windows(train_tokens, tc.batch_size, tc.seq_len, gen)
        x, y = w[:, :-1], w[:, 1:]
        logits = model.forward_dense(x)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        if teacher is None:
            loss = ce
        else:
            with torch.no_grad():
                t_logits = teacher.forward_dense(x)
            kd = distill_loss(logits, t_logits, tc.kd_temperature)
            loss = tc.kd_weight * kd + (1 - tc.kd_weight) * ce if tc.kd_weight < 1 else kd
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if tc.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        val = float(ce.detach())
        ema = val if ema is None else 0.98 * ema + 0.02 * val
        if step % log_every == 0 or step == tc.steps - 1:
            curve.append((step, round(val, 4)))
            post = {"ce": f"{ema:.3f}"}
            if teacher is not None:
                post["kl"] = f"{float(kd.detach()):.3f}"
            bar.set_postfix(post)
    model.eval()
    return TrainStats(
        steps=tc.steps,
        tokens_seen=tc.steps * tc.batch_size * tc.seq_len,
        wall_time_s=round(time.perf_counter() - t0, 1),
        final_train_loss=round(float(ema or 0.0), 4),
        loss_curve=curve,
    )


@torch.no_grad()
def _logits_batches(model: LlamaDecoder, windows: torch.Tensor, batch: int = 16):
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch]
        yield w, model.forward_dense(w[:, :-1]).float()


@torch.no_grad()
def eval_loss(model: LlamaDecoder, windows: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats/token) over ``windows`` [W, S + 1]."""
    model.eval()
    total, n = 0.0, 0
    for w, logits in _logits_batches(model, windows, batch):
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"))
        n += w[:, 1:].numel()
    return total / n


@torch.no_grad()
def greedy_agreement(draft: LlamaDecoder, target: LlamaDecoder, windows: torch.Tensor, batch: int = 16) -> float:
    """Fraction of positions where ``argmax draft == argmax target`` on ``windows``."""
    agree, n = 0, 0
    for i in range(0, windows.shape[0], batch):
        x = windows[i : i + batch, :-1]
        a = draft.forward_dense(x).argmax(-1)
        b = target.forward_dense(x).argmax(-1)
        agree += int((a == b).sum())
        n += a.numel()
    return agree / n


@torch.no_grad()
def greedy_generate(model: LlamaDecoder, prompt: Sequence[int], n_new: int, eos_id: int | None = None) -> list[int]:
    """Greedy continuation of ``prompt`` by ``n_new`` tokens (dense re-forward per token)."""
    ids = list(prompt)
    for _ in range(n_new):
        nxt = int(model.forward_dense(torch.tensor([ids]))[0, -1].argmax())
        ids.append(nxt)
        if eos_id is not None and nxt == eos_id:
            break
    return ids[len(prompt) :]


@torch.no_grad()
def simulate_greedy_speculation(
    draft: LlamaDecoder, target: LlamaDecoder, prompts: Sequence[Sequence[int]], n_new: int = 64, gamma: int = 4
) -> dict[str, float]:
    """Mean accepted length τ of greedy speculative decoding, by simulation.

    For each prompt the target generates ``n_new`` tokens greedily; the draft's
    greedy proposal at each position of that sequence is its argmax there
    (exactly what it would propose, since accepted tokens equal the target's).
    Each step starts at the next ungenerated position, accepts the longest run
    of ``<= gamma`` matching proposals and adds the target's own token, so a
    step yields ``accepted + 1`` tokens. τ = tokens generated / target calls.
    """
    tokens, steps, accepted, positions, agree = 0, 0, 0, 0, 0
    for p in prompts:
        cont = greedy_generate(target, p, n_new)
        seq = torch.tensor([list(p) + cont])
        d_arg = draft.forward_dense(seq)[0].argmax(-1)  # prediction for position i + 1
        start = len(p)
        match = [int(d_arg[start - 1 + j]) == cont[j] for j in range(len(cont))]
        agree += sum(match)
        positions += len(match)
        j = 0
        while j < len(cont):
            k = 0
            while k < gamma and j + k < len(cont) and match[j + k]:
                k += 1
            step_tokens = min(k + 1, len(cont) - j)
            accepted += k
            tokens += step_tokens
            steps += 1
            j += step_tokens
    a = agree / max(1, positions)
    return {
        "tau": tokens / max(1, steps),
        "accepted_per_step": accepted / max(1, steps),
        "agreement_on_target_greedy": a,
        "tau_iid_estimate": (1 - a ** (gamma + 1)) / (1 - a) if a < 1 else gamma + 1.0,
        "prompts": len(prompts),
        "gamma": gamma,
        "n_new": n_new,
    }


def time_forward(model: LlamaDecoder, seq: int = 128, reps: int = 20) -> float:
    """Median seconds of a batch-1 dense forward of ``seq`` tokens: a rough per-call cost probe."""
    x = torch.randint(0, model.config.vocab_size, (1, seq))
    ts = []
    with torch.no_grad():
        for _ in range(reps):
            t0 = time.perf_counter()
            model.forward_dense(x)
            ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]
