"""The shared ByteLevel BPE tokenizer, trained with the ``tokenizers`` library."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)  # ids 0 and 1


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2):  # -> Tokenizer
    """A ByteLevel BPE tokenizer over ``texts``, ``<|endoftext|>`` (id 0) as BOS/EOS.

    ByteLevel pre-tokenization (GPT-2 regex, no prefix space) so every byte
    string round-trips; no post-processor: callers add BOS/EOS themselves.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_documents(tok, texts: Sequence[str]) -> list[int]:  # tok: Tokenizer
    """One token stream: ``<|endoftext|>`` before each document, then its tokens."""
    eos = tok.token_to_id(EOS_TOKEN)
    out: list[int] = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        out.append(eos)
        out.extend(enc.ids)
    return out
