"""Training data for the ``python -m specdec.train`` recipes: a text corpus run through the target.

- :func:`load_corpus` — the corpus (the Python stdlib, a directory of files, or one
  text file) split into train and held-out parts by a deterministic rule;
- :func:`encode` — one token stream per part, through the target's tokenizer;
- :class:`WindowOrder` — which windows of the train stream batch ``g`` holds:
  a function of ``(seed, g)`` only, so a resumed run reads exactly the batches
  an uninterrupted one would (the step *is* the data cursor);
- :class:`TargetFeatures` — the frozen target's outputs on a batch of windows:
  final-norm hidden states (EAGLE-1's features; the target's logits are
  ``lm_head`` of them) and the inputs of the layers an EAGLE-3 head fuses;
  computed on the fly, or once per chunk of windows and cached on disk
  (``data.cache_dir``);
- :func:`generated_documents` — self-distillation text (``data.generate``): train
  windows continued greedily by the target through the engine;
- :func:`chat_answers` — for a chat target (``data.corpus=instructions``): generated
  user requests (:mod:`specdec.train.instructions`) rendered through its chat template
  and answered greedily by it; the answers are the training text;
- :func:`eval_set` — held-out prompts with the target's greedy continuations,
  on which a recipe simulates greedy chain speculation (τ).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.models.llama import DenseCausalAttend, LlamaDecoder
from specdec.train import corpus as stdlib_corpus


@dataclass
class GenerateConfig:
    """``data.generate.*``: self-distillation text, the target's own greedy continuations of
    train-stream windows, added to the train stream (or, ``only``, in its place). A head
    then trains on the text it will draft for at run time: the target's outputs."""

    prompts: int = 0  # windows continued (0: none; evenly spaced over the train stream); data.corpus=instructions:
    # the user requests made (train and held out), answered up to new_tokens, rendered to <= prompt_len tokens
    prompt_len: int = 128  # tokens per prompt window
    new_tokens: int = 128  # greedy tokens per prompt (fewer where the target emits EOS)
    batch_size: int = 32  # requests the engine runs at once
    only: bool = False  # train on the generated documents alone (no corpus text)

    def __post_init__(self) -> None:
        for key in ("prompts", "prompt_len", "new_tokens", "batch_size"):
            if getattr(self, key) < (0 if key == "prompts" else 1):
                raise ValueError(f"data.generate.{key} must be >= {0 if key == 'prompts' else 1}, "
                                 f"got {getattr(self, key)}")


@dataclass
class DataConfig:
    """``data.*``: the corpus, its split, and where target features come from."""

    corpus: str = "stdlib"  # "stdlib" (the running Python's standard library), a directory, a text file, or
    # "instructions": data.generate.prompts generated user requests, rendered through the target's chat template
    # and answered greedily by it (a chat target's self-distillation text; the held-out requests give τ)
    pattern: str = "*.py"  # files of a directory corpus (recursive glob; comma-separated patterns)
    held_out_modulus: int = 20  # 1 file in N held out, by sha256 of its relative path
    max_files: int | None = None  # cap on train files (quick runs; held out: max(1, max_files // 10))
    cache_dir: str | None = None  # target features cached here in chunks (None: computed on the fly)
    chunk_windows: int = 64  # windows per shuffling / cache chunk
    generate: GenerateConfig = field(default_factory=GenerateConfig)  # self-distillation text (off by default)

    def __post_init__(self) -> None:
        if self.held_out_modulus < 2:
            raise ValueError(f"data.held_out_modulus must be >= 2, got {self.held_out_modulus}")
        if self.chunk_windows < 1:
            raise ValueError(f"data.chunk_windows must be >= 1, got {self.chunk_windows}")


@dataclass
class Split:
    """The corpus' two parts (documents as ``(name, text)``) and how they were split."""

    train: list[tuple[str, str]]
    held_out: list[tuple[str, str]]
    rule: str
    root: str

    def describe(self) -> dict[str, Any]:
        return {"root": self.root, "rule": self.rule, "train_files": len(self.train),
                "held_out_files": len(self.held_out),
                "train_bytes": sum(len(t.encode()) for _, t in self.train),
                "held_out_bytes": sum(len(t.encode()) for _, t in self.held_out)}


