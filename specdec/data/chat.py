"""Chat templates: a checkpoint's own prompt format, rendered as ``transformers`` renders it.

A chat model answers well only when its prompt is laid out the way it was
trained (role markers, BOS, the "assistant turn starts here" suffix), and
speculation figures measured on a mis-formatted prompt measure the wrong
text. The template is the Jinja2 ``chat_template`` of the checkpoint's
``tokenizer_config.json`` (or of ``chat_template.jinja``, where newer
``transformers`` versions save it). It is rendered in Jinja2's immutable
sandbox (templates come from model hubs: untrusted code) with the
environment ``transformers.apply_chat_template`` uses (``trim_blocks``,
``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``,
a ``tojson`` that does not escape HTML, the ``{% generation %}`` tag), and
with every ``*_token`` of ``tokenizer_config.json`` (``bos_token``,
``eos_token`` …) in scope, so the text is the same as ``transformers``
renders (a test checks it). ``transformers`` itself is never imported.

:func:`conversation_prompt` lays out one turn of a (multi-turn) conversation,
with a template or without one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from specdec.data.prompts import PromptDataError

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(PromptDataError):
    """A chat template that is missing, does not compile or fails to render (names the file)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template, the file it came from and the special tokens it may reference."""

    source: Path
    template: Any  # jinja2.Template
    special_tokens: Mapping[str, str]

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (``{"role", "content"}`` dicts), as ``apply_chat_template(
        messages, tokenize=False, add_generation_prompt=...)`` gives it."""
        from jinja2 import TemplateError

        try:
            return str(self.template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                            add_generation_prompt=add_generation_prompt, **self.special_tokens))
        except TemplateError as e:
            raise ChatTemplateError(f"chat template of {self.source} failed to render: {e}") from None


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _template_text(raw: Any, where: Path) -> str:
    """The default template of a ``chat_template`` value: a string, or a list of named templates."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
        raise ChatTemplateError(f"{where}: 'chat_template' lists templates {sorted(map(str, named))} but no "
                                "'default' one")
    raise ChatTemplateError(f"{where}: 'chat_template' must be a string or a list of named templates")


def load_chat_template(checkpoint: str | Path) -> ChatTemplate:
    """The chat template of the checkpoint directory ``checkpoint``.

    ``chat_template.jinja`` wins over ``tokenizer_config.json``'s
    ``chat_template`` (as in ``transformers``). Raises :class:`ChatTemplateError`
    naming the file when there is no template or it does not compile.
    """
    d = Path(checkpoint)
    cfg_file = d / TOKENIZER_CONFIG
    cfg: dict[str, Any] = {}
    if cfg_file.is_file():
        try:
            loaded = json.loads(cfg_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"{cfg_file} is not valid JSON: {e}") from None
        if not isinstance(loaded, dict):
            raise ChatTemplateError(f"{cfg_file} must hold a JSON object")
        cfg = loaded
    jinja_file = d / TEMPLATE_FILE
    if jinja_file.is_file():
        source, text = jinja_file, jinja_file.read_text(encoding="utf-8")
    elif cfg.get("chat_template") is not None:
        source, text = cfg_file, _template_text(cfg["chat_template"], cfg_file)
    else:
        what = f"{cfg_file} has no 'chat_template'" if cfg_file.is_file() else f"{cfg_file} does not exist"
        raise ChatTemplateError(f"data.chat=true needs the target's chat template, but {what} (and there is no "
                                f"{jinja_file}): set data.chat=false for a model without one")
    specials = {k: t for k, v in cfg.items() if k.endswith("_token") and (t := _token_text(v)) is not None}
    return ChatTemplate(source=source, template=_compile(text, source), special_tokens=specials)


def _compile(text: str, source: Path) -> Any:
    """``text`` compiled in the sandboxed environment ``transformers`` renders chat templates in."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}…{% endgeneration %}`` (marks assistant text for training masks): its body as is."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template of {source} does not compile: {e}") from None


def conversation_prompt(turns: Sequence[str], answers: Sequence[str], template: ChatTemplate | None) -> str:
    """The prompt for the user turn ``turns[-1]``, after the earlier turns and the model's ``answers`` to them.

    With a template: messages alternating user / assistant, ending with the
    user turn, and the generation prompt (as Spec-Bench and MT-bench run
    multi-turn questions). Without: the plain concatenation
    ``turns[0] + answers[0] + turns[1] + …`` (a one-turn prompt is its text).
    """
    if len(answers) != len(turns) - 1:
        raise ValueError(f"{len(turns)} turns need {len(turns) - 1} answers, got {len(answers)}")
    if template is None:
        return "".join(t + a for t, a in zip(turns, [*answers, ""]))
    messages = []
    for t, a in zip(turns, [*answers, None]):
        messages.append({"role": "user", "content": t})
        if a is not None:
            messages.append({"role": "assistant", "content": a})
    return template.render(messages, add_generation_prompt=True)
