"""A draft model must share the target's vocabulary: anything else fails at build time."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from specdec.api import LLM
from specdec.core.pipeline_model import RuntimeConfig
from specdec.spec.proposers import proposer_class
from specdec.spec.proposers.draft_model import DraftModelConfig

RT = RuntimeConfig(max_batch_size=2, max_seq_len=64)


def _word_tokenizer(path: Path, words: list[str]) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.save(str(path / "tokenizer.json"))


def test_draft_with_another_vocab_size_is_rejected(tiny_llama) -> None:
    target, draft = tiny_llama(vocab=64), tiny_llama(vocab=96)
    with pytest.raises(ValueError, match=r"vocab_size 96.*target has 64"):
        LLM(target.path, method=DraftModelConfig(path=str(draft.path)), runtime=RT)


def test_draft_with_another_tokenizer_is_rejected(tiny_llama, tmp_path: Path) -> None:
    src = tiny_llama(vocab=64)
    t_dir, d_dir = tmp_path / "target", tmp_path / "draft"
    shutil.copytree(src.path, t_dir)
    shutil.copytree(src.path, d_dir)
    _word_tokenizer(t_dir, [f"w{i}" for i in range(64)])
    _word_tokenizer(d_dir, [f"x{i}" for i in range(64)])  # same size, other tokens
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(t_dir, method=DraftModelConfig(path=str(d_dir)), runtime=RT)
    _word_tokenizer(d_dir, [f"w{i}" for i in range(64)])  # the same tokenizer builds fine
    LLM(t_dir, method=DraftModelConfig(path=str(d_dir)), runtime=RT)


def test_unknown_proposer_lists_the_registered_ones() -> None:
    with pytest.raises(KeyError, match="draft_model.*ngram"):
        proposer_class("medusa-not-yet")