def load_corpus(cfg: DataConfig) -> Split:
    """The corpus ``cfg.corpus`` split into train and held-out documents (deterministic)."""
    modulus = cfg.held_out_modulus
    if cfg.corpus == "stdlib":
        root = stdlib_corpus.stdlib_root()
        train, held = stdlib_corpus.load_split(root, modulus=modulus, max_files=cfg.max_files)
        rule = (f"stdlib .py files (no {', '.join(sorted(stdlib_corpus.EXCLUDED_DIRS))} dirs); held out when "
                f"int(sha256(relative_path).hexdigest()[:8], 16) % {modulus} == 0")
        if cfg.max_files is not None:
            rule += f"; first {cfg.max_files} train / {max(1, cfg.max_files // 10)} held-out files"
        return Split([(f.rel_path, f.text) for f in train], [(f.rel_path, f.text) for f in held], rule, str(root))
    path = Path(cfg.corpus)
    if path.is_file():
        lines = path.read_bytes().decode("utf-8", errors="replace").splitlines(keepends=True)
        cut = max(1, len(lines) - max(1, len(lines) // modulus))
        return Split([(path.name, "".join(lines[:cut]))], [(path.name + ":tail", "".join(lines[cut:]))],
                     f"one file: its last max(1, lines // {modulus}) lines held out", str(path.resolve()))
    if not path.is_dir():
        raise FileNotFoundError(f"data.corpus={cfg.corpus!r} is neither 'stdlib', a directory nor a file")
    patterns = [p.strip() for p in cfg.pattern.split(",") if p.strip()]
    rels = sorted({f.relative_to(path).as_posix() for p in patterns for f in path.rglob(p) if f.is_file()})
    docs = [(r, (path / r).read_bytes().decode("utf-8", errors="replace")) for r in rels]
    docs = [(r, t) for r, t in docs if t.strip()]
    if len(docs) < 2:
        raise ValueError(f"data.corpus={cfg.corpus!r}: {len(docs)} non-empty file(s) match {cfg.pattern!r}; need 2+")
    held = [d for d in docs if stdlib_corpus.is_held_out(d[0], modulus)]
    train = [d for d in docs if not stdlib_corpus.is_held_out(d[0], modulus)]
    rule = f"{cfg.pattern} under the directory; held out when int(sha256(relative_path)[:8], 16) % {modulus} == 0"
    if not held:  # a tiny corpus: no file fell in the bucket
        held, train = train[-1:], train[:-1]
        rule += " (none did: the last file in path order is held out)"
    if cfg.max_files is not None:
        train, held = train[: cfg.max_files], held[: max(1, cfg.max_files // 10)]
        rule += f"; first {cfg.max_files} train / {max(1, cfg.max_files // 10)} held-out files"
    return Split(train, held, rule, str(path.resolve()))


def instruction_split(cfg: DataConfig, seed: int) -> Split:
    """``data.corpus=instructions``: ``data.generate.prompts`` user requests (deterministic from
    ``seed``), held out by the zoo's rule (sha256 of the text)."""
    from specdec.train.instructions import instructions

    n, modulus = cfg.generate.prompts, cfg.held_out_modulus
    if n < 2:
        raise ValueError(f"data.corpus=instructions needs data.generate.prompts >= 2 (the requests made), got {n}")
    docs = [(f"request-{i}", t) for i, t in enumerate(instructions(n, seed))]
    held = [d for d in docs if stdlib_corpus.is_held_out(d[1], modulus)] or docs[-1:]
    train = [d for d in docs if d not in held]
    rule = (f"{n} user requests from specdec/train/instructions.py (task templates x topics, seed {seed}); "
            f"held out when int(sha256(text)[:8], 16) % {modulus} == 0 (none: the last)")
    return Split(train, held, rule, "specdec.train.instructions")


def chat_answers(target: str | Path, texts: Sequence[str], cfg: GenerateConfig) -> list[tuple[list[int], list[int]]]:
    """Each request of ``texts`` rendered through the target's chat template as one user turn
    (with the generation prompt) and answered greedily by the target through the engine (up to
    ``cfg.new_tokens`` tokens, ending at EOS): ``(prompt ids, answer ids)`` per request, in order.
    Deterministic, as :func:`generated_documents`."""
    from specdec.api import LLM
    from specdec.core.context import SamplingParams
    from specdec.data.chat import load_chat_template

    template = load_chat_template(target)
    llm = LLM(target, max_batch_size=cfg.batch_size, max_seq_len=cfg.prompt_len + cfg.new_tokens)
    prompts = []
    for i, t in enumerate(texts):
        ids = llm.tokenizer.encode(template.render([{"role": "user", "content": t}], add_generation_prompt=True),
                                   add_special_tokens=False).ids
        if len(ids) > cfg.prompt_len:
            raise ValueError(f"data.generate.prompt_len={cfg.prompt_len}: request {i} renders to {len(ids)} tokens")
        prompts.append(list(ids))
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=cfg.new_tokens))
    for i, o in enumerate(outs):
        if o.error:
            raise RuntimeError(f"data.corpus=instructions: request {i} failed: {o.error}")
    return [(p, list(o.token_ids)) for p, o in zip(prompts, outs)]


def chat_stream(pairs: Sequence[tuple[list[int], list[int]]], separator: int) -> torch.Tensor:
    """One token stream [N]: ``separator``, the rendered prompt, the answer, for each pair in order."""
    out: list[int] = []
    for p, a in pairs:
        out += [separator, *p, *a]
    return torch.tensor(out, dtype=torch.long)


def document_separator(tok: Any, bos: int | None, eos: Sequence[int]) -> int:
    """The id put before each document: ``<|endoftext|>`` if the tokenizer has it, else BOS, else EOS."""
    from specdec.train.tokenizer import EOS_TOKEN

    sep = tok.token_to_id(EOS_TOKEN)
    if sep is None:
        sep = bos if bos is not None else (eos[0] if eos else 0)
    return int(sep)


def encode(tok: Any, docs: Sequence[tuple[str, str]], separator: int) -> torch.Tensor:
    """One token stream [N]: ``separator`` then each document's tokens, in order."""
    out: list[int] = []
    for enc in tok.encode_batch([t for _, t in docs], add_special_tokens=False):
        out.append(separator)
        out.extend(enc.ids)
    return torch.tensor(out, dtype=torch.long)


def generated_documents(target_dir: str | Path, stream: torch.Tensor, cfg: GenerateConfig,
                        separator: int) -> torch.Tensor:
    """Self-distillation text: ``cfg.prompts`` windows of ``stream`` (``cfg.prompt_len`` tokens,
    starts evenly spaced) continued greedily by the target through the engine (batched, paged
    KV), as one stream [N]: ``separator``, the window, its continuation, for each in order.

    Deterministic: the windows are fixed by the stream, greedy decoding is exact (the
    engine's outputs equal the target's dense greedy continuations; tests check it).
    """
    from specdec.api import LLM
    from specdec.core.context import SamplingParams

    n, span = cfg.prompts, cfg.prompt_len
    if stream.numel() < span:
        raise ValueError(f"data.generate.prompt_len={span} is longer than the train stream ({stream.numel()} tokens)")
    starts = torch.linspace(0, stream.numel() - span, n).long().tolist()
    prompts = [stream[s : s + span].tolist() for s in starts]
    llm = LLM(target_dir, max_batch_size=cfg.batch_size, max_seq_len=span + cfg.new_tokens)  # torch's threads as set
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=cfg.new_tokens))
    docs: list[int] = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        if o.error:
            raise RuntimeError(f"data.generate: prompt {i} (train stream offset {starts[i]}) failed: {o.error}")
        docs += [separator, *p, *o.token_ids]
    return torch.tensor(docs, dtype=torch.long)


