"""The recipe that trains the built-in model pair in :mod:`specdec.zoo`.

- :mod:`specdec.train.corpus` — Python stdlib sources, deterministic held-out split, prompts;
- :mod:`specdec.train.tokenizer` — the shared ByteLevel BPE tokenizer;
- :mod:`specdec.train.lm` — model configs, the training loop, distillation, evaluation;
- :mod:`specdec.train.export` — saving a trained decoder in Hugging Face format.

The entry point is ``experiments/train_zoo.py``.
"""
