"""``python -m specdec.train``: train a drafter for a target inside the framework.

    python -m specdec.train train=eagle3                               # EAGLE-3 head for the built-in target
    python -m specdec.train train=eagle target.path=/ckpt/target data.corpus=/data/code data.pattern='*.py'
    python -m specdec.train train=draft_model train.layers=2          # a distilled draft model
    python -m specdec.train train=eagle3 train.steps=50 stop_after=20 # stops after 20 steps, saved
    python -m specdec.train resume_dir=outputs/train/eagle3/<stamp>_<uid>   # continue it in place
    python -m specdec.train logger=none | logger.mode=online

A run reads a text corpus, splits it (held-out files by a fixed rule), runs
the frozen target over the train windows (its hidden states and
distributions, on the fly or cached on disk in chunks: ``data.cache_dir``) and
trains the recipe's module (``train/``: ``draft_model``, ``eagle``,
``eagle3``). Loss curves go to the console (a bar on a terminal, else a line
every few seconds) and to W&B (offline by default; never blocks or stops the
run); per epoch and every ``eval.every`` steps the held-out loss and the
simulated τ at ``eval.gamma`` (greedy chain speculation on the target's own
continuations of held-out prompts) are logged too.

Every ``checkpoint_every`` steps (and at the end, at ``stop_after``, on
Ctrl-C / SIGTERM) ``train_state.safetensors`` in the run dir is rewritten
atomically: the module, optimizer, RNG state and step (the step fixes the data
cursor: batch ``g`` is a function of the seed and ``g``), tensors plus JSON,
never a pickle (:mod:`specdec.train.state`). ``resume_dir=<run dir>``
continues it; a resumed run ends with the same weights as an uninterrupted
one. The result goes to ``out_dir`` (default ``<run dir>/out``; a non-empty
one only with ``overwrite=true``, replaced whole: built in a temporary
directory and renamed into place) in the published layout (an EAGLE head:
``config.json`` + ``model.safetensors``, bf16; a draft model: a Hugging Face
Llama checkpoint) with ``tokenizer.json`` and
``manifest.json`` (recipe, seed, data split and counts, loss curves, held-out
τ of the saved weights, sha256 of every file, wall time, torch, threads).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from specdec.logging.progress import Progress, fmt_duration
from specdec.train.config import TrainAppConfig, TrainConfigError, to_plain, to_train_config
from specdec.train.state import (TrainError, apply_state, check_out_dir, read_state, read_tensors, save_state,
                                 staged_dir, write_tensors)

log = logging.getLogger(__name__)

STATE_FILE = "train_state.safetensors"
PICKLED_STATE_FILE = "train_state.pt"  # older specdec's pickle: refused, never read
CONFIG_FILE = "train_config.json"
HISTORY_FILE = "history.jsonl"
MANIFEST = "manifest.json"
PREFIX = "specdec.train"
# Config keys a resumed run may change (everything else must match the saved run's).
RESUMABLE_CHANGES = ("stop_after", "resume", "resume_dir", "run_dir", "logger", "progress", "threads",
                     "out_dir", "overwrite", "data.cache_dir", "checkpoint_every", "eval")


class Stopped(Exception):
    """The run stopped at ``stop_after`` with its state saved."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as an interrupt so the state is saved."""


# --------------------------------------------------------------------------------------------
# console progress and the run logger
# --------------------------------------------------------------------------------------------
def train_progress(total: int, done: int, *, enabled: bool = True) -> Progress:
    """Steps done of ``total``: the experiment's progress (a bar on a terminal, else a line
    every few seconds), counting steps as ``specdec.train``."""
    return Progress(total, done, enabled=enabled, noun="step", unit="step", prefix=PREFIX)


