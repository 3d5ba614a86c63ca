"""Output text as tokens arrive: incremental detokenization and stop strings.

Decoding a whole output again after every token costs O(n²), and decoding each
token alone breaks tokenizers whose pieces depend on their neighbours (a
SentencePiece ``▁``, a character split over byte-level tokens). Both classes
here follow vLLM's offsets method: decode a short window ending at the new
token and keep what it adds beyond the window's already-read part.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"  # what a decoder gives for the bytes of a character not yet complete


class IncrementalDetokenizer:
    """The text of a growing list of token ids, one piece per token.

    A piece is held back (``push`` returns None) while the decoded tail ends in
    U+FFFD: the token is part of a multi-byte UTF-8 character whose remaining
    bytes come with later tokens. The pieces concatenate to
    ``tokenizer.decode(all ids)`` for prefix-stable decoders (byte-level BPE,
    SentencePiece, WordPiece, character-level: all the usual ones), after
    :meth:`flush` gives what is still held at the end.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # anything with decode(list[int]) -> str
        self._window: list[int] = []  # [read context ... | unread]
        self._read = 0  # window[:read] is text already given out (context for the rest)

    def _piece(self) -> str:
        full = self.tokenizer.decode(self._window)
        before = self.tokenizer.decode(self._window[: self._read]) if self._read else ""
        self._window = self._window[self._read :]  # the new context: what this piece covers
        self._read = len(self._window)
        return full[len(before) :]

    def push(self, token_id: int) -> str | None:
        """The text ``token_id`` adds (may be ""), or None while a character is incomplete."""
        self._window.append(token_id)
        if self.tokenizer.decode(self._window).endswith(REPLACEMENT):
            return None
        return self._piece()

    def flush(self) -> str:
        """What is still held (decoded as is, U+FFFD included): the end of the output."""
        return self._piece() if self._read < len(self._window) else ""


class RequestText:
    """One request's output text as its tokens arrive, cut before its first stop string.

    The engine feeds it every step (:meth:`update`) and ends the request when a
    stop string appears; a stream takes what is safe to show (:meth:`take`).

    Where a stop string starts decides the cut: ``text`` ends exactly before it,
    and ``token_ids`` keeps the tokens whose whole text precedes it. A token
    whose text straddles the stop's start is dropped from ``token_ids`` though
    its part before the stop stays in ``text``: the ids then decode to a prefix
    of ``text``, never to any of the stop string.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self.stop = (stop,) if isinstance(stop, str) else tuple(stop)
        self._longest = max((len(s) for s in self.stop), default=0)
        self.token_ids: list[int] = []  # the output's ids (fed, then cut at a stop)
        self.text = ""  # their text so far (held characters excluded until complete or flushed)
        self._ends: list[int] = []  # per token whose text is in: len(text) once it was
        self._searched = 0  # text[:_searched] holds no stop string
        self._taken_ids = 0  # what take() gave out so far
        self._taken_text = 0
        self.stopped = False
        self.closed = False

    def update(self, generated: Sequence[int]) -> int | None:
        """Feeds the tokens of ``generated`` (the whole output so far) not seen yet.

        Returns how many output tokens to keep when a stop string appeared
        (``text`` is then cut before it and nothing more is fed), else None.
        """
        if self.stopped or self.closed:
            return None
        for t in generated[len(self.token_ids) :]:
            self.token_ids.append(t)
            piece = self._detok.push(t)
            if piece is not None:
                self._add(piece)
        return self._find_stop()

    def _add(self, piece: str) -> None:
        """Appends text that completes every token fed so far."""
        self.text += piece
        self._ends.extend([len(self.text)] * (len(self.token_ids) - len(self._ends)))

    def _find_stop(self) -> int | None:
        if not self.stop:
            return None
        start = max(0, self._searched - self._longest + 1)  # a stop may begin in text already searched
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        self._searched = len(self.text)
        if not hits:
            return None
        cut = min(hits)
        keep = bisect_right(self._ends, cut)  # tokens whose text ends at or before the cut
        del self.token_ids[keep:], self._ends[keep:]
        self.text = self.text[:cut]
        self.stopped = True
        return keep

    def close(self) -> None:
        """The request ended: the text of any tokens still held (an incomplete character) is added."""
        if not (self.closed or self.stopped):
            self._add(self._detok.flush())
        self.closed = True

    def _held_for_stop(self) -> int:
        """Characters at the end of ``text`` that may begin a stop string not yet complete."""
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held

    def take(self, final: bool = False) -> tuple[list[int], str]:
        """The token ids and text not given out yet that can no longer change.

        Text that may be the start of a stop string, and a character still
        incomplete, wait (with their tokens) for the next take; ``final`` (the
        request ended) closes and gives everything left. Concatenated over a
        request, the takes are ``token_ids`` and ``text``.
        """
        if final:
            self.close()
        done = self.stopped or self.closed
        limit = len(self.text) if done else max(self._taken_text, len(self.text) - self._held_for_stop())
        n = len(self.token_ids) if done else bisect_right(self._ends, limit)
        ids, text = self.token_ids[self._taken_ids : n], self.text[self._taken_text : limit]
        self._taken_ids, self._taken_text = max(self._taken_ids, n), limit
        return ids, text
