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

The sandbox keeps a template from reaching Python; :func:`_sandbox` also
bounds what one render may spend (``data.chat_time_limit_s``,
``data.chat_max_chars``). Rendering is pure Python, so the checks are
cooperative: every ``for`` item, call, attribute lookup, filter and
``+ * ** %`` checks the clock, ``* + **`` refuse a result over the size
limit before computing it, calls, filters, ``%`` and ``~`` check what they
built, and the streamed output is counted as it comes. Any failure of a template,
limits included, is a :class:`ChatTemplateError` naming the file, the
template line and the prompt.

:func:`conversation_prompt` lays out one turn of a (multi-turn) conversation,
with a template or without one.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from specdec.data.prompts import DEFAULT_CHAT_MAX_CHARS, DEFAULT_CHAT_TIME_LIMIT_S, PromptDataError

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(PromptDataError):
    """A chat template that is missing, does not compile or fails to render (names the file)."""


class _LimitExceeded(Exception):
    """A render ran past its time limit or built something over its size limit."""


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template, the file it came from, the special tokens it may reference and
    the limits of one render (seconds of wall clock; characters of output or of any string,
    list or number built on the way)."""

    source: Path
    template: Any  # jinja2.Template, compiled by _compile in the environment of _sandbox()
    special_tokens: Mapping[str, str]
    time_limit_s: float = DEFAULT_CHAT_TIME_LIMIT_S
    max_chars: int = DEFAULT_CHAT_MAX_CHARS

    def __post_init__(self) -> None:
        _check_limits(self.time_limit_s, self.max_chars)

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
               prompt_id: str | None = None) -> str:
        """The prompt text for ``messages`` (``{"role", "content"}`` dicts), as ``apply_chat_template(
        messages, tokenize=False, add_generation_prompt=...)`` gives it.

        Raises :class:`ChatTemplateError` naming the file, the template line and ``prompt_id``
        for any failure: an error the template raises or hits, or a limit it passes.
        """
        env = self.template.environment
        env.budget = budget = _Budget(self.time_limit_s, self.max_chars)
        parts: list[str] = []
        try:
            n = 0
            for chunk in self.template.generate(
                    messages=[dict(m) for m in messages], tools=None, documents=None,
                    add_generation_prompt=add_generation_prompt, **self.special_tokens):
                n += len(chunk)
                if n > self.max_chars:
                    raise _LimitExceeded(f"its output passed {self.max_chars} characters (data.chat_max_chars)")
                budget.tick()
                parts.append(chunk)
        except Exception as e:  # noqa: BLE001 - the template is untrusted code: whatever it raises is its fault
            what = str(e) if isinstance(e, _LimitExceeded) else _describe(e)
            of = f" prompt {prompt_id!r}" if prompt_id is not None else ""
            at = _at_line(self.source, _template_line(e, self.template.filename))
            raise ChatTemplateError(f"chat template of {self.source} failed to render{of}{at}: {what}") from None
        finally:
            env.budget = None
        return "".join(parts)


def _check_limits(time_limit_s: float, max_chars: int) -> None:
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not (
            0 < time_limit_s < math.inf):
        raise ValueError(f"data.chat_time_limit_s must be a positive number of seconds, got {time_limit_s!r}")
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
        raise ValueError(f"data.chat_max_chars must be an integer >= 1, got {max_chars!r}")


def _describe(e: BaseException) -> str:
    """``Type: message`` (the message alone for what the template raised itself: ``raise_exception``)."""
    import jinja2

    if type(e) is jinja2.TemplateError:
        return str(e)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _at_line(source: Path, line: int | None) -> str:
    """`` at line N`` of the template (of the ``chat_template`` string, in ``tokenizer_config.json``)."""
    if not line:
        return ""
    return f" at line {line}" if source.name != TOKENIZER_CONFIG else f" at chat_template line {line}"


def _template_line(e: BaseException, filename: str | None) -> int | None:
    """The template line ``e`` was raised on (Jinja2 rewrites a render's traceback onto template lines)."""
    line = None
    tb = e.__traceback__
    while tb is not None:
        if filename and tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _size(value: Any) -> int:
    """What a value costs against ``max_chars``: a sequence's length, an int's decimal digits (about)."""
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3
    return 0


class _Budget:
    """One render's limits: a wall-clock deadline and the largest value it may build."""

    def __init__(self, time_limit_s: float, max_chars: int) -> None:
        self.time_limit_s, self.max_chars = time_limit_s, max_chars
        self.deadline = time.monotonic() + time_limit_s

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _LimitExceeded(f"it ran past its time limit of {self.time_limit_s:g} s (data.chat_time_limit_s)")

    def fits(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise _LimitExceeded(f"{what} of {size} characters, over data.chat_max_chars={self.max_chars}")

    def checked(self, value: Any) -> Any:
        self.fits(_size(value), f"it built a {type(value).__name__}")
        return value

    def binop(self, op: str, a: Any, b: Any) -> None:
        """Refuses ``a <op> b`` before it is computed when its result would be over the size limit."""
        size = 0
        if op == "*" and isinstance(a, int) and isinstance(b, int):
            size = _size(a) + _size(b)
        elif op == "*":
            seq, n = (a, b) if isinstance(b, int) else (b, a)
            size = _size(seq) * n if isinstance(n, int) else 0
        elif op == "+":
            size = _size(a) + _size(b)
        elif op == "**" and isinstance(a, int) and isinstance(b, int) and b > 0:
            size = a.bit_length() * b // 3
        self.fits(size, f"its '{op}' would build a value")


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


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"{path} is not valid UTF-8 (byte {e.start + 1}: {e.reason})") from None
    except OSError as e:
        raise ChatTemplateError(f"cannot read {path}: {e.strerror or e}") from None


def load_chat_template(checkpoint: str | Path, *, time_limit_s: float = DEFAULT_CHAT_TIME_LIMIT_S,
                       max_chars: int = DEFAULT_CHAT_MAX_CHARS) -> ChatTemplate:
    """The chat template of the checkpoint directory ``checkpoint`` (or GGUF file: its
    ``tokenizer.chat_template``), each render bounded by
    ``time_limit_s`` and ``max_chars`` (``data.chat_time_limit_s``, ``data.chat_max_chars``).

    ``chat_template.jinja`` wins over ``tokenizer_config.json``'s
    ``chat_template`` (as in ``transformers``). Raises :class:`ChatTemplateError`
    naming the file when there is no template, a file cannot be read or the
    template does not compile.
    """
    _check_limits(time_limit_s, max_chars)
    d = Path(checkpoint)
    if d.suffix.lower() == ".gguf":
        return _gguf_template(d, time_limit_s, max_chars)
    cfg_file = d / TOKENIZER_CONFIG
    cfg: dict[str, Any] = {}
    if cfg_file.is_file():
        try:
            loaded = json.loads(_read(cfg_file))
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"{cfg_file} is not valid JSON: {e}") from None
        except RecursionError:
            raise ChatTemplateError(f"{cfg_file} is not usable JSON: nested too deeply") from None
        if not isinstance(loaded, dict):
            raise ChatTemplateError(f"{cfg_file} must hold a JSON object")
        cfg = loaded
    jinja_file = d / TEMPLATE_FILE
    if jinja_file.is_file():
        source, text = jinja_file, _read(jinja_file)
    elif cfg.get("chat_template") is not None:
        source, text = cfg_file, _template_text(cfg["chat_template"], cfg_file)
    else:
        what = f"{cfg_file} has no 'chat_template'" if cfg_file.is_file() else f"{cfg_file} does not exist"
        raise ChatTemplateError(f"data.chat=true needs the target's chat template, but {what} (and there is no "
                                f"{jinja_file}): set data.chat=false for a model without one")
    specials = {k: t for k, v in cfg.items() if k.endswith("_token") and (t := _token_text(v)) is not None}
    return ChatTemplate(source=source, template=_compile(text, source), special_tokens=specials,
                        time_limit_s=time_limit_s, max_chars=max_chars)


