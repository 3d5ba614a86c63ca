"""EAGLE-1 and EAGLE-3 heads trained on the frozen target's outputs (``train=eagle`` / ``train=eagle3``).

Layout of one batch: windows of ``S + 1`` tokens ``x_0..x_S`` and the target's
features ``f_t`` / logits at every position. Row ``i`` (``0 <= i < S``) of an
unrolled draft step ``s`` is the chain rooted at position ``r = i - s``, at
position ``i``: its inputs are the token ``x_{i+1}`` and, for ``s = 0``, the
target's feature ``f_i`` (EAGLE-1: final-norm hidden; EAGLE-3: ``fc`` of the
fused layer inputs), for ``s > 0`` the head's own output of step ``s - 1`` at
row ``i - 1`` (the same chain one position earlier); its output ``h`` gives
logits for ``x_{i+2}``, compared with the target's distribution at ``i + 1``.
It attends to step 0's keys at positions ``<= r`` and to its own chain's keys
of steps ``1..s`` (step ``u`` at row ``r + u``): exactly what a chain draft
sees at inference (:class:`UnrolledAttend`). Rows with ``r < 0`` are not scored.

- ``eagle``: ``feature_weight · SmoothL1(h_i, f_{i+1}) + ce_weight · CE``, one
  step by default (``ttt_steps`` > 1 unrolls it too);
- ``eagle3``: training-time test, ``ttt_steps`` = k unrolled steps, loss
  ``Σ_s step_decay^s · CE_s`` against the target's distribution restricted to
  the draft vocabulary (positions whose target argmax lies outside it are not
  scored); the draft vocabulary is the N most frequent tokens of the train stream.

The same unrolled forward, without gradients and with ``k = γ``, simulates
greedy chain speculation on the target's own greedy continuations
(:meth:`HeadRecipe.tau`): with teacher forcing on the target's tokens, every
accepted draft equals what it would have drafted, so the first mismatch of
each chain is exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.config import LlamaConfig
from specdec.models.llama import LlamaDecoder
from specdec.train.config import RecipeConfig
from specdec.train.data import EvalSet, Features, chain_tau, tau_summary, top_tokens


class UnrolledAttend:
    """The ``Attend`` of one unrolled draft step over ``[B, S]`` rows (b-major packed).

    Keeps every earlier step's keys and values: step ``s``'s query at row ``i``
    sees step 0's keys at rows ``j <= i - s`` (causal, shifted back by ``s``)
    and, for each ``u`` in ``1..s``, step ``u``'s key at row ``i - s + u`` (the
    chain's own, the last one its own row). Call :meth:`next_step` between steps.
    """

    def __init__(self, batch: int, seq: int) -> None:
        self.b, self.s = batch, seq
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, S = self.b, self.s
        q, k, v = (t.view(b, S, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))  # [B, h, S, d]
        step = len(self.kv)
        self.kv.append((k, v))
        if step == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return out.transpose(1, 2).reshape(b * S, -1)
        rep = q.shape[1] // k.shape[1]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t if rep == 1 else t.repeat_interleave(rep, dim=1)

        scale = q.shape[-1] ** -0.5
        k0, v0 = (heads(t) for t in self.kv[0])
        i = torch.arange(S, device=q.device)
        allowed = i[None, :] <= (i[:, None] - step)  # [S(query), S(key)]
        scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))]
        values = []
        for u in range(1, step + 1):
            ku, vu = (heads(t) for t in self.kv[u])
            shift = step - u  # the chain's key of step u sits `shift` rows earlier
            if shift:
                ku = F.pad(ku, (0, 0, shift, 0))[:, :, :S]
                vu = F.pad(vu, (0, 0, shift, 0))[:, :, :S]
            scores.append(((q * ku).sum(-1) * scale).unsqueeze(-1))  # [B, h, S, 1]
            values.append(vu)
        p = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        out = p[..., :S] @ v0
        for u, vu in enumerate(values):
            out = out + p[..., S + u : S + u + 1] * vu
        return out.transpose(1, 2).reshape(b * S, -1)


def unrolled(head: nn.Module, feats: Features, steps: int, noise: float = 0.0,
             gen: torch.Generator | None = None) -> list[torch.Tensor]:
    """The head's outputs [B, S, H] for unrolled steps ``0..steps-1`` on windows of ``S + 1`` tokens."""
    tokens = feats.tokens
    b, s = tokens.shape[0], tokens.shape[1] - 1
    feature = head.project(feats.hidden[:, :s], None if feats.aux is None else feats.aux[:, :s])
    if noise:
        u = torch.rand(feature.shape, generator=gen) * (2 * noise) - noise
        feature = feature + u.to(feature.dtype)
    inp = tokens[:, 1:].reshape(-1)  # row i: x_{i+1}
    cos, sin = head._rope(torch.arange(s).repeat(b), s - 1)
    attend = UnrolledAttend(b, s)
    outs = []
    x = feature.reshape(b * s, -1)
    for _ in range(steps):
        h = head.step(inp, x, cos, sin, attend).view(b, s, -1)
        outs.append(h)
        x = F.pad(h, (0, 0, 1, 0))[:, :s].reshape(b * s, -1)  # row i <- the chain's h at row i - 1
    return outs


