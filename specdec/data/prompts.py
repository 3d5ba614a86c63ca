"""Loading prompts from JSONL.

One JSON object per line. The text is taken from ``text_field``; when that
value is a list of strings (Spec-Bench's and MT-bench's ``question.jsonl``:
``{"question_id": 81, "category": "writing", "turns": ["...", "..."]}``)
element ``turn`` is taken, or, with ``turn: null``, every turn (a multi-turn
conversation: see :class:`DataConfig`); a list of ints is taken as token ids.
``"auto"`` fields try the usual names:

- text: ``prompt``, ``text``, ``turns``, ``question``, ``instruction``, ``input``;
- id: ``id``, ``question_id``, ``request_id``, else the line number;
- source: ``source``, ``category`` (optional; the run reports figures per source).

Ids must be unique: results are keyed (and resumed) by them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AUTO_TEXT = ("prompt", "text", "turns", "question", "instruction", "input")
AUTO_ID = ("id", "question_id", "request_id")
AUTO_SOURCE = ("source", "category")
# Bounds on one chat-template render (data.chat_time_limit_s, data.chat_max_chars): a template is
# untrusted code; a real one takes milliseconds and writes about the prompt's length.
DEFAULT_CHAT_TIME_LIMIT_S = 10.0
DEFAULT_CHAT_MAX_CHARS = 10_000_000


class PromptDataError(ValueError):
    """A prompt file or line that cannot be used (names the file, line and field)."""


@dataclass(frozen=True)
class DataConfig:
    """``data/``: the prompt file and how its prompts become requests."""

    path: str
    text_field: str = "auto"
    id_field: str = "auto"
    # The prompt's category (summary.json's by_category, the per-category table); null: none.
    source_field: str | None = "auto"
    # A list-valued text field (Spec-Bench / MT-bench "turns"): which turn is the prompt.
    # An int: that one element, alone. null: every turn, in order, as one conversation: turn i+1
    # is generated after the model's own answer to turn i (each pipeline its own answers), with
    # the chat template as alternating user / assistant messages, without one as the plain
    # concatenation turn 1 + answer 1 + turn 2 …; results.jsonl keeps each turn's figures
    # (methods.<name>.turns, plain.turns) and the totals over all turns.
    turn: int | None = 0
    # Render each prompt through the target's chat template (tokenizer_config.json's
    # chat_template, or chat_template.jinja) as a user message, with the generation prompt.
    chat: bool = False
    # Each render of the chat template may take this long and build at most this many characters
    # (its output, or any string, list or number on the way); past either it fails naming the file.
    chat_time_limit_s: float = DEFAULT_CHAT_TIME_LIMIT_S
    chat_max_chars: int = DEFAULT_CHAT_MAX_CHARS
    limit: int | None = None
    # At most this many prompts of each source (category), in file order: a few of every
    # Spec-Bench category rather than the first N of the file. null: no such bound.
    limit_per_source: int | None = None
    max_prompt_tokens: int | None = None  # keep each prompt's last N tokens (each turn's, in a conversation)

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("data.path must name a JSONL file of prompts")
        if self.turn is not None and self.turn < 0:
            raise ValueError(f"data.turn must be >= 0, got {self.turn}")
        if not 0 < self.chat_time_limit_s < float("inf"):
            raise ValueError(f"data.chat_time_limit_s must be a positive number of seconds, "
                             f"got {self.chat_time_limit_s}")
        if self.chat_max_chars < 1:
            raise ValueError(f"data.chat_max_chars must be >= 1, got {self.chat_max_chars}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"data.limit must be >= 1 or null, got {self.limit}")
        if self.limit_per_source is not None and self.limit_per_source < 1:
            raise ValueError(f"data.limit_per_source must be >= 1 or null, got {self.limit_per_source}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens must be >= 1 or null, got {self.max_prompt_tokens}")


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str | None  # the (first) user turn; None when the file gives token ids
    token_ids: tuple[int, ...] | None = None
    source: str | None = None
    turns: tuple[str, ...] = ()  # every user turn of a conversation (data.turn=null, 2 or more turns)


def _pick(obj: dict[str, Any], field: str, auto: tuple[str, ...]) -> tuple[str | None, Any]:
    if field != "auto":
        return (field, obj[field]) if field in obj else (None, None)
    for k in auto:
        if k in obj:
            return k, obj[k]
    return None, None


def _parse_line(obj: Any, cfg: DataConfig, where: str, lineno: int) -> Prompt:
    if not isinstance(obj, dict):
        raise PromptDataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    key, value = _pick(obj, cfg.text_field, AUTO_TEXT)
    if key is None:
        want = cfg.text_field if cfg.text_field != "auto" else " / ".join(AUTO_TEXT)
        raise PromptDataError(f"{where}: no text field {want!r} (data.text_field); keys: {sorted(obj)}")
    text: str | None = None
    ids: tuple[int, ...] | None = None
    turns: tuple[str, ...] = ()
    if isinstance(value, str):
        text = value
    elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        ids = tuple(value)
    elif isinstance(value, list):
        picked = range(len(value)) if cfg.turn is None else [cfg.turn]
        if not value:
            raise PromptDataError(f"{where}: field {key!r} is an empty list")
        if cfg.turn is not None and cfg.turn >= len(value):
            raise PromptDataError(f"{where}: field {key!r} has {len(value)} turns, data.turn is {cfg.turn}")
        for i in picked:
            if not isinstance(value[i], str):
                raise PromptDataError(f"{where}: {key}[{i}] is not a string")
            if value[i] == "":
                raise PromptDataError(f"{where}: empty prompt in {key}[{i}]")
        text = value[picked[0]]
        if len(picked) > 1:
            turns = tuple(value)
    else:
        raise PromptDataError(f"{where}: field {key!r} must be a string, a list of strings or token ids")
    if text == "":
        raise PromptDataError(f"{where}: empty prompt in field {key!r}")
    id_key, rid = _pick(obj, cfg.id_field, AUTO_ID)
    if id_key is None:
        if cfg.id_field != "auto":
            raise PromptDataError(f"{where}: no id field {cfg.id_field!r} (data.id_field)")
        rid = f"line-{lineno}"
    _, source = (None, None) if cfg.source_field is None else _pick(obj, cfg.source_field, AUTO_SOURCE)
    return Prompt(id=str(rid), text=text, token_ids=ids, source=None if source is None else str(source),
                  turns=turns)


def load_prompts(cfg: DataConfig) -> list[Prompt]:
    """The prompts of ``cfg.path`` in file order (the first ``cfg.limit`` when set; at most
    ``cfg.limit_per_source`` of each source)."""
    path = Path(cfg.path)
    if not path.is_file():
        raise PromptDataError(f"data.path: prompt file {str(path)!r} does not exist")
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    per_source: dict[str | None, int] = {}
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PromptDataError(f"{where}: not valid UTF-8 (byte {e.start + 1} of the line: "
                                      f"{e.reason})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptDataError(f"{where}: invalid JSON: {e}") from None
            except RecursionError:
                raise PromptDataError(f"{where}: JSON nested too deeply to read") from None
            p = _parse_line(obj, cfg, where, lineno)
            if p.id in seen:
                raise PromptDataError(f"{where}: duplicate prompt id {p.id!r} (first on line {seen[p.id]})")
            seen[p.id] = lineno
            if cfg.limit_per_source is not None:
                per_source[p.source] = per_source.get(p.source, 0) + 1
                if per_source[p.source] > cfg.limit_per_source:
                    continue
            prompts.append(p)
            if cfg.limit is not None and len(prompts) >= cfg.limit:
                break
    if not prompts:
        raise PromptDataError(f"data.path: {path} holds no prompts")
    return prompts