def build_train_logger(cfg: TrainAppConfig) -> Any:
    """The run logger ``logger.name`` selects, with a ``log_step(metrics, step)`` method."""
    from specdec.logging import NullLogger, WandbLogger

    class NullTrainLogger(NullLogger):
        def log_step(self, metrics: Mapping[str, Any], step: int) -> None:
            pass

    class WandbTrainLogger(WandbLogger):
        """W&B with training curves: ``train/*`` and ``eval/*`` against ``train/step``."""

        def log_step(self, metrics: Mapping[str, Any], step: int) -> None:
            if not self.active:
                return
            with self._guard("log"):
                if "train/step" not in self._defined:
                    self.run.define_metric("train/step", hidden=True)
                    self.run.define_metric("train/*", step_metric="train/step")
                    self.run.define_metric("eval/*", step_metric="train/step")
                    self._defined.add("train/step")
                # No step=: W&B's own step keeps counting across a resume; train/step is the axis.
                self.run.log({**{k: v for k, v in metrics.items() if v is not None}, "train/step": step})

    return (WandbTrainLogger if cfg.logger.name == "wandb" else NullTrainLogger)(cfg.logger)


# --------------------------------------------------------------------------------------------
# state: resume
# --------------------------------------------------------------------------------------------
def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, Mapping):
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out