class HeadRecipe:
    """An EAGLE-1 or EAGLE-3 head, its loss, held-out figures and output."""

    def __init__(self, rc: RecipeConfig, target: LlamaDecoder, train_stream: torch.Tensor, seed: int) -> None:
        from specdec.models.eagle import EagleHeadConfig, new_head

        self.rc = rc
        self.kind = rc.recipe
        tcfg: LlamaConfig = target.config
        self.target = target
        self.info: dict[str, Any] = {}
        probe = EagleHeadConfig.from_target(self.kind, tcfg, aux_layers=tuple(rc.aux_layers) if rc.aux_layers else None)
        aux = probe.fused_layers(tcfg.num_hidden_layers) if self.kind == "eagle3" else None
        hcfg = EagleHeadConfig.from_target(self.kind, tcfg, draft_vocab_size=rc.draft_vocab_size,
                                           aux_layers=aux, fc_bias=rc.fc_bias)
        self.capture: tuple[int, ...] = tuple(aux or ())
        self.head = new_head(hcfg, seed)
        self.head.attach_target(target.model.embed_tokens, target.lm_head)
        if self.kind == "eagle3":
            n = hcfg.num_draft_vocab
            ids, share = top_tokens(train_stream, n, tcfg.vocab_size)
            self.head.set_draft_vocab(ids)
            self.info["draft_vocab"] = {"size": n, "rule": f"the {n} most frequent token ids of the train "
                                        "stream (ties: lower id), sorted", "train_token_coverage": round(share, 5)}
        self.info["aux_layers"] = list(self.capture)
        if rc.init_from:
            self._init_from_checkpoint(Path(rc.init_from))
            if self.kind == "eagle3":  # the loaded head's draft vocabulary (d2t, t2d) replaced the stream's:
                n = hcfg.num_draft_vocab  # re-set through set_draft_vocab, so its cached id map follows
                self.head.set_draft_vocab(torch.arange(n) + self.head.d2t)
                share = float(self.head.t2d[train_stream].float().mean()) if train_stream.numel() else 0.0
                self.info["draft_vocab"] = {"size": n, "rule": f"train.init_from's draft vocabulary ({n} ids, "
                                            "kept with its lm_head)", "train_token_coverage": round(share, 5)}
        elif rc.init_from_target:
            self._init_from_target()
        for p in target.parameters():
            p.requires_grad_(False)

    @property
    def module(self) -> nn.Module:
        return self.head

    def _init_from_checkpoint(self, path: Path) -> None:
        """Starts from a saved head of the same kind and shape (``train.init_from``): fine-tuning."""
        from specdec.core.checkpoint import load_decoder
        from specdec.core.registry import Role

        src = load_decoder(path, role=Role.DRAFT_HEAD, dtype=torch.float32).module
        if type(src) is not type(self.head) or src.config.fused_layers(self.target.config.num_hidden_layers) != \
                self.head.config.fused_layers(self.target.config.num_hidden_layers):
            raise ValueError(f"train.init_from={str(path)!r} is a {type(src).__name__} fusing "
                             f"{getattr(src.config, 'aux_layers', None)}; this run trains a {type(self.head).__name__} "
                             f"fusing {list(self.capture)} (set train.aux_layers to match, or train.init_from=null)")
        mine = self.head.state_dict()
        theirs = src.state_dict()
        bad = sorted(k for k in theirs if k not in mine or mine[k].shape != theirs[k].shape)
        if bad:
            raise ValueError(f"train.init_from={str(path)!r}: tensors that do not fit this head: {', '.join(bad[:5])}"
                             + (" (train.draft_vocab_size?)" if any("lm_head" in k or "d2t" in k for k in bad) else ""))
        with torch.no_grad():
            self.head.load_state_dict(theirs, strict=False)
        self.info["init"] = [f"every tensor of {path} (fine-tuning)"]

    def _init_from_target(self) -> None:
        """Starts the head's layer from the target's last layer (and EAGLE-3's norm and lm_head
        from the target's final norm and lm_head rows of the draft vocabulary)."""
        t = self.target
        last = t.model.layers[-1]
        done = []
        with torch.no_grad():
            if self.kind == "eagle":
                sd = {k: v for k, v in last.state_dict().items() if not k.startswith("input_layernorm")}
                self.head.layers[0].load_state_dict(sd, strict=False)
                done.append(f"layers.0 <- target layer {t.config.num_hidden_layers - 1} (no input_layernorm)")
            else:
                mid = self.head.midlayer
                mid.mlp.load_state_dict(last.mlp.state_dict())
                mid.post_attention_layernorm.load_state_dict(last.post_attention_layernorm.state_dict())
                mid.self_attn.o_proj.load_state_dict(last.self_attn.o_proj.state_dict())
                h = t.config.hidden_size
                for name in ("q_proj", "k_proj", "v_proj"):  # [emb; hidden] -> the hidden half from the target
                    w = getattr(mid.self_attn, name).weight
                    w[:, h:] = getattr(last.self_attn, name).weight
                    w[:, :h] *= 0.5
                # fc stays random (small): started as the identity on the highest fused layer's input,
                # the head predicted that layer's next token (x_{t+1}, already known) and was slow to unlearn it
                self.head.norm.weight.copy_(t.model.norm.weight)
                self.head.lm_head.weight.copy_(t.lm_head.weight[self.head.draft_to_target])
                done.append(f"midlayer mlp, o_proj, post_attention_layernorm and the hidden half of q/k/v <- "
                            f"target layer {t.config.num_hidden_layers - 1}; fc random; "
                            "norm <- the target's final norm; "
                            "lm_head <- the target's lm_head rows of the draft vocabulary")
        self.info["init"] = done

    # -- training --------------------------------------------------------------------------
    def _step_loss(self, h: torch.Tensor, feats: Features, tlogits: torch.Tensor, s: int) -> dict[str, torch.Tensor]:
        """Loss terms of unrolled step ``s`` (rows ``i >= s``)."""
        rows = slice(s, None)
        h = h[:, rows]
        if not isinstance(tlogits, tuple):
            t_next = tlogits[:, 1:][:, rows].float()  # target logits at i + 1: the distribution of x_{i+2}
        if isinstance(tlogits, tuple):  # (logits over the draft vocabulary, target argmax inside it)
            t_next = tlogits[0][:, 1:][:, rows].float()
            scored = tlogits[1][:, 1:][:, rows]
        else:
            scored = torch.ones(t_next.shape[:-1], dtype=torch.bool)
        logq = F.log_softmax(self.head.logits(h).float(), dim=-1)
        p = F.softmax(t_next, dim=-1)
        if self.rc.ce_target == "argmax":
            ce_rows = -logq.gather(-1, p.argmax(-1, keepdim=True)).squeeze(-1)
        else:
            ce_rows = -(p * logq).sum(-1)
        w = scored.float()
        ce = (ce_rows * w).sum() / w.sum().clamp(min=1)
        acc = ((logq.argmax(-1) == p.argmax(-1)).float() * w).sum() / w.sum().clamp(min=1)
        out = {"ce": ce, "acc": acc}
        if self.rc.feature_weight:
            f_next = feats.hidden[:, 1:][:, rows]
            out["reg"] = F.smooth_l1_loss(h.float(), f_next.float())
        return out

    @torch.no_grad()
    def _target_logits(self, hidden: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The target's logits; with a smaller draft vocabulary, (its rows of them, whether the
        target's argmax lies inside it), without the full product where the argmax needs none."""
        d2t = self.head.draft_to_target
        w = self.target.lm_head.weight
        if d2t.numel() == w.shape[0]:
            return self.target.lm_head(hidden)
        full = self.target.lm_head(hidden)
        return full.index_select(-1, d2t), self.head.t2d[full.argmax(-1)]

    def loss(self, feats: Features, gen: torch.Generator | None) -> tuple[torch.Tensor, dict[str, float]]:
        rc = self.rc
        tlogits = self._target_logits(feats.hidden)
        hs = unrolled(self.head, feats, rc.ttt_steps, rc.feature_noise, gen)
        total = torch.zeros(())
        metrics: dict[str, float] = {}
        for s, h in enumerate(hs):
            terms = self._step_loss(h, feats, tlogits, s)
            step_loss = rc.ce_weight * terms["ce"]
            if "reg" in terms:
                step_loss = step_loss + rc.feature_weight * terms["reg"]
                metrics[f"reg_{s}"] = float(terms["reg"].detach())
            total = total + rc.step_decay**s * step_loss
            metrics[f"ce_{s}"] = float(terms["ce"].detach())
            metrics[f"acc_{s}"] = float(terms["acc"].detach())
        return total, metrics

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, feats: Features, module: nn.Module | None = None) -> dict[str, float]:
        """The loss on held-out ``feats`` (of ``module``, e.g. the saved weights read back; default: the trained one)."""
        live = self.head
        self.head = module or live
        was = self.head.training
        self.head.eval()
        try:
            loss, m = self.loss(feats, None)
        finally:
            self.head.train(was)
            self.head = live
        return {"loss": float(loss), **m}

    @torch.no_grad()
    def tau(self, ev: EvalSet, gamma: int, head: nn.Module | None = None) -> dict[str, float]:
        """Simulated greedy chain speculation at ``gamma`` on the held-out set (see module doc)."""
        head = head or self.head
        was = head.training
        head.eval()
        feats = ev.features
        hs = unrolled(head, feats, gamma)
        parts = []
        for n, (prompt_len, length) in enumerate(ev.rows()):
            seq = feats.tokens[n, :length]
            ok = torch.zeros(length - 1, gamma, dtype=torch.bool)
            for s, h in enumerate(hs):
                pred = head.draft_to_target[head.logits(h[n, :length]).argmax(-1)]  # row i predicts x_{i+2}
                # chain r, step s sits at row r + s and predicts x_{r+s+2}
                m = length - 2 - s
                if m > 0:
                    ok[:m, s] = pred[s : s + m] == seq[s + 2 : s + 2 + m]
            parts.append(chain_tau(ok, prompt_len, gamma))
        head.train(was)
        return tau_summary(parts, gamma)

    # -- output ------------------------------------------------------------------------------
    def save(self, out_dir: Path, target_dir: Path) -> list[Path]:
        from specdec.models.eagle import save_head

        return save_head(self.head, out_dir, tokenizer_dir=target_dir,
                         num_target_layers=self.target.config.num_hidden_layers)

    def load_saved(self, out_dir: Path) -> nn.Module:
        """The saved head read back through the loader, attached to the target (fp32)."""
        from specdec.core.checkpoint import load_decoder
        from specdec.core.registry import Role

        head = load_decoder(out_dir, role=Role.DRAFT_HEAD, dtype=torch.float32).module
        head.attach_target(self.target.model.embed_tokens, self.target.lm_head)
        head.prepare_for_inference()
        return head
