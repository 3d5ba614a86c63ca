"""Trains the built-in model pair in ``specdec/zoo`` (target + distilled draft).

    python experiments/train_zoo.py --out specdec/zoo --overwrite   # full recipe (~25 min, 2 CPU cores)
    python experiments/train_zoo.py --out /tmp/zoo --quick          # pipeline check (~1 min)

Files it would replace in ``--out`` (the two model dirs, prompts, README, MANIFEST) need
``--overwrite``; each model dir is built aside and renamed into place, never mixed.

Corpus: the running interpreter's stdlib ``.py`` files (no site-packages, no
test dirs); 1 file in 20 (by sha256 of its relative path) is held out for
evaluation and prompts. Deterministic given ``--seed`` (and the thread count).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specdec.core.checkpoint import load_decoder, load_tokenizer
from specdec.logging import LoggerConfig
from specdec.train import corpus, lm
from specdec.train.app import train as train_app
from specdec.train.config import EvalConfig, RecipeConfig, TargetDir, TrainAppConfig
from specdec.train.data import DataConfig
from specdec.train.draft import evenly_spread
from specdec.train.export import round_to_bf16_, save_hf
from specdec.train.state import staged_dir
from specdec.train.tokenizer import EOS_TOKEN, encode_documents, train_tokenizer

WRITES = ("code-target", "code-draft", "prompts.jsonl", "README.md", "MANIFEST.json")  # what --overwrite replaces


def model_spec(layers: int) -> lm.ModelSpec:
    """Both models share width and heads; they differ in depth (the draft is cheap
    because it is shallow: at batch 1 on a CPU each layer costs about the same)."""
    return lm.ModelSpec(num_hidden_layers=layers, hidden_size=256, intermediate_size=768,
                        num_attention_heads=4, num_key_value_heads=4)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="specdec/zoo", help="output directory (default specdec/zoo)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--quick", action="store_true", help="tiny run to check the pipeline end to end")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--target-layers", type=int, default=10)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--target-steps", type=int, default=600)
    ap.add_argument("--draft-steps", type=int, default=300)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (use 1 when other jobs share the CPU: far less contention)")
    ap.add_argument("--n-prompts", type=int, default=32)
    ap.add_argument("--overwrite", action="store_true", help="replace the files and model dirs already in --out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    present = sorted(n for n in WRITES if (out / n).exists())
    if present and not args.overwrite:
        print(f"train_zoo: error: {out} holds {', '.join(present)} already; pass --overwrite to replace them",
              file=sys.stderr)
        return 2
    if args.quick:
        args.target_steps, args.draft_steps, args.vocab_size = 30, 30, 1024
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()

    # --- corpus and tokenizer ---------------------------------------------------
    root = corpus.stdlib_root()
    train_files, held_files = corpus.load_split(root, max_files=80 if args.quick else None)
    print(f"corpus: {root} -> {len(train_files)} train files, {len(held_files)} held-out files", flush=True)
    t0 = time.perf_counter()
    tok = train_tokenizer((f.text for f in train_files), vocab_size=args.vocab_size)
    eos = tok.token_to_id(EOS_TOKEN)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    train_ids = torch.tensor(encode_documents(tok, [f.text for f in train_files]), dtype=torch.long)
    held_ids = torch.tensor(encode_documents(tok, [f.text for f in held_files]), dtype=torch.long)
    t_tok = time.perf_counter() - t0
    print(f"tokenizer: vocab {vocab}, {train_ids.numel():,} train / {held_ids.numel():,} held-out tokens "
          f"({t_tok:.0f}s)", flush=True)
    prompts = corpus.make_prompts(held_files, lambda s: len(tok.encode(s).ids), n=args.n_prompts)
    with open(out / "prompts.jsonl", "w") as fh:
        for p in prompts:
            fh.write(json.dumps(p) + "\n")
    prompt_ids = [tok.encode(p["prompt"]).ids for p in prompts]
    print(f"prompts: {len(prompts)} (tokens {min(map(len, prompt_ids))}..{max(map(len, prompt_ids))})", flush=True)
    windows = lm.eval_windows(held_ids, args.seq_len, max_windows=16 if args.quick else 256)

    # --- target -------------------------------------------------------------------
    TARGET, DRAFT = model_spec(args.target_layers), model_spec(args.draft_layers)
    tcfg = TARGET.config(vocab, eos, eos)
    target = lm.build_model(tcfg, args.seed)
    t_train = lm.TrainConfig(steps=args.target_steps, batch_size=args.batch_size, seq_len=args.seq_len,
                             lr=args.target_lr, warmup_steps=min(100, args.target_steps // 10 + 1), seed=args.seed)
    t_stats = lm.train_lm(target, train_ids, t_train, desc="target")
    t_loss_fp32 = lm.eval_loss(target, windows)
    round_to_bf16_(target)  # the shipped weights; the draft is distilled from these
    t_loss = lm.eval_loss(target, windows)
    print(f"target: held-out loss {t_loss_fp32:.4f} (fp32) {t_loss:.4f} (bf16) in {t_stats.wall_time_s:.0f}s", flush=True)
    with staged_dir(out / "code-target", overwrite=True) as stage:
        save_hf(target, tok, stage)

    # --- draft: the framework's draft_model recipe (python -m specdec.train train=draft_model) ---
    # distilled from the saved (bf16) target: KL(target || draft) at every position, starting
    # from copies of the target's embedding, final norm, first and last layer
    t, d = TARGET.num_hidden_layers, DRAFT.num_hidden_layers
    draft_init_layers = evenly_spread(t, d)
    d_train = RecipeConfig(recipe="draft_model", steps=args.draft_steps, batch_size=args.batch_size,
                           seq_len=args.seq_len, lr=args.draft_lr, warmup_steps=min(100, args.draft_steps // 10 + 1),
                           weight_decay=0.1, betas=(0.9, 0.95), grad_clip=1.0, layers=d,
                           init_layers=draft_init_layers, kd_weight=1.0, kd_temperature=1.0)
    with tempfile.TemporaryDirectory(prefix="train-draft-") as run_dir:
        d_manifest = train_app(TrainAppConfig(
            train=d_train, target=TargetDir(str(out / "code-target")),
            data=DataConfig(corpus="stdlib", max_files=80 if args.quick else None),
            eval=EvalConfig(prompts=8, new_tokens=32, loss_windows=8), logger=LoggerConfig(name="none"),
            seed=args.seed + 1, out_dir=str(out / "code-draft"), overwrite=args.overwrite, checkpoint_every=0,
            threads=args.threads,
        ), run_dir)
    draft = load_decoder(out / "code-draft", dtype=torch.float32).module
    d_loss = lm.eval_loss(draft, windows)
    d_stats = {"steps": d_manifest["steps"], "wall_time_s": d_manifest["wall_time_s"],
               "losses": {k: v for k, v in d_manifest["losses"].items() if k != "eval"}}
    print(f"draft: held-out loss {d_loss:.4f} (bf16) in {d_manifest['wall_time_s']:.0f}s", flush=True)

    # --- reload check, agreement, tau -----------------------------------------------
    reloaded = {}
    for name, model in (("code-target", target), ("code-draft", draft)):
        ld = load_decoder(out / name, dtype=torch.float32)
        rtok = load_tokenizer(out / name, vocab_size=ld.config.vocab_size)
        assert rtok.encode(prompts[0]["prompt"]).ids == prompt_ids[0]
        reloaded[name] = lm.eval_loss(ld.module, windows)
        ref = t_loss if name == "code-target" else d_loss
        assert abs(reloaded[name] - ref) < 1e-3, (name, reloaded[name], ref)
        print(f"{name}: reloaded held-out loss {reloaded[name]:.4f} (before save {ref:.4f})", flush=True)
    agree = lm.greedy_agreement(draft, target, windows)
    spec = lm.simulate_greedy_speculation(draft, target, prompt_ids, n_new=64, gamma=4)
    print(f"agreement {agree:.3f}; tau@4 simulated {spec['tau']:.2f} "
          f"(iid estimate {spec['tau_iid_estimate']:.2f})", flush=True)
    lat = {name: {f"seq{s}_ms": round(1e3 * lm.time_forward(m, seq=s), 2) for s in (1, 5)}
           for name, m in (("code-target", target), ("code-draft", draft))}
    print(f"forward_dense latency (batch 1): {lat}", flush=True)
    wall = time.perf_counter() - t_all

    # --- README and MANIFEST ----------------------------------------------------------
    command = "python experiments/train_zoo.py --out specdec/zoo"
    command += "" if args.seed == 1234 else f" --seed {args.seed}"
    command += "" if args.threads == 2 else f" --threads {args.threads}"
    command += "" if args.target_layers == 10 else f" --target-layers {args.target_layers}"
    command += "" if args.draft_layers == 2 else f" --draft-layers {args.draft_layers}"
    command += " --quick" if args.quick else ""
    (out / "README.md").write_text(README.format(
        t_loss=t_loss, d_loss=d_loss, agree=agree, tau=spec["tau"], seed=args.seed, threads=args.threads,
        command=command, t_layers=TARGET.num_hidden_layers, d_layers=DRAFT.num_hidden_layers,
        t_hidden=TARGET.hidden_size, d_hidden=DRAFT.hidden_size,
        n_train=len(train_files), n_held=len(held_files),
    ))
    shipped = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    manifest = {
        "description": "Built-in code LM pair for specdec: a 6-layer target and a 2-layer draft "
                       "distilled from it, trained on the Python standard library.",
        "command": command,
        "quick": args.quick,
        "seed": args.seed,
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "threads": args.threads, "machine": platform.machine()},
        "corpus": {
            "root": str(root),
            "pattern": "**/*.py under sysconfig.get_paths()['stdlib'], excluding any directory named "
                       + ", ".join(sorted(corpus.EXCLUDED_DIRS)) + "; empty files skipped; "
                       "bytes decoded as UTF-8 with errors='replace'",
            "held_out_rule": f"int(sha256(relative_path).hexdigest()[:8], 16) % {corpus.HELD_OUT_MODULUS} == 0",
            "train_files": len(train_files), "held_out_files": len(held_files),
            "train_tokens": train_ids.numel(), "held_out_tokens": held_ids.numel(),
            "document_format": f"{EOS_TOKEN} before each file, files concatenated in path order",
        },
        "tokenizer": {"type": "ByteLevel BPE (tokenizers)", "vocab_size": vocab, "special_tokens": {"eos/bos": eos},
                      "trained_on": "train files only", "wall_time_s": round(t_tok, 1)},
        "prompts": {"file": "prompts.jsonl", "count": len(prompts),
                    "rule": "one per held-out file (files in sha256 order): the first function whose "
                            "docstring opens on the line after its signature; prefix grown upward by "
                            "whole lines to 100-300 tokens, ending after the docstring's first line"},
        "models": {
            "code-target": {"spec": asdict(TARGET), "params": lm.count_params(target), "train": asdict(t_train),
                            "stats": t_stats.to_dict(), "heldout_loss": round(t_loss, 4),
                            "heldout_loss_fp32_before_bf16": round(t_loss_fp32, 4)},
            "code-draft": {"spec": asdict(DRAFT), "params": lm.count_params(draft), "train": asdict(d_train),
                           "trained_by": "specdec.train.app (recipe draft_model); its own manifest: "
                                         "code-draft/manifest.json",
                           "init": f"copy of the trained target's embedding, final norm and layers {draft_init_layers}",
                           "objective": "KL(target || draft) on the target's full distribution at every position",
                           "stats": d_stats, "heldout_loss": round(d_loss, 4)},
        },
        "evaluation": {
            "heldout_windows": f"{windows.shape[0]} consecutive windows of {args.seq_len} tokens "
                               f"({windows.shape[0] * args.seq_len} predicted tokens) of the held-out stream",
            "heldout_loss_nats_per_token": {"code-target": round(t_loss, 4), "code-draft": round(d_loss, 4)},
            "heldout_loss_after_reload": {k: round(v, 4) for k, v in reloaded.items()},
            "greedy_agreement_heldout": round(agree, 4),
            "greedy_speculation_sim": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in spec.items()},
            "forward_dense_latency_batch1": lat,
        },
        "wall_time_s": {"tokenizer": round(t_tok, 1), "target": t_stats.wall_time_s,
                        "draft": d_stats["wall_time_s"], "total": round(wall, 1)},
        "files": {p.relative_to(out).as_posix(): {"sha256": sha256(p), "bytes": p.stat().st_size} for p in shipped},
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    size = sum(p.stat().st_size for p in shipped)
    print(f"wrote {out} ({size / 2**20:.1f} MiB) in {wall:.0f}s", flush=True)
    return 0


README = """# specdec model zoo: `code-target` + `code-draft`

