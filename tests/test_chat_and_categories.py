"""Chat templates, multi-turn conversations, per-category figures and the repetition figure.

Templates render exactly as ``transformers.apply_chat_template`` does (the
reference, imported in the tests only); a conversation's turn 2 is generated
after each pipeline's own answer to turn 1; ``summary.json`` and the console
table break the figures down by prompt category. End-to-end runs use the tiny
checkpoints of :mod:`test_experiment`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_experiment import _compose, _lines, _overrides, _tokenizer_json, tiny_pair  # noqa: F401 (a fixture)

from specdec.data import DataConfig, PromptDataError, load_prompts
from specdec.data.chat import ChatTemplateError, conversation_prompt, load_chat_template
from specdec.experiment import run_experiment, summarize
from specdec.experiment.summary import CATEGORY_KEYS, PLAIN_CATEGORY_KEYS, Repetition, repetition
from specdec.logging import summary_table

FAST = ("logger=none", "plots=false", "warmup=0")

LLAMA2 = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] | trim }} [/INST]"
    "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
)
CHATML = """{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are helpful.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
NAMESPACE_TOJSON = """{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
{%- if m.role == 'system' %}{% continue %}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
{%- if m.role == 'assistant' -%}
{% generation %}A{{ ns.n }}: {{ m.content | tojson }}{% endgeneration %}{{ eos_token }}
{% else %}U{{ ns.n }}: {{ m.content | tojson }}
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}A{{ ns.n + 1 }}:{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "  Write <b>bold</b> & \"quoted\" text, é.  "}],
    [{"role": "user", "content": "First?"}, {"role": "assistant", "content": "Yes.\nTwo lines."},
     {"role": "user", "content": "Second?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
]


def _tokenizer_dir(path: Path, template: str | None, *, jinja_file: bool = False) -> Path:
    """A tokenizer directory: tokenizer.json, tokenizer_config.json (bos as an AddedToken dict, eos a string)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_tokenizer_json())
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>",
                           "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True}}
    if template is not None and not jinja_file:
        cfg["chat_template"] = template
    elif template is not None:
        (path / "chat_template.jinja").write_text(template)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


# --------------------------------------------------------------------------------------
# chat templates
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("template", "jinja_file"),
                         [(LLAMA2, False), (CHATML, False), (CHATML, True), (NAMESPACE_TOJSON, False)],
                         ids=["llama2", "chatml", "chatml-jinja-file", "namespace-tojson-generation"])
def test_chat_template_renders_as_transformers(tmp_path, template, jinja_file):
    transformers = pytest.importorskip("transformers")
    d = _tokenizer_dir(tmp_path / "tok", template, jinja_file=jinja_file)
    ours = load_chat_template(d)
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    convs = CONVERSATIONS if template != LLAMA2 else CONVERSATIONS[:2]  # llama2 refuses a system turn
    for messages in convs:
        want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.render(messages) == want, messages
    if template == LLAMA2:
        assert ours.render(CONVERSATIONS[0]).startswith("<s>[INST] Write")  # bos_token from the AddedToken dict