def top_tokens(stream: torch.Tensor, n: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The ``n`` most frequent ids of ``stream`` (ties: lower id first), sorted; and their share of it."""
    counts = torch.bincount(stream, minlength=vocab_size).double()
    # stable order: by count descending, then id ascending
    order = sorted(range(vocab_size), key=lambda i: (-counts[i].item(), i))[:n]
    ids = torch.tensor(sorted(order), dtype=torch.long)
    return ids, float(counts[ids].sum() / counts.sum().clamp(min=1))


# --------------------------------------------------------------------------------------------
# batches: a pure function of (seed, batch index)
# --------------------------------------------------------------------------------------------
@dataclass
class WindowOrder:
    """Non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``) of the train
    stream, visited once per epoch: chunks of ``chunk_windows`` windows in a seeded random
    order, each chunk's windows shuffled too (so a cached chunk is read whole). Batch ``g``
    is a function of ``(seed, g)``: the step is the data cursor."""

    num_tokens: int
    seq_len: int
    batch_size: int
    chunk_windows: int
    seed: int
    _orders: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.num_windows < 1:
            raise ValueError(f"the train stream ({self.num_tokens} tokens) is shorter than one window "
                             f"of {self.seq_len + 1} tokens: lower train.seq_len or use a larger corpus")

    @property
    def num_windows(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    @property
    def batches_per_epoch(self) -> int:
        return max(1, self.num_windows // self.batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            n, c = self.num_windows, self.chunk_windows
            chunks = torch.randperm((n + c - 1) // c, generator=g).tolist()
            parts = []
            for ci in chunks:
                ids = torch.arange(ci * c, min(n, (ci + 1) * c))
                parts.append(ids[torch.randperm(ids.numel(), generator=g)])
            order = torch.cat(parts)
            if order.numel() < self.batch_size:  # fewer windows than one batch: repeat them
                order = order.repeat((self.batch_size + order.numel() - 1) // order.numel())
            self._orders = {epoch: order}  # keep one epoch's order
        return self._orders[epoch]

    def epoch_of(self, g: int) -> int:
        return g // self.batches_per_epoch

    def batch(self, g: int) -> torch.Tensor:
        """Window ids [batch_size] of batch ``g`` (0-based)."""
        e, j = divmod(g, self.batches_per_epoch)
        return self.order(e)[j * self.batch_size : (j + 1) * self.batch_size]

    def windows(self, stream: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Token windows [len(ids), seq_len + 1]."""
        return stream[ids[:, None] * self.seq_len + torch.arange(self.seq_len + 1)[None, :]]