def config_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """Keys whose values differ between the saved run config and this one (that may not)."""
    a, b = _flat(saved), _flat(now)
    bad = []
    for k in sorted(set(a) | set(b)):
        if any(k == p or k.startswith(p + ".") for p in RESUMABLE_CHANGES):
            continue
        if a.get(k) != b.get(k):
            bad.append(f"{k}: {a.get(k)!r} -> {b.get(k)!r}")
    return bad


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` (main thread only), so the state is saved."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Terminated("SIGTERM")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def lr_at(step: int, steps: int, lr: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to ``min_ratio · lr`` at ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------
GENERATED_FILE = "generated.safetensors"


def _generated_before(path: Path, key: list[Any], names: set[str]) -> dict[str, torch.Tensor] | None:
    """The tensors of the self-distillation text file ``path`` where an earlier run of this run
    dir made them with the same ``key`` and they hold ``names``; None: make them again."""
    if not path.is_file():
        return None
    tensors, meta = read_tensors(path, "self-distillation text")
    return tensors if meta.get("key") == key and names <= set(tensors) else None


def self_distillation_text(cfg: TrainAppConfig, target_dir: Path, train_ids: torch.Tensor, sep: int,
                           run_dir: Path, progress: Progress) -> torch.Tensor:
    """``data.generate``'s documents (:func:`specdec.train.data.generated_documents`), made once
    per run dir: a resumed run reads them back from ``generated.safetensors``."""
    from specdec.train import data as D

    g = cfg.data.generate
    path = run_dir / GENERATED_FILE
    key = [g.prompts, g.prompt_len, g.new_tokens, int(train_ids.numel()), int(train_ids.sum())]
    made = _generated_before(path, key, {"tokens"})
    if made is not None:
        progress.line(f"self-distillation text: {made['tokens'].numel():,} tokens from {path}")
        return made["tokens"]
    t0 = time.perf_counter()
    with progress.phase(f"self-distillation text: {g.prompts} windows x {g.new_tokens} greedy tokens"):
        tokens = D.generated_documents(target_dir, train_ids, g, sep)
    write_tensors(path, {"tokens": tokens}, {"key": key})
    progress.line(f"self-distillation text: {tokens.numel():,} tokens in {fmt_duration(time.perf_counter() - t0)}")
    return tokens


def chat_text(cfg: TrainAppConfig, target: Path, split: Any, run_dir: Path,
              progress: Progress) -> tuple[list[tuple[list[int], list[int]]], list[tuple[list[int], list[int]]]]:
    """``data.corpus=instructions``: (prompt ids, greedy answer ids) of the train and held-out requests
    (:func:`specdec.train.data.chat_answers`, one engine run for both), made once per run dir:
    a resumed run reads them back from ``generated.safetensors``."""
    from specdec.train import data as D

    g = cfg.data.generate
    path = run_dir / GENERATED_FILE
    texts = [t for _, t in split.train] + [t for _, t in split.held_out]
    key = ["instructions", hashlib.sha256("\n".join(texts).encode()).hexdigest(), g.prompt_len, g.new_tokens,
           sha256(target) if target.is_file() else str(target)]
    tensors = _generated_before(path, key, {"tokens", "prompt_lens", "answer_lens"})
    if tensors is not None:
        progress.line(f"self-distillation text: {len(texts)} requests and answers from {path}")
    else:
        t0 = time.perf_counter()
        with progress.phase(f"self-distillation text: {len(texts)} requests x up to {g.new_tokens} greedy tokens"):
            pairs = D.chat_answers(target, texts, g)
        tensors = {"tokens": torch.tensor([t for p, a in pairs for t in (*p, *a)], dtype=torch.long),
                   "prompt_lens": torch.tensor([len(p) for p, _ in pairs]),
                   "answer_lens": torch.tensor([len(a) for _, a in pairs])}
        write_tensors(path, tensors, {"key": key})
        progress.line(f"self-distillation text: {int(tensors['answer_lens'].sum()):,} answer tokens in "
                      f"{fmt_duration(time.perf_counter() - t0)}")
    pairs, at = [], 0
    for p, a in zip(tensors["prompt_lens"].tolist(), tensors["answer_lens"].tolist()):
        seq = tensors["tokens"][at : at + p + a].tolist()
        pairs.append((seq[:p], seq[p:]))
        at += p + a
    n = len(split.train)
    return pairs[:n], pairs[n:]


def make_recipe(cfg: TrainAppConfig, target: Any, train_stream: torch.Tensor) -> Any:
    if cfg.train.recipe == "draft_model":
        from specdec.train.draft import DraftRecipe

        return DraftRecipe(cfg.train, target, train_stream, cfg.seed)
    if cfg.train.recipe == "medusa":
        from specdec.train.medusa import MedusaRecipe

        return MedusaRecipe(cfg.train, target, train_stream, cfg.seed)
    from specdec.train.eagle import HeadRecipe

    return HeadRecipe(cfg.train, target, train_stream, cfg.seed)


def _optimizer(module: torch.nn.Module, cfg: TrainAppConfig) -> torch.optim.Optimizer:
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=tuple(cfg.train.betas))


def train(cfg: TrainAppConfig, run_dir: str | Path) -> dict[str, Any]:
    """One training run in ``run_dir`` (resumed from its state when ``cfg.resume``); returns the
    manifest. Raises :class:`Stopped` at ``stop_after`` (state saved), ``KeyboardInterrupt`` on
    Ctrl-C / SIGTERM (state saved), :class:`TrainError` when it cannot start."""
    from specdec.core.checkpoint import load_decoder, load_tokenizer
    from specdec.train import data as D

    cfg = to_train_config(cfg)
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resume = cfg.resume or cfg.resume_dir is not None
    state_path = run_dir / STATE_FILE
    plain = to_plain(cfg)
    state: dict[str, Any] | None = None
    out = Path(cfg.out_dir) if cfg.out_dir else run_dir / "out"
    if out.resolve() == run_dir.resolve() or out.resolve() in run_dir.resolve().parents:
        raise TrainError(f"out_dir {out} holds the run dir {run_dir} (the output replaces out_dir whole)")
    # A resumed run may replace its own default output; any other non-empty out_dir needs overwrite=true.
    replace_out = cfg.overwrite or (resume and not cfg.out_dir)
    check_out_dir(out, overwrite=replace_out)
    pickled = run_dir / PICKLED_STATE_FILE
    if pickled.exists():
        raise TrainError(f"{pickled}: a pickled training state (older specdec) is never loaded, as unpickling "
                         f"can run code; start the run again in a new run dir")
    if resume:
        if not state_path.is_file():
            raise TrainError(f"resume: no {STATE_FILE} in {run_dir} (nothing to continue)")
        try:
            saved = json.loads((run_dir / CONFIG_FILE).read_text())
        except (OSError, ValueError) as e:
            raise TrainError(f"{run_dir / CONFIG_FILE}: not a readable run config ({e})") from None
        if not isinstance(saved, dict):
            raise TrainError(f"{run_dir / CONFIG_FILE}: not a readable run config (not a JSON object)")
        bad = config_changes(saved, plain)
        if bad:
            raise TrainError("resume: the config differs from the saved run's in " + "; ".join(bad))
        state = read_state(state_path)
    else:
        if state_path.is_file():
            raise TrainError(f"{run_dir} holds a run already ({STATE_FILE}); continue it with "
                             f"resume_dir={run_dir}, or choose another run dir")
        (run_dir / CONFIG_FILE).write_text(json.dumps(plain, indent=2) + "\n")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    progress = train_progress(cfg.train.steps, int(state["step"]) if state else 0, enabled=cfg.progress)
    rc = cfg.train

    # --- target, corpus, streams ------------------------------------------------------------
    from specdec.core.gguf import is_gguf
    from specdec.zoo_fetch import resolve_target

    target_dir = Path(resolve_target(cfg.target.path or ""))  # a fetchable name (target=smollm2): its cached file
    if not (is_gguf(target_dir) or (target_dir / "config.json").is_file()):
        raise TrainError(f"target.path={cfg.target.path!r} is neither a checkpoint directory (no config.json) "
                         f"nor a .gguf file")
    chat = cfg.data.corpus == "instructions"
    progress.line(f"{rc.recipe}: loading target {target_dir}")
    target = load_decoder(target_dir, dtype=torch.float32).module.eval()
    tok = load_tokenizer(target_dir, vocab_size=target.config.vocab_size)
    t0 = time.perf_counter()
    sep = D.document_separator(tok, target.config.bos_token_id, target.config.eos_token_id)
    generated = None
    held_pairs = None
    if chat:  # a chat target's own answers to generated requests: the training text
        split = D.instruction_split(cfg.data, cfg.seed)
        train_pairs, held_pairs = chat_text(cfg, target_dir, split, run_dir, progress)
        train_ids, held_ids = D.chat_stream(train_pairs, sep), D.chat_stream(held_pairs, sep)
        generated = train_ids
        progress.line(f"requests: {len(split.train)} train / {len(split.held_out)} held out, "
                      f"{train_ids.numel():,} / {held_ids.numel():,} tokens with their answers")
    else:
        split = D.load_corpus(cfg.data)
        train_ids = D.encode(tok, split.train, sep)
        held_ids = D.encode(tok, split.held_out, sep)
        progress.line(f"corpus: {len(split.train)} train / {len(split.held_out)} held-out files, {train_ids.numel():,}"
                      f" / {held_ids.numel():,} tokens ({fmt_duration(time.perf_counter() - t0)})")
    if cfg.data.generate.prompts and not chat:
        generated = self_distillation_text(cfg, target_dir, train_ids, sep, run_dir, progress)
        train_ids = generated if cfg.data.generate.only else torch.cat([train_ids, generated])
    weights = target_dir if is_gguf(target_dir) else target_dir / "model.safetensors"

    torch.manual_seed(cfg.seed)
    recipe = make_recipe(cfg, target, train_ids)
    module = recipe.module
    module.train()
    opt = _optimizer(module, cfg)
    order = D.WindowOrder(train_ids.numel(), rc.seq_len, rc.batch_size, cfg.data.chunk_windows, cfg.seed)
    key = json.dumps([str(target_dir.resolve()), sha256(weights) if weights.is_file() else "", train_ids.numel(),
                      int(train_ids.sum()), rc.seq_len, list(recipe.capture), rc.precision])
    feats = D.TargetFeatures(target, recipe.capture, cache_dir=cfg.data.cache_dir,
                             chunk_windows=cfg.data.chunk_windows, key=key)
    noise_gen = torch.Generator().manual_seed(cfg.seed + 17)
    history: dict[str, Any] = {"train": [], "eval": []}
    step = 0
    wall_before = 0.0
    if state is not None:
        apply_state(state, state_path, module, opt, noise_gen)
        history = state["history"]
        step = int(state["step"])
        wall_before = float(state.get("wall_s", 0.0))
        progress.line(f"resumed at step {step}/{rc.steps} from {state_path}")

    with progress.phase("held-out set (target greedy continuations)"):
        if held_pairs is not None:
            ev = D.chat_eval_set(feats, held_pairs, held_ids, prompts=cfg.eval.prompts,
                                 loss_windows=cfg.eval.loss_windows, seq_len=rc.seq_len, pad=sep)
        else:
            ev = D.eval_set(feats, held_ids, prompts=cfg.eval.prompts, prompt_len=cfg.eval.prompt_len,
                            new_tokens=cfg.eval.new_tokens, loss_windows=cfg.eval.loss_windows, seq_len=rc.seq_len)
    comparison = None
    if cfg.eval.compare_draft:
        from specdec.train.draft import draft_model_tau

        other = load_decoder(cfg.eval.compare_draft, dtype=torch.float32).module.eval()
        comparison = {"path": str(cfg.eval.compare_draft), **draft_model_tau(other, ev, cfg.eval.gamma)}
        progress.line(f"draft model {cfg.eval.compare_draft}: simulated τ@{cfg.eval.gamma} {comparison['tau']:.3f}")
        del other

    logger = build_train_logger(cfg)
    logger.start(name=f"train-{rc.recipe}", run_dir=run_dir, config=plain, resume=resume,
                 tags=(f"recipe:{rc.recipe}", f"target:{target_dir.name}"), job_type="train")

    def checkpoint() -> None:
        save_state(state_path, step=step, module=module, optimizer=opt, torch_rng=torch.get_rng_state(),
                   noise_rng=noise_gen.get_state(), history=history, wall_s=wall_before + time.perf_counter() - t_session)

    def evaluate(kind: str) -> dict[str, Any]:
        row: dict[str, Any] = {"step": step, "epoch": order.epoch_of(max(0, step - 1)), "at": kind}
        if ev.loss_windows is not None:
            row.update({f"heldout_{k}": round(v, 5) for k, v in recipe.eval_loss(ev.loss_windows).items()})
        t = recipe.tau(ev, cfg.eval.gamma)
        row.update({"tau": round(t["tau"], 4), "tau_with_prefill": round(t["tau_with_prefill"], 4),
                    "alpha": round(t["alpha"], 4)})
        history["eval"].append(row)
        logger.log_step({f"eval/{k}": v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}, step)
        progress.line(f"eval at step {step} ({kind}): τ@{cfg.eval.gamma} {row['tau']:.3f}"
                      + (f", held-out loss {row['heldout_loss']:.4f}" if "heldout_loss" in row else ""))
        return row

    def autocast() -> Any:
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16) if rc.precision == "bf16" else nullcontext()

    t_session = time.perf_counter()
    ema: float | None = None
    stopped = updating = False
    try:
        with _sigterm_as_interrupt():
            if step == 0 and not history["eval"]:
                evaluate("start")
            progress.start()
            while step < rc.steps:
                for g in opt.param_groups:
                    g["lr"] = lr_at(step, rc.steps, rc.lr, rc.warmup_steps, rc.min_lr_ratio)
                with autocast():
                    batch = feats.windows(order, train_ids, order.batch(step))
                    loss, metrics = recipe.loss(batch, noise_gen)
                if not torch.isfinite(loss):
                    raise TrainError(f"the loss went non-finite at step {step} ({metrics}); lower train.lr")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                gnorm = None
                if rc.grad_clip:
                    gnorm = float(torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad],
                                                                 rc.grad_clip))
                updating = True  # an interrupt inside opt.step() leaves the last checkpoint as the state
                opt.step()
                updating = False
                epoch_done = (step + 1) % order.batches_per_epoch == 0
                step += 1
                val = float(loss.detach())
                ema = val if ema is None else 0.9 * ema + 0.1 * val
                row = {"step": step, "loss": round(val, 5), "lr": opt.param_groups[0]["lr"],
                       **{k: round(v, 5) for k, v in metrics.items()}}
                if gnorm is not None:
                    row["grad_norm"] = round(gnorm, 4)
                history["train"].append(row)
                logger.log_step({f"train/{k}": v for k, v in row.items() if k != "step"}
                                | {"train/epoch": order.epoch_of(step - 1)}, step)
                acc = metrics.get("acc_0")
                progress.update(1, postfix=f"loss {ema:.4f}" + (f" acc0 {acc:.3f}" if acc is not None else ""))
                if step < rc.steps and (epoch_done or (cfg.eval.every and step % cfg.eval.every == 0)):
                    evaluate("epoch" if epoch_done else "interval")
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < rc.steps:
                    checkpoint()
                if cfg.stop_after is not None and step >= cfg.stop_after and step < rc.steps:
                    checkpoint()
                    stopped = True
                    break
            if not stopped:
                if not (history["eval"] and history["eval"][-1]["step"] == step):
                    evaluate("end")
                checkpoint()
    except KeyboardInterrupt:
        progress.close()
        if not updating:
            checkpoint()
        progress.line(f"interrupted at step {step}: state saved; continue with resume_dir={run_dir}")
        logger.finish()
        raise
    finally:
        progress.close()
    if stopped:
        progress.line(f"stopped after step {step} (stop_after={cfg.stop_after}); continue with resume_dir={run_dir}")
        logger.finish()
        raise Stopped(f"stopped after step {step}; continue with resume_dir={run_dir}")

    # --- the output ---------------------------------------------------------------------------
    wall = wall_before + time.perf_counter() - t_session
    # built in a temporary dir renamed into place: out is the old drafter or the new one, never a mix
    with staged_dir(out, overwrite=replace_out) as stage:
        files = recipe.save(stage, target_dir)
        saved_module = recipe.load_saved(stage)
        shipped_tau = recipe.tau(ev, cfg.eval.gamma, saved_module)
        shipped_loss = None
        if ev.loss_windows is not None:
            import inspect

            if len(inspect.signature(recipe.eval_loss).parameters) >= 2:  # eval_loss(feats, module)
                shipped_loss = recipe.eval_loss(ev.loss_windows, saved_module)
        train_rows = history["train"]
        every = max(1, len(train_rows) // 50)
        curve = [[r["step"], r["loss"]] for r in train_rows if r["step"] % every == 0 or r["step"] == len(train_rows)]
        tail = train_rows[-min(20, len(train_rows)) :]
        manifest = {
            "description": f"{rc.recipe} drafter for {target_dir.name}, trained by python -m specdec.train",
            "recipe": rc.recipe,
            "command": "python -m specdec.train " + " ".join(sys.argv[1:]) if sys.argv[0].endswith(("__main__.py", "app.py"))
            else None,
            "config": plain,
            "seed": cfg.seed,
            "target": {"path": str(target_dir), "name": cfg.target.path,
                       **({"gguf_sha256": sha256(target_dir)} if is_gguf(target_dir)
                          else {"config_sha256": sha256(target_dir / "config.json")}),
                       "layers": target.config.num_hidden_layers, "hidden": target.config.hidden_size,
                       "heads": target.config.num_attention_heads, "kv_heads": target.config.num_key_value_heads,
                       "vocab": target.config.vocab_size},
            "module": {**recipe.info, "params": sum(p.numel() for p in module.parameters())},
            "data": {**split.describe(), "train_tokens": int(train_ids.numel()), "held_out_tokens": int(held_ids.numel()),
                     "generated": None if generated is None else {
                         "tokens": int(generated.numel()), "only": cfg.data.generate.only or chat,
                         "rule": (f"each train request rendered through the target's chat template (one user turn, "
                                  f"generation prompt) and answered greedily by the target, up to "
                                  f"{cfg.data.generate.new_tokens} tokens or EOS; separator, prompt, answer") if chat
                         else (f"{cfg.data.generate.prompts} windows of {cfg.data.generate.prompt_len} train-stream "
                               f"tokens (starts evenly spaced), each continued greedily by the target for up to "
                               f"{cfg.data.generate.new_tokens} tokens; separator, window, continuation")},
                     "document_format": f"token {sep} before each document, documents concatenated in order",
                     "windows": {"train_windows": order.num_windows, "seq_len": rc.seq_len,
                                 "batches_per_epoch": order.batches_per_epoch,
                                 "order": f"per epoch: chunks of {cfg.data.chunk_windows} windows in a seeded random "
                                          "order, windows shuffled within each chunk",
                                 "epochs_seen": round(step / order.batches_per_epoch, 3),
                                 "tokens_seen": step * rc.batch_size * rc.seq_len},
                     "features": "cached on disk in chunks" if cfg.data.cache_dir else "computed on the fly",
                     "heldout_eval": ev.describe()},
            "losses": {"first": train_rows[0] if train_rows else None,
                       "final_mean_last_20": {k: round(sum(r[k] for r in tail) / len(tail), 5)
                                              for k in tail[0] if k not in ("step", "lr")} if tail else None,
                       "curve": curve, "eval": history["eval"]},
            "heldout": {"gamma": cfg.eval.gamma, "tau_rule": "tokens per target call after the prefill, greedy "
                        "chain speculation simulated on the target's own greedy continuations of held-out prompts",
                        "final_fp32": history["eval"][-1] if history["eval"] else None,
                        "shipped": {"tau": round(shipped_tau["tau"], 4),
                                    "tau_with_prefill": round(shipped_tau["tau_with_prefill"], 4),
                                    "alpha": round(shipped_tau["alpha"], 4),
                                    **({"loss": round(shipped_loss["loss"], 5)} if shipped_loss else {}),
                                    # a recipe whose drafter builds static trees from ranks (Medusa) measures one
                                    **({"static_tree": shipped_tau["static_tree"]} if "static_tree" in shipped_tau else {})},
                        "draft_model_same_prompts": comparison},
            "environment": {"python": platform.python_version(), "torch": torch.__version__,
                            "threads": torch.get_num_threads(), "machine": platform.machine()},
            "wall_time_s": round(wall, 1),
            "steps": step,
            "files": {p.name: {"sha256": sha256(p), "bytes": p.stat().st_size} for p in sorted(files)},
        }
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    files = [out / p.name for p in files]
    logger.log_summary({"heldout": manifest["heldout"], "wall_time_s": manifest["wall_time_s"], "steps": step})
    logger.log_table("loss_curve", ["step", "loss"], curve)
    logger.log_artifact(f"{rc.recipe}-drafter", "model", {p.name: p for p in [*files, out / MANIFEST]},
                        metadata={"tau": manifest["heldout"]["shipped"]["tau"]})
    logger.finish()
    size = sum(p.stat().st_size for p in files)
    progress.line(f"wrote {out} ({size / 2**20:.2f} MiB): τ@{cfg.eval.gamma} {shipped_tau['tau']:.3f} "
                  f"(saved weights), {step} steps in {fmt_duration(wall)}"
                  + (f"; draft model on the same prompts {comparison['tau']:.3f}" if comparison else ""))
    return manifest


# --------------------------------------------------------------------------------------------
# Hydra entry point
# --------------------------------------------------------------------------------------------
def _fail(what: str, e: BaseException, code: int) -> SystemExit:
    print(f"{PREFIX}: {what}" + (f": {e}" if str(e) else ""), file=sys.stderr, flush=True)
    return SystemExit(code)


def run_from_hydra(cfg: Any) -> dict[str, Any] | None:
    """The composed config in Hydra's run dir (or ``run_dir=``)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        tc = to_train_config(cfg)
        run_dir = Path(tc.run_dir) if tc.run_dir else Path(HydraConfig.get().runtime.output_dir)
        return train(tc, run_dir)
    except (TrainConfigError, TrainError, FileNotFoundError) as e:
        raise _fail("error", e, 2) from None
    except Stopped as e:
        print(f"{PREFIX}: {e}", file=sys.stderr, flush=True)
        return None
    except KeyboardInterrupt as e:
        raise _fail("interrupted", e, 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)) from None


def _check_overrides(args: list[str], config_path: str) -> None:
    """Composes the config once before Hydra does, so a key or value that does not fit the
    schema (``train.lr=abc``, a misspelt key) ends as every other bad input: ``specdec.train:
    error: …`` naming the key, exit 2. Command lines with flags (``-m``, ``--cfg``…) are Hydra's."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    if any(a.startswith("-") for a in args):
        return
    try:
        with initialize_config_dir(config_dir=config_path, version_base="1.3"):
            compose(config_name="train", overrides=args)
    except ConfigCompositionException as e:
        why = [line.strip() for line in str(e.__cause__ or "").splitlines() if line.strip()]
        raise _fail("error", RuntimeError(" ".join([str(e).splitlines()[0], *why[:2]])), 2) from None


def main() -> None:
    """``python -m specdec.train`` (arguments: Hydra overrides)."""
    import hydra

    from specdec.conf_schema import config_dir  # also registers the zoo / uid / or_else resolvers
    from specdec.train.config import register_schema

    os.environ.setdefault("WANDB_SILENT", "true")
    register_schema()
    _check_overrides(sys.argv[1:], str(config_dir()))
    app = hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")(run_from_hydra)
    app()


__all__ = ["Stopped", "TrainError", "main", "train", "train_progress"]
