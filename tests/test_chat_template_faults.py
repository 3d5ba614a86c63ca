"""A chat template is untrusted code: every way it can fail, hang or blow up memory ends as a
``ChatTemplateError`` naming the file (and the template line and prompt where there are ones),
within ``data.chat_time_limit_s`` and ``data.chat_max_chars``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from specdec.data import DataConfig
from specdec.data.chat import ChatTemplateError, load_chat_template

MESSAGES = [{"role": "user", "content": "hi"}]


def _jinja(tmp_path: Path, template: str | bytes) -> Path:
    """A checkpoint dir whose chat template is ``chat_template.jinja``."""
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    f = d / "chat_template.jinja"
    f.write_bytes(template if isinstance(template, bytes) else template.encode())
    return d


def _render(d: Path, **limits) -> str:
    return load_chat_template(d, **limits).render(MESSAGES, prompt_id="q7")


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    # a stored range: the inner loops make no call at all
    "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% for k in r %}{% endfor %}{% endfor %}{% endfor %}",
    # the output captured in a block, never streamed
    "{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}.{% endfor %}{% endfor %}{% endset %}",
], ids=["nested-range", "stored-range", "block-set"])
def test_a_runaway_render_stops_at_the_time_limit(tmp_path, template):
    d = _jinja(tmp_path, template)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja failed to render prompt 'q7' at line 1: it ran "
                                                r"past its time limit of 0\.3 s \(data\.chat_time_limit_s\)"):
        _render(d, time_limit_s=0.3)
    assert time.monotonic() - start < 3


@pytest.mark.parametrize(("template", "refused_before_built"), [
    ("{{ 'x' * 300000000 }}", True),
    ("{{ 2 ** 1000000000 }}", True),
    ("{{ ['x'] * 300000000 }}", True),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", True),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", False),
    ("{% set s = 'x' %}" + "{% set s = s ~ s %}" * 60, False),
    ("{{ 'x' | center(30000000) }}", False),
    ("{{ '%030000000d' % 1 }}", False),
    ("{{ '{:30000000}'.format(1) }}", False),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", False),  # the output itself
], ids=["str-times", "pow", "list-times", "plus-doubling", "concat-doubling", "set-doubling", "center-filter",
        "percent-format", "str-format", "output"])
def test_a_huge_value_is_refused_at_the_size_limit(tmp_path, template, refused_before_built):
    d = _jinja(tmp_path, template)
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja failed to render prompt 'q7'.*"
                                                r"(over data\.chat_max_chars=1000000$|passed 1000000 characters)") as e:
        _render(d, max_chars=1_000_000)
    assert ("would build" in str(e.value)) == refused_before_built, e.value


@pytest.mark.parametrize(("template", "line", "error"), [
    ("{{ 'a' }}\n\n{{ 1 / 0 }}", 3, "ZeroDivisionError: division by zero"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}\n{{ f(0) }}", 1, "RecursionError"),
    ("{{ range(1000000) | length }}", 1, "OverflowError: Range too big"),
    ("\n{{ system.name }}", 2, "UndefinedError: 'system' is undefined"),
    ("{{ messages.append(1) }}", 1, "SecurityError: access to attribute 'append'"),
    ("{{ messages[0].content.__class__.__mro__ }}", 1, "SecurityError: access to attribute '__class__'"),
    ("{{ 1 + 'a' }}", 1, "TypeError"),
    ("{{ 10 ** 5000 }}", 1, "ValueError: Exceeds the limit"),
    ("{{ raise_exception('only user turns') }}", 1, ": only user turns"),
], ids=["zero-division", "recursion", "huge-range", "undefined", "security", "dunder", "type", "int-digits",
        "raise-exception"])
def test_every_render_failure_names_the_file_line_and_prompt(tmp_path, template, line, error):
    d = _jinja(tmp_path, template)
    with pytest.raises(ChatTemplateError) as e:
        _render(d)
    assert str(e.value).startswith(f"chat template of {d / 'chat_template.jinja'} failed to render prompt 'q7' at "
                                   f"line {line}: "), e.value
    assert error in str(e.value)


def test_templates_that_cannot_be_read_or_compiled_name_the_file(tmp_path):
    jinja = tmp_path / "ckpt" / "chat_template.jinja"
    with pytest.raises(ChatTemplateError, match=rf"^{jinja} is not valid UTF-8 \(byte 3: invalid start byte\)"):
        load_chat_template(_jinja(tmp_path, b"{{\xff }}"))
    with pytest.raises(ChatTemplateError, match=rf"^chat template of {jinja} does not compile at line 2: "):
        load_chat_template(_jinja(tmp_path, "ok\n{% for m in %}"))
    with pytest.raises(ChatTemplateError, match=rf"^chat template of {jinja} does not compile: RecursionError"):
        load_chat_template(_jinja(tmp_path, "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}"))

    cfg = tmp_path / "json" / "tokenizer_config.json"
    cfg.parent.mkdir()
    cfg.write_bytes(b'{"chat_template": "caf\xe9"}')
    with pytest.raises(ChatTemplateError, match=rf"^{cfg} is not valid UTF-8"):
        load_chat_template(cfg.parent)
    cfg.write_text('{"chat_template": "x", "a": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(ChatTemplateError, match=rf"^{cfg} is not usable JSON: nested too deeply"):
        load_chat_template(cfg.parent)
    cfg.write_text(json.dumps({"chat_template": "line 1\n{{ 1 // 0 }}"}))
    with pytest.raises(ChatTemplateError, match=rf"^chat template of {cfg} failed to render at chat_template line 2: "
                                                "ZeroDivisionError"):
        load_chat_template(cfg.parent).render(MESSAGES)


def test_limits_are_checked_and_kept(tmp_path):
    d = _jinja(tmp_path, "{{ messages[0]['content'] }}")
    assert _render(d, time_limit_s=0.5, max_chars=2) == "hi"
    with pytest.raises(ChatTemplateError, match="passed 1 characters"):
        _render(d, max_chars=1)
    for bad in ({"time_limit_s": 0}, {"time_limit_s": float("inf")}, {"max_chars": 0}, {"max_chars": 1.5}):
        with pytest.raises(ValueError, match=r"data\.chat_(time_limit_s|max_chars) must be"):
            _render(d, **bad)
    for key, value in (("chat_time_limit_s", -1.0), ("chat_max_chars", 0)):  # the config: at start, by key
        with pytest.raises(ValueError, match=rf"^data\.{key} must be"):
            DataConfig(path="prompts.jsonl", **{key: value})