A small code LM pair for speculative decoding, trained by `experiments/train_zoo.py`
(recipe in `specdec/train/`) on the {n_train} Python standard-library `.py` files of the
machine that built it (site-packages and test directories excluded). {n_held} files
(1 in 20, by sha256 of the relative path) are held out; `prompts.jsonl` holds code
prefixes from them (signature + docstring start, 100-300 tokens).

| model | layers | hidden | held-out loss (nats/token) |
|---|---|---|---|
| `code-target` | {t_layers} | {t_hidden} | {t_loss:.3f} |
| `code-draft` | {d_layers} | {d_hidden} | {d_loss:.3f} |

The draft is distilled from the target (KL to its full next-token distribution).
Greedy draft/target agreement on held-out text: {agree:.1%}; simulated mean accepted
length (tokens per target call) of greedy speculative decoding at γ=4 on the
prompts: τ = {tau:.2f}.

Both directories are Hugging Face Llama checkpoints (`config.json`, bf16
`model.safetensors` with tied embeddings, the shared `tokenizer.json`, EOS/BOS
`<|endoftext|>` = id 0). Load with `specdec.core.checkpoint.load_decoder`.
Reproduce (seed {seed}, {threads} thread(s); every random choice comes from the seed,
but a rerun has not been compared file for file, and the thread count changes float sums):

    {command}

`MANIFEST.json` records the full recipe, corpus counts, metrics and file hashes.
"""

if __name__ == "__main__":
    sys.exit(main())