# --------------------------------------------------------------------------------------------
# the target's outputs
# --------------------------------------------------------------------------------------------
@dataclass
class Features:
    """The frozen target on windows ``tokens`` [B, S]: final-norm hidden [B, S, H] and the
    concatenated inputs of the captured layers [B, S, k·H] (None when none are captured)."""

    tokens: torch.Tensor
    hidden: torch.Tensor
    aux: torch.Tensor | None

    def __getitem__(self, idx: Any) -> Features:
        return Features(self.tokens[idx], self.hidden[idx], None if self.aux is None else self.aux[idx])

    @staticmethod
    def cat(parts: Sequence[Features]) -> Features:
        aux = None if parts[0].aux is None else torch.cat([p.aux for p in parts])  # type: ignore[misc]
        return Features(torch.cat([p.tokens for p in parts]), torch.cat([p.hidden for p in parts]), aux)


class TargetFeatures:
    """Runs the frozen target (no grad) and returns :class:`Features`; with ``cache_dir``
    each chunk of windows is computed once and kept on disk (``chunk_<i>.safetensors``, written
    to a temporary name and renamed, so an interrupted write is never read; an unreadable one is
    an error naming it)."""

    def __init__(self, target: LlamaDecoder, capture: Sequence[int] = (), *, cache_dir: str | Path | None = None,
                 chunk_windows: int = 64, batch: int = 16, key: str = "") -> None:
        self.target = target.eval()
        self.capture = tuple(capture)
        self.batch = batch
        self.chunk_windows = chunk_windows
        self.cache_dir = Path(cache_dir) if cache_dir else None
        if self.cache_dir is not None:
            # One cache per (target, stream, window shape, captured layers): a key in the dir name.
            self.cache_dir = self.cache_dir / hashlib.sha256(key.encode()).hexdigest()[:12]
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._chunks: OrderedDict[int, Features] = OrderedDict()
        self.computed_windows = 0  # windows the target ran on (not read from the cache)

    @torch.no_grad()
    def run(self, tokens: torch.Tensor) -> Features:
        """The target on ``tokens`` [B, S] (in sub-batches of ``batch``)."""
        parts = []
        t = self.target
        for i in range(0, tokens.shape[0], self.batch):
            x = tokens[i : i + self.batch]
            b, s = x.shape
            cos, sin = t._rope(torch.arange(s).repeat(b), s - 1)
            emb = t.model.embed_tokens(x.reshape(-1))
            h, aux = t._layers(emb, cos, sin, DenseCausalAttend(b, s, t.config.sliding_window), capture=self.capture)
            parts.append(Features(x, h.view(b, s, -1),
                                  torch.cat(aux, dim=-1).view(b, s, -1) if aux else None))
        self.computed_windows += tokens.shape[0]
        return Features.cat(parts)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits from its final-norm hidden states."""
        return self.target.lm_head(hidden)

    def windows(self, order: WindowOrder, stream: torch.Tensor, ids: torch.Tensor) -> Features:
        """Features of train windows ``ids`` (through the cache when there is one)."""
        if self.cache_dir is None:
            return self.run(order.windows(stream, ids))
        c = self.chunk_windows
        rows = []
        for w in ids.tolist():
            chunk = self._chunk(order, stream, w // c)
            rows.append(chunk[w % c : w % c + 1])
        return Features.cat(rows)

    def _chunk(self, order: WindowOrder, stream: torch.Tensor, ci: int) -> Features:
        if ci in self._chunks:
            self._chunks.move_to_end(ci)
            return self._chunks[ci]
        assert self.cache_dir is not None
        from specdec.train.state import TrainError, read_tensors, write_tensors

        f = self.cache_dir / f"chunk_{ci:06d}.safetensors"
        if f.is_file():
            d, _ = read_tensors(f, "feature cache chunk")
            if "tokens" not in d or "hidden" not in d:
                raise TrainError(f"{f}: not a readable feature cache chunk (no tokens or hidden); delete it")
            feats = Features(d["tokens"], d["hidden"], d.get("aux"))
        else:
            c = self.chunk_windows
            ids = torch.arange(ci * c, min(order.num_windows, (ci + 1) * c))
            feats = self.run(order.windows(stream, ids))
            write_tensors(f, {"tokens": feats.tokens, "hidden": feats.hidden,
                              **({"aux": feats.aux} if feats.aux is not None else {})}, {"chunk": ci})
        self._chunks[ci] = feats
        while len(self._chunks) > 4:
            self._chunks.popitem(last=False)
        return feats


# --------------------------------------------------------------------------------------------
# held-out evaluation set
# --------------------------------------------------------------------------------------------
@dataclass
class EvalSet:
    """Held-out prompts (``prompt_len`` tokens each) with the target's greedy continuation
    (``sequences`` [N, prompt_len + new_tokens]), its features on them, and held-out
    windows for a loss figure."""

    sequences: torch.Tensor
    prompt_len: int
    features: Features
    loss_windows: Features | None
    # Rows of different lengths (chat requests and their answers, right-padded): (prompt_len, length)
    # per row; None: every row is prompt_len + its continuation, the whole row.
    spans: list[tuple[int, int]] | None = None

    def rows(self) -> list[tuple[int, int]]:
        """``(prompt_len, length)`` of each row: the τ simulation reads ``sequences[n, :length]``."""
        return self.spans or [(self.prompt_len, int(self.sequences.shape[1]))] * int(self.sequences.shape[0])

    def describe(self) -> dict[str, Any]:
        n, length = self.sequences.shape
        lw = 0 if self.loss_windows is None else int(self.loss_windows.tokens.shape[0])
        if self.spans is not None:
            return {"prompts": n, "prompt_tokens": sum(p for p, _ in self.spans),
                    "new_tokens": sum(n_ - p for p, n_ in self.spans),
                    "rule": "the held-out requests rendered through the chat template, each with the target's "
                            "greedy answer (up to data.generate.new_tokens, ending at EOS)", "loss_windows": lw}
        return {"prompts": n, "prompt_tokens": self.prompt_len, "new_tokens": length - self.prompt_len,
                "rule": "prompts start at evenly spaced offsets of the held-out stream; each continued "
                        "greedily by the target (no EOS stop)", "loss_windows": lw}


@torch.no_grad()
def greedy_continue(target: LlamaDecoder, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """``prompts`` [N, P] continued greedily by ``n_new`` tokens -> [N, P + n_new] (dense re-forward)."""
    seq = prompts
    for _ in range(n_new):
        nxt = target.forward_dense(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def eval_set(feats: TargetFeatures, held: torch.Tensor, *, prompts: int, prompt_len: int, new_tokens: int,
             loss_windows: int, seq_len: int) -> EvalSet:
    """The held-out evaluation set (deterministic: evenly spaced prompts)."""
    span = prompt_len
    if held.numel() < span + 1:
        raise ValueError(f"the held-out stream ({held.numel()} tokens) is shorter than eval.prompt_len={prompt_len}")
    n = max(1, min(prompts, held.numel() // span))
    starts = torch.linspace(0, held.numel() - span, n).long()
    p = held[starts[:, None] + torch.arange(span)[None, :]]
    seqs = greedy_continue(feats.target, p, new_tokens)
    lw = held_loss_windows(feats, held, loss_windows, seq_len)
    return EvalSet(seqs, prompt_len, feats.run(seqs), lw)


def chat_eval_set(feats: TargetFeatures, pairs: Sequence[tuple[list[int], list[int]]], held: torch.Tensor, *,
                  prompts: int, loss_windows: int, seq_len: int, pad: int) -> EvalSet:
    """The held-out set of a chat target: the first ``prompts`` held-out (request, greedy answer)
    pairs, right-padded with ``pad`` (causal features: padding changes no real row's); the held-out
    loss on windows of the held-out stream ``held``."""
    pairs = list(pairs)[:prompts]
    width = max(len(p) + len(a) for p, a in pairs)
    seqs = torch.full((len(pairs), width), pad, dtype=torch.long)
    for n, (p, a) in enumerate(pairs):
        seqs[n, : len(p) + len(a)] = torch.tensor([*p, *a])
    lw = held_loss_windows(feats, held, loss_windows, seq_len)
    return EvalSet(seqs, max(len(p) for p, _ in pairs), feats.run(seqs), lw,
                   spans=[(len(p), len(p) + len(a)) for p, a in pairs])


def held_loss_windows(feats: TargetFeatures, held: torch.Tensor, loss_windows: int, seq_len: int) -> Features | None:
    """Features of the first ``loss_windows`` windows (``seq_len + 1`` tokens each, starts
    ``seq_len`` apart) of the held-out stream ``held``, for the held-out loss; None where none
    are asked for or the stream is no longer than one window."""
    if loss_windows <= 0 or held.numel() <= seq_len + 1:
        return None
    k = min(loss_windows, (held.numel() - 1) // seq_len)
    return feats.run(torch.stack([held[i * seq_len : i * seq_len + seq_len + 1] for i in range(k)]))


def chain_tau(ok: torch.Tensor, prompt_len: int, gamma: int) -> dict[str, float]:
    """Greedy chain speculation over one sequence, simulated from ``ok`` [R, γ]: ``ok[r, s]``
    says the s-th draft (0-based) of the chain rooted at position ``r`` equals the sequence
    (root ``r``: the last committed token is at ``r + 1``; draft s predicts token ``r + 2 + s``).

    The target's prefill makes the token at ``prompt_len`` (no drafts: a head needs the
    target's features first). Each step then accepts the longest run of matching drafts
    (``<= γ``) and adds the target's own token. Returns tokens and steps after the prefill.
    """
    length = ok.shape[0] + 1  # roots 0..L-2 of a sequence of L tokens
    r = prompt_len - 1
    tokens = steps = accepted = 0
    while r + 1 < length - 1:  # the last committed token is at r + 1
        remaining = length - 1 - (r + 1)
        k = 0
        while k < gamma and k < remaining and bool(ok[r, k]):
            k += 1
        step_tokens = min(k + 1, remaining)
        accepted += min(k, step_tokens)
        tokens += step_tokens
        steps += 1
        r += step_tokens
    return {"tokens": tokens, "steps": steps, "accepted": accepted}


def tau_summary(parts: Sequence[dict[str, float]], gamma: int) -> dict[str, float]:
    """τ = tokens per target call after the prefill, over sequences (and with the prefill's call and token)."""
    tokens = sum(p["tokens"] for p in parts)
    steps = sum(p["steps"] for p in parts)
    acc = sum(p["accepted"] for p in parts)
    n = len(parts)
    return {"tau": tokens / max(1, steps), "tau_with_prefill": (tokens + n) / max(1, steps + n),
            "alpha": acc / max(1, steps * gamma), "gamma": gamma, "steps": steps, "tokens": tokens}


def draft_ok(pred: torch.Tensor, seq: torch.Tensor, gamma: int) -> torch.Tensor:
    """``ok`` [L-1, γ] of a chain drafter whose step-s draft from root r is ``pred[r + 1 + s]``
    (a draft model's greedy argmax at position r + 1 + s), against ``seq`` [L]."""
    length = seq.numel()
    ok = torch.zeros(length - 1, gamma, dtype=torch.bool)
    for s in range(gamma):
        # root r: pred[r + 1 + s] vs seq[r + 2 + s], r + 2 + s <= L - 1
        n = length - 2 - s
        if n > 0:
            ok[:n, s] = pred[1 + s : 1 + s + n] == seq[2 + s : 2 + s + n]
    return ok