def test_chat_template_errors_name_the_file(tmp_path):
    no_template = _tokenizer_dir(tmp_path / "plain", None)
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json has no 'chat_template'"):
        load_chat_template(no_template)
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json does not exist"):
        load_chat_template(tmp_path)
    bad = _tokenizer_dir(tmp_path / "bad", "{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match=r"bad/tokenizer_config\.json does not compile"):
        load_chat_template(bad)
    strict = load_chat_template(_tokenizer_dir(tmp_path / "strict", LLAMA2))
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        strict.render([{"role": "assistant", "content": "x"}])


def test_conversation_prompt_without_template_concatenates():
    assert conversation_prompt(["a"], [], None) == "a"
    assert conversation_prompt(["Q1 ", "Q2 "], ["A1. "], None) == "Q1 A1. Q2 "
    with pytest.raises(ValueError, match="2 turns need 1 answers"):
        conversation_prompt(["Q1", "Q2"], [], None)


def test_chat_without_template_fails_naming_the_file(tiny_pair, tmp_path):
    with pytest.raises(ChatTemplateError, match=r"target/tokenizer_config\.json does not exist"):
        run_experiment(_compose(_overrides(tiny_pair, tmp_path / "run", *FAST, "data.chat=true")))


def test_turn_null_loads_every_turn(tmp_path):
    f = tmp_path / "q.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["Write.", "Shorter."]},
            {"question_id": 2, "category": "math", "turns": ["2+2?"]},
            {"question_id": 3, "prompt": "plain text"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ps = load_prompts(DataConfig(path=str(f), turn=None))
    assert [(p.text, p.turns, p.source) for p in ps] == [
        ("Write.", ("Write.", "Shorter."), "writing"), ("2+2?", (), "math"), ("plain text", (), None)]
    assert [p.turns for p in load_prompts(DataConfig(path=str(f)))] == [(), (), ()]  # turn 0: the first alone
    assert all(p.source is None for p in load_prompts(DataConfig(path=str(f), source_field=None)))


# --------------------------------------------------------------------------------------
# repetition
# --------------------------------------------------------------------------------------
def test_repetition_on_hand_made_outputs():
    loop = [1, 2, 3, 4] * 4  # 13 4-grams, 4 distinct; (1, 2, 3, 4) occurs 4 times
    almost = [1, 2, 3, 4] * 3 + [1, 2, 3]  # 12 4-grams, each 3 times: not a loop
    same = [7] * 7  # (7, 7, 7, 7) 4 times, overlapping
    fresh = list(range(10))  # 7 4-grams, all distinct
    assert repetition([loop]) == {"loop_share": 1.0, "distinct_4": 4 / 13}
    assert repetition([almost]) == {"loop_share": 0.0, "distinct_4": 4 / 12}
    assert repetition([same]) == {"loop_share": 1.0, "distinct_4": 1 / 4}
    assert repetition([fresh]) == {"loop_share": 0.0, "distinct_4": 1.0}
    # pooled: counts add over outputs; a 4-gram shared by two outputs counts in each
    assert repetition([loop, fresh, fresh, [1, 2]]) == {"loop_share": 0.25, "distinct_4": (4 + 7 + 7) / (13 + 7 + 7)}
    assert repetition([[1, 2, 3]]) == {"loop_share": 0.0, "distinct_4": None}
    assert repetition([]) == {"loop_share": None, "distinct_4": None}
    assert Repetition.of(loop) + Repetition.of(fresh) == Repetition(outputs=2, looping=1, ngrams=20, distinct=11)


# --------------------------------------------------------------------------------------
# per-category figures (hand-made records)
# --------------------------------------------------------------------------------------
def _rec(rid: str, source: str | None, plain_s: float, method_s: float, *, equal: bool = True,
         error: str | None = None, accepted: int = 6) -> dict[str, Any]:
    """A results.jsonl line: 10 tokens each way, 4 steps of γ = 3."""
    plain = {"output_len": 10, "time_share_s": plain_s, "error": None,
             "repetition": {"outputs": 1, "looping": int(rid.endswith("loop")), "ngrams": 7, "distinct": 7}}
    m = {"output_len": 0 if error else 10, "time_share_s": method_s, "error": error, "steps": 4, "proposed": 12,
         "accepted": accepted, "bonus": 4, "reached": [4, 3, 2], "accepted_at": [3, 2, 1],
         "accepted_hist": [1, 1, 1, 1], "equal_to_plain": None if error else equal, "tau": (accepted + 4) / 4}
    return {"id": rid, "source": source, "plain": plain, "methods": {"m": m}}


def test_summary_by_category():
    recs = [_rec("a1", "code", 1.0, 0.5), _rec("a2-loop", "code", 1.0, 0.5),
            _rec("b1", "chat", 1.0, 1.0, equal=False, accepted=2), _rec("b2", "chat", 1.0, 1.0, error="boom")]
    s = summarize(recs, gammas={"m": 3}, greedy=True)
    code, chat = s["methods"]["m"]["by_category"]["code"], s["methods"]["m"]["by_category"]["chat"]
    assert list(s["methods"]["m"]["by_category"]) == ["code", "chat"]
    assert tuple(code) == CATEGORY_KEYS and tuple(s["plain"]["by_category"]["chat"]) == PLAIN_CATEGORY_KEYS
    assert code == {"requests": 2, "tokens_per_s": 20.0, "plain_tokens_per_s": 10.0, "speedup": 2.0,
                    "tau": 2.5, "alpha": 0.5, "outputs_equal": True, "errors": 0}
    # chat: the failed request is out of the speed figures, counted in errors, and the category is not equal
    assert chat == {"requests": 1, "tokens_per_s": 10.0, "plain_tokens_per_s": 10.0, "speedup": 1.0,
                    "tau": 1.5, "alpha": 2 / 12, "outputs_equal": False, "errors": 1}
    assert s["plain"]["by_category"]["code"] == {"requests": 2, "tokens": 20, "tokens_per_s": 10.0, "errors": 0}
    assert s["methods"]["m"]["speedup"] == pytest.approx(30 / 2.0 / (30 / 3.0))  # overall: all three compared
    assert s["plain"]["repetition"] == {"loop_share": 0.25, "distinct_4": 1.0}
    assert s["methods"]["m"]["repetition"] == {"loop_share": None, "distinct_4": None}  # methods recorded none

    table = summary_table(s)
    main, per_cat = table.split("per category:")
    assert "loops" in main.splitlines()[0] and "0.25" in main
    rows = [line.split() for line in per_cat.strip().splitlines()[2:]]
    assert [r[:2] for r in rows] == [["code", "plain"], ["code", "m"], ["chat", "plain"], ["chat", "m"]]
    assert rows[1][4] == "2.00" and rows[3][-2:] == ["NO", "1"]  # speedup; equal, errors

    one = summarize([_rec("a1", "code", 1.0, 0.5)], gammas={"m": 3}, greedy=True)
    assert list(one["methods"]["m"]["by_category"]) == ["code"] and "per category" not in summary_table(one)
    none = summarize([_rec("a1", None, 1.0, 0.5)], gammas={"m": 3}, greedy=True)
    assert "by_category" not in none["plain"] and "by_category" not in none["methods"]["m"]
    mixed = summarize([_rec("a1", None, 1.0, 0.5), _rec("b1", "chat", 1.0, 1.0)], gammas={"m": 3}, greedy=True)
    assert list(mixed["plain"]["by_category"]) == ["uncategorized", "chat"]


# --------------------------------------------------------------------------------------
# multi-turn runs, end to end
# --------------------------------------------------------------------------------------
CONV = [
    {"question_id": 81, "category": "writing", "turns": ["def f(x):\n    return ", "\ndef g(y):\n"]},
    {"question_id": 82, "category": "math", "turns": ["x = 1 + ", "\ny = x * "]},
    {"question_id": 83, "category": "math", "turns": ["import os\n"]},  # one turn among conversations
]


def _conversation_run(tiny_pair: tuple[Path, Path, Path], run_dir: Path, prompts: Path, *extra: str) -> list[str]:
    """The test run's overrides with Spec-Bench's data layout (every turn) over ``prompts``; ``extra`` wins."""
    keys = {o.split("=")[0] for o in extra}
    base = [o for o in _overrides(tiny_pair, run_dir, *FAST)
            if not o.startswith("data") and o.split("=")[0] not in keys]
    return [*base, "data=spec_bench", f"data.path={prompts}", *extra]


def _bos_tokenizer_json() -> str:
    """The test tokenizer with a special ``<s>`` that it puts before every text it encodes (as Llama's does)."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_str(_tokenizer_json())
    tok.add_special_tokens(["<s>"])
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    return tok.to_str()


def _tok(path: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


def test_multi_turn_feeds_back_each_pipelines_answer_and_splits_by_category(tiny_pair, tmp_path):
    target, _, _ = tiny_pair
    f = tmp_path / "question.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in CONV))
    run_dir = tmp_path / "run"
    s = run_experiment(_compose(_conversation_run(tiny_pair, run_dir, f)))
    recs = {r["id"]: r for r in _lines(run_dir / "results.jsonl")}
    tok = _tok(target)
    for q in CONV[:2]:
        r, (t1, t2) = recs[str(q["question_id"])], q["turns"]
        plain = r["plain"]
        assert r["num_turns"] == 2 and len(plain["turns"]) == 2 and plain["output_len"] == 16
        first, second = plain["turns"]
        assert first["prompt"] == t1 and r["prompt_len"] == first["prompt_len"] == len(tok.encode(t1).ids)
        assert first["output_len"] == second["output_len"] == 8
        # turn 2 comes after the model's own answer to turn 1 (no template: plain concatenation)
        assert second["prompt"] == t1 + first["text"] + t2
        assert second["prompt_len"] == len(tok.encode(second["prompt"]).ids)
        assert plain["time_s"] == pytest.approx(first["time_s"] + second["time_s"])
        for name, e in r["methods"].items():
            assert [t["prompt"] for t in e["turns"]] == [first["prompt"], second["prompt"]], name
            assert [t["output_ids"] for t in e["turns"]] == [first["output_ids"], second["output_ids"]], name
            assert [t["equal_to_plain"] for t in e["turns"]] == [True, True] and e["equal_to_plain"] is True
            assert e["steps"] == sum(t["steps"] for t in e["turns"]) > 0
            assert e["accepted"] == sum(t["accepted"] for t in e["turns"])
            assert e["tau"] == pytest.approx((e["accepted"] + e["bonus"]) / e["steps"])
            assert e["output_len"] == 16
    single = recs["83"]
    assert single["num_turns"] == 1 and "turns" not in single["plain"] and single["plain"]["output_len"] == 8

    assert s["outputs_equal"] is True and s["complete"]
    for name in ("draft_model", "ngram"):
        m = s["methods"][name]
        assert m["tokens"] == 16 + 16 + 8 and m["requests"] == 3
        assert set(m["by_category"]) == {"writing", "math"}
        assert m["by_category"]["math"]["requests"] == 2 and m["by_category"]["writing"]["requests"] == 1
        assert all(c["outputs_equal"] is True and c["errors"] == 0 and c["speedup"] > 0
                   for c in m["by_category"].values())
        assert set(m["repetition"]) == {"loop_share", "distinct_4"}
        assert m["repetition"] == s["plain"]["repetition"]  # greedy: the same outputs, the same repetition
    assert s["plain"]["by_category"]["math"]["tokens"] == 24
    lines = (run_dir / "summary.txt").read_text()
    assert "loops" in lines and "per category:" in lines and "writing" in lines.split("per category:")[1]


def test_multi_turn_with_chat_template(tiny_pair, tmp_path):
    transformers = pytest.importorskip("transformers")
    target, _, _ = tiny_pair
    chat_target = tmp_path / "chat_target"
    shutil.copytree(target, chat_target)
    _tokenizer_dir(chat_target, LLAMA2)
    (chat_target / "tokenizer.json").write_text(_bos_tokenizer_json())
    f = tmp_path / "question.jsonl"
    f.write_text(json.dumps(CONV[0]) + "\n")
    run_dir = tmp_path / "run"
    run_experiment(_compose(_conversation_run(tiny_pair, run_dir, f, f"target.path={chat_target}", "method=ngram",
                                              "sampling.max_new_tokens=6", "data.chat=true")))
    (rec,) = _lines(run_dir / "results.jsonl")
    first, second = rec["plain"]["turns"]
    t1, t2 = CONV[0]["turns"]
    hf = transformers.AutoTokenizer.from_pretrained(str(chat_target))
    answer = [{"role": "user", "content": t1}, {"role": "assistant", "content": first["text"]}]
    assert first["prompt"] == hf.apply_chat_template(answer[:1], tokenize=False, add_generation_prompt=True)
    assert second["prompt"] == hf.apply_chat_template([*answer, {"role": "user", "content": t2}], tokenize=False,
                                                      add_generation_prompt=True)
    assert second["prompt"].startswith(first["prompt"]) and first["text"] in second["prompt"]
    tok = _tok(chat_target)
    for turn in (first, second):  # the rendered text brings its BOS; the tokenizer must not add another
        ids = tok.encode(turn["prompt"], add_special_tokens=False).ids
        assert turn["prompt_len"] == len(ids) == len(tok.encode(turn["prompt"]).ids) - 1
        assert ids.count(tok.token_to_id("<s>")) == 1
    assert rec["prompt_len"] == first["prompt_len"]
    ngram = rec["methods"]["ngram"]
    assert [t["prompt"] for t in ngram["turns"]] == [first["prompt"], second["prompt"]]
    assert ngram["equal_to_plain"] is True and ngram["output_len"] == rec["plain"]["output_len"] == 12


def test_a_failed_turn_ends_that_conversation_and_is_counted(tiny_pair, tmp_path):
    """Turn 2 outgrows runtime.max_seq_len: rejected in every pipeline, named by turn; the one-turn request runs."""
    f = tmp_path / "question.jsonl"
    f.write_text(json.dumps(CONV[0]) + "\n" + json.dumps(CONV[2]) + "\n")
    run_dir = tmp_path / "run"
    s = run_experiment(_compose(_conversation_run(tiny_pair, run_dir, f, "method=ngram", "runtime.max_seq_len=32")))
    recs = {r["id"]: r for r in _lines(run_dir / "results.jsonl")}
    conv = recs["81"]
    for e in (conv["plain"], conv["methods"]["ngram"]):
        assert e["error"].startswith("turn 2: ") and "max_seq_len" in e["error"]
        assert [t["error"] is None for t in e["turns"]] == [True, False]
        assert e["turns"][0]["output_len"] > 0 and e["output_len"] == e["turns"][0]["output_len"]
    assert conv["methods"]["ngram"]["equal_to_plain"] is None  # not compared
    assert conv["methods"]["ngram"]["turns"][0]["equal_to_plain"] is True
    assert recs["83"]["methods"]["ngram"]["equal_to_plain"] is True
    assert s["errors"] == 1 and not s["complete"] and s["outputs_equal"] is None
    assert s["methods"]["ngram"]["by_category"]["writing"]["errors"] == 1
    assert s["methods"]["ngram"]["by_category"]["math"] == {**s["methods"]["ngram"]["by_category"]["math"],
                                                             "requests": 1, "errors": 0, "outputs_equal": True}


@pytest.mark.parametrize(("template", "limit", "message"), [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "data.chat_time_limit_s=0.3", r"time limit of 0\.3 s \(data\.chat_time_limit_s\)"),
    ("{{ messages[0]['content'] * 1000 }}", "data.chat_max_chars=50", r"over data\.chat_max_chars=50"),
], ids=["time", "size"])
def test_chat_template_limits_are_set_by_the_data_config(tiny_pair, tmp_path, template, limit, message):
    """A template that hangs or blows up ends the run before it starts, within the limit the config sets,
    naming the file and the prompt."""
    target, _, _ = tiny_pair
    chat_target = tmp_path / "chat_target"
    shutil.copytree(target, chat_target)
    _tokenizer_dir(chat_target, template, jinja_file=True)
    cfg = _compose(_overrides(tiny_pair, tmp_path / "run", *FAST, "method=ngram", f"target.path={chat_target}",
                              "data.chat=true", limit))
    with pytest.raises(ChatTemplateError, match=r"chat_target/chat_template\.jinja failed to render prompt 'p0' at "
                                                rf"line 1: .*{message}"):
        run_experiment(cfg)


def test_prompt_files_with_bad_bytes_or_deep_nesting_name_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"prompt": "ok"}\n\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(PromptDataError, match=rf"^{f}:3: not valid UTF-8 \(byte 16 of the line: invalid continuation"):
        load_prompts(DataConfig(path=str(f)))
    f.write_text('{"prompt": "ok"}\n{"prompt": "x", "meta": ' + "[" * 100000 + "]" * 100000 + "}\n")
    with pytest.raises(PromptDataError, match=rf"^{f}:2: JSON nested too deeply to read"):
        load_prompts(DataConfig(path=str(f)))
    f.write_bytes(b'{"prompt": "ok"}\r\n{"prompt": "caf\xc3\xa9"}\r\n')  # UTF-8, CRLF
    assert [p.text for p in load_prompts(DataConfig(path=str(f)))] == ["ok", "café"]


def test_a_chat_template_failing_on_a_later_turn_ends_only_that_conversation(tiny_pair, tmp_path):
    """The template renders each pipeline's own answers: failing there fails that turn alone, named."""
    target, _, _ = tiny_pair
    chat_target = tmp_path / "chat_target"
    shutil.copytree(target, chat_target)
    _tokenizer_dir(chat_target, "{% if messages|length > 1 %}{{ 1 / 0 }}{% endif %}"
                                "{% for m in messages %}{{ m['content'] }}{% endfor %}", jinja_file=True)
    shutil.copy(target / "tokenizer.json", chat_target / "tokenizer.json")
    f = tmp_path / "question.jsonl"
    f.write_text(json.dumps(CONV[0]) + "\n" + json.dumps(CONV[2]) + "\n")
    run_dir = tmp_path / "run"
    s = run_experiment(_compose(_conversation_run(tiny_pair, run_dir, f, f"target.path={chat_target}",
                                                  "method=ngram", "data.chat=true")))
    recs = {r["id"]: r for r in _lines(run_dir / "results.jsonl")}
    for e in (recs["81"]["plain"], recs["81"]["methods"]["ngram"]):
        assert e["error"].startswith("turn 2: ") and "chat_template.jinja" in e["error"]
        assert "ZeroDivisionError" in e["error"] and "'81'" in e["error"]
        assert [t["error"] is None for t in e["turns"]] == [True, False] and e["turns"][0]["output_len"] > 0
    assert recs["83"]["methods"]["ngram"]["equal_to_plain"] is True and recs["83"]["plain"]["error"] is None
    assert s["errors"] == 1 and not s["complete"]
