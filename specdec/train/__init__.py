"""Training inside the framework: ``python -m specdec.train`` (:mod:`specdec.train.app`), and the
recipe of the built-in model pair in :mod:`specdec.zoo` (``experiments/train_zoo.py``).

- :mod:`specdec.train.app` — the Hydra app (``conf/train.yaml``; recipes in ``conf/train/``:
  ``draft_model``, ``eagle``, ``eagle3``): loop, checkpoints and resume, W&B, manifest;
- :mod:`specdec.train.config` — its schema; :mod:`specdec.train.data` — corpus split, token
  streams, batches, the target's features (on the fly or cached), the held-out set, simulated τ;
- :mod:`specdec.train.eagle` — EAGLE-1 / EAGLE-3 heads (training-time test);
  :mod:`specdec.train.draft` — a distilled draft model;
- :mod:`specdec.train.corpus` — Python stdlib sources, deterministic held-out split, prompts;
- :mod:`specdec.train.tokenizer` — the shared ByteLevel BPE tokenizer;
- :mod:`specdec.train.lm` — model configs, the LM training loop, distillation loss, evaluation;
- :mod:`specdec.train.export` — saving a trained decoder in Hugging Face format.
"""