def _gguf_template(path: Path, time_limit_s: float, max_chars: int) -> ChatTemplate:
    """The chat template of a GGUF file: its ``tokenizer.chat_template`` metadata."""
    from specdec.core.checkpoint import CheckpointError
    from specdec.core.gguf import open_gguf

    try:
        g = open_gguf(path)
    except CheckpointError as e:
        raise ChatTemplateError(str(e)) from None
    text = g.chat_template()
    if text is None:
        raise ChatTemplateError(f"data.chat=true needs the target's chat template, but {path} has no "
                                "'tokenizer.chat_template': set data.chat=false for a model without one")
    return ChatTemplate(source=path, template=_compile(text, path), special_tokens=g.special_tokens(),
                        time_limit_s=time_limit_s, max_chars=max_chars)


def _sandbox() -> tuple[Any, Any]:
    """The environment ``transformers`` renders chat templates in, with :class:`_Budget` checks
    wherever a render can spend time or memory (see the module's docstring), and the transformer
    that guards a parsed template's loops and concatenations."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import _PassArg
    from jinja2.visitor import NodeTransformer

    class Generation(Extension):
        """``{% generation %}…{% endgeneration %}`` (marks assistant text for training masks): its body as is."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})  # (also kept from constant folding)

        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self._local = threading.local()

        @property
        def budget(self) -> _Budget | None:
            return getattr(self._local, "budget", None)

        @budget.setter
        def budget(self, value: _Budget | None) -> None:
            self._local.budget = value

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            if (b := __self.budget) is None:
                return super().call(__context, __obj, *args, **kwargs)
            b.tick()
            return b.checked(super().call(__context, __obj, *args, **kwargs))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if (b := self.budget) is None:
                return super().call_binop(context, operator, left, right)
            b.tick()
            b.binop(operator, left, right)
            return b.checked(super().call_binop(context, operator, left, right))

        def getattr(self, obj: Any, attribute: str) -> Any:
            if (b := self.budget) is not None:
                b.tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            if (b := self.budget) is not None:
                b.tick()
            return super().getitem(obj, argument)

    @jinja2.pass_context
    def guard_loop(context: Any, iterable: Any) -> Any:
        """A ``for`` loop's iterable, the clock checked at every item."""
        b = context.environment.budget
        for item in iterable:
            if b is not None:
                b.tick()
            yield item

    @jinja2.pass_context  # (not folded at compile time)
    def guard_size(context: Any, value: Any) -> Any:
        """A ``~`` concatenation's result, its size checked."""
        b = context.environment.budget
        return value if b is None else b.checked(value)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Guard(NodeTransformer):
        """Routes every ``for`` loop's iterable through ``guard_loop`` and every ``~`` through ``guard_size``."""

        def visit_For(self, node: nodes.For) -> nodes.Node:
            node = self.generic_visit(node)
            node.iter = nodes.Filter(node.iter, GUARD_LOOP, [], [], None, None, lineno=node.lineno)
            return node

        def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
            node = self.generic_visit(node)
            return nodes.Filter(node, GUARD_SIZE, [], [], None, None, lineno=node.lineno)

    # optimized=False: no constant folding, which would run a template's constant expressions
    # ('x' | center(10 ** 9)) at compile time, outside every limit (the filters and intercepted
    # operators are kept from the folding of constant output that the compiler does regardless)
    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols], optimized=False)

    def bounded(f: Any) -> Any:
        """Filter ``f``, the clock checked before it runs and the size of what it returns after;
        taking the context, so that the compiler never runs it on constants ahead of the render."""
        pass_arg = _PassArg.from_obj(f)

        @jinja2.pass_context
        @functools.wraps(f)
        def wrapper(context: Any, *args: Any, **kwargs: Any) -> Any:
            first = {_PassArg.context: (context,), _PassArg.environment: (context.environment,),
                     _PassArg.eval_context: (context.eval_ctx,)}.get(pass_arg, ())  # type: ignore[call-overload]
            if (b := env.budget) is None:
                return f(*first, *args, **kwargs)
            b.tick()
            return b.checked(f(*first, *args, **kwargs))

        return wrapper

    env.filters["tojson"] = tojson
    env.filters = {name: bounded(f) for name, f in env.filters.items()}
    env.filters[GUARD_LOOP], env.filters[GUARD_SIZE] = guard_loop, guard_size
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env, Guard()


GUARD_LOOP, GUARD_SIZE = "_specdec_guard_loop", "_specdec_guard_size"


def _compile(text: str, source: Path) -> Any:
    """``text`` compiled in :func:`_sandbox`, its ``for`` loops and ``~`` guarded, under ``source``'s
    name (a render's traceback then points at template lines)."""
    env, guard = _sandbox()
    try:
        tree = guard.visit(env.parse(text))
        return env.template_class.from_code(env, env.compile(tree, filename=str(source)), env.make_globals(None))
    except Exception as e:  # noqa: BLE001 - a syntax error, or one the compiler hits (e.g. nested too deeply)
        import jinja2

        syntax = isinstance(e, jinja2.TemplateSyntaxError)
        at = _at_line(source, e.lineno if syntax else None)
        raise ChatTemplateError(f"chat template of {source} does not compile{at}: "
                                f"{e.message if syntax else _describe(e)}") from None


def conversation_prompt(turns: Sequence[str], answers: Sequence[str], template: ChatTemplate | None, *,
                        prompt_id: str | None = None) -> str:
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
    return template.render(messages, add_generation_prompt=True, prompt_id=prompt_id)
