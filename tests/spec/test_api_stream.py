"""The researcher-facing ``LLM``: streaming, stop strings, methods by name or
dict, runtime settings as keywords.

Streams must concatenate to exactly what ``generate`` returns (plain and
speculative); stop strings must cut text and token ids by the documented rule
wherever the stop falls (inside one token, across tokens, across steps, inside
an accepted speculative run); an abandoned stream must free what it held.
The tiny checkpoints get a character-level tokenizer whose last ids are
multi-character tokens (never produced by encoding, but the model can emit
them), so a stop string can begin inside a token.
"""

from __future__ import annotations

import shutil
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specdec.api import LLM, StreamChunk
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.detokenize import IncrementalDetokenizer, RequestText
from specdec.engine import EngineConfig
from specdec.spec.proposers.draft_model import DraftModelConfig
from specdec.spec.proposers.ngram import NgramConfig

from leaks import assert_all_free  # tests/spec/leaks.py

VOCAB = 64
SINGLE = list(string.ascii_lowercase + string.ascii_uppercase + " .\n?")  # 56 one-character tokens
MULTI = ["<a>", "xyz", "ab", "::", "->", "==", "[]", "END"]  # ids 56-63
RUNTIME = dict(max_batch_size=4, max_seq_len=96, block_size=8)
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
PROMPTS = ["the cat sat", "Hello world.", "abc abc ab", "Q?"]
METHODS: dict[str, Callable[[Path], Any]] = {
    "plain": lambda path: None,
    "ngram": lambda path: NgramConfig(num_speculative_tokens=3),
    "draft": lambda path: DraftModelConfig(path=str(path), num_speculative_tokens=3),  # itself: all accepted
}


def _char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SINGLE + MULTI)}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def _byte_tokenizer():
    """Byte-level BPE without merges: one token per UTF-8 byte (characters split over tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _piece(tok: Any, t: int) -> str:
    return tok.decode([t])


@pytest.fixture(scope="module")
def target(tiny_llama, tmp_path_factory) -> Path:
    """A loopy tiny Llama (n-gram drafts get accepted) with the character tokenizer."""
    tiny = tiny_llama(vocab=VOCAB, seed=0, qk_scale=0.1)
    dst = tmp_path_factory.mktemp("chars") / "ckpt"
    shutil.copytree(tiny.path, dst)
    _char_tokenizer().save(str(dst / "tokenizer.json"))
    return dst


@pytest.fixture(scope="module")
def llms(target) -> dict[str, LLM]:
    return {m: LLM(target, make(target), runtime=RuntimeConfig(**RUNTIME)) for m, make in METHODS.items()}


def _joined(chunks: list[StreamChunk]) -> tuple[list[int], str]:
    return [t for c in chunks for t in c.token_ids], "".join(c.text or "" for c in chunks)


# -- incremental detokenization (no model) --------------------------------------


@pytest.mark.parametrize("group", [1, 2, 3, 5])
def test_streamed_text_never_splits_a_multibyte_character(group):
    """Tokens arrive ``group`` at a time (a speculative step); a character's
    bytes are held until complete, and the pieces rebuild the text exactly."""
    tok = _byte_tokenizer()
    text = "aé€😀b 中文 ok ñ"
    ids = tok.encode(text).ids
    assert len(ids) == len(text.encode())  # one token per byte: characters do span tokens
    rt = RequestText(tok)
    pieces: list[str] = []
    taken: list[int] = []
    for i in range(0, len(ids), group):
        rt.update(ids[: i + group])
        got, piece = rt.take()
        pieces.append(piece)
        taken += got
        assert "\ufffd" not in piece
        assert tok.decode(taken) == "".join(pieces)  # ids given out are exactly those of the text given out
    got, piece = rt.take(final=True)
    pieces.append(piece)
    assert "".join(pieces) == text and taken + got == ids


def test_an_unfinished_character_is_flushed_at_the_end():
    tok = _byte_tokenizer()
    ids = tok.encode("a€").ids[:-1]  # the euro sign's last byte never comes
    d = IncrementalDetokenizer(tok)
    assert [d.push(t) for t in ids] == ["a", None, None]  # (3 bytes, 2 of them here)
    assert d.flush() == tok.decode(ids)[1:] and d.flush() == ""


def test_pieces_of_the_builtin_tokenizer_join_to_its_decode():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(__file__).parents[2] / "specdec/zoo/code-target/tokenizer.json"))
    text = "def f(x):\n    return x * 2  # ünïcödé → ok\n\n\tpass"
    ids = tok.encode(text).ids
    d = IncrementalDetokenizer(tok)
    assert "".join(p or "" for p in (d.push(t) for t in ids)) + d.flush() == tok.decode(ids)


def test_stop_rules_on_tokens():
    """Across tokens: text and ids end before the stop. Inside a token: the text
    is cut exactly and the straddling token is dropped from the ids."""
    tok = _char_tokenizer()
    ids = {t: i for i, t in enumerate(SINGLE + MULTI)}

    def run(pieces: list[str], stop: list[str]) -> tuple[RequestText, int | None]:
        rt = RequestText(tok, stop)
        keep = None
        for i in range(len(pieces)):
            keep = rt.update([ids[p] for p in pieces[: i + 1]])
            if keep is not None:
                break
        return rt, keep

    rt, keep = run(["c", "a", "t", "s"], ["at"])  # spans two tokens
    assert (rt.text, rt.token_ids, keep) == ("c", [ids["c"]], 1)
    rt, keep = run(["c", "xyz", "q"], ["yz"])  # begins inside "xyz", ends with it
    assert (rt.text, rt.token_ids, keep) == ("cx", [ids["c"]], 1)
    rt, keep = run(["c", "xyz", "a", "b"], ["za", "xyza", "ca"])  # the earliest in the text wins
    assert (rt.text, rt.token_ids) == ("c", [ids["c"]])
    rt, keep = run(["a", "b", "c"], ["x"])
    assert (rt.text, keep, rt.stopped) == ("abc", None, False)


def test_text_that_may_begin_a_stop_is_held_until_it_cannot():
    tok = _char_tokenizer()
    ids = {t: i for i, t in enumerate(SINGLE + MULTI)}
    rt = RequestText(tok, ["END."])
    rt.update([ids["a"], ids["E"], ids["N"]])
    assert rt.take() == ([ids["a"]], "a")  # "EN" may begin "END."
    rt.update([ids["a"], ids["E"], ids["N"], ids["b"]])
    assert rt.take() == ([ids["E"], ids["N"], ids["b"]], "ENb")  # it did not
    rt.update([ids["a"], ids["E"], ids["N"], ids["b"], ids["END"]])  # a multi-character token: held
    assert rt.take() == ([], "")
    assert rt.update([ids["a"], ids["E"], ids["N"], ids["b"], ids["END"], ids["."]]) == 4
    assert rt.take() == ([], "") and rt.text == "aENb"


# -- stream == generate ------------------------------------------------------------


@pytest.mark.parametrize("method", list(METHODS))
def test_stream_concatenates_to_generate(llms, method):
    llm = llms[method]
    outs = llm.generate(PROMPTS, GREEDY)
    multi_token_chunks = 0
    for prompt, out in zip(PROMPTS, outs):
        chunks = list(llm.stream(prompt, GREEDY))
        assert out.error is None and out.finish_reason == "length"
        assert _joined(chunks) == (out.token_ids, out.text)
        assert out.text == llm.decode(out.token_ids)
        assert chunks[-1].finish_reason == out.finish_reason and chunks[-1].error is None
        assert all(c.finish_reason is None for c in chunks[:-1])
        multi_token_chunks += sum(len(c.token_ids) > 1 for c in chunks)
        ids_prompt = llm.encode(prompt)  # the same prompt as token ids
        assert _joined(list(llm.stream(ids_prompt, GREEDY)))[0] == out.token_ids
    if method == "draft":  # the target drafting for itself: every step accepts γ + 1 tokens
        assert multi_token_chunks >= len(PROMPTS) * 5
    elif method == "ngram":
        assert multi_token_chunks > 0
    else:
        assert multi_token_chunks == 0
    assert_all_free(llm)


def test_stream_with_sampling_matches_generate_with_the_same_seed(llms):
    sp = SamplingParams(temperature=0.9, top_k=20, seed=11, max_new_tokens=30, ignore_eos=True)
    for method in ("plain", "draft"):
        out = llms[method].generate("the cat sat", sp)[0]
        assert _joined(list(llms[method].stream("the cat sat", sp))) == (out.token_ids, out.text)


def test_byte_level_stream_holds_incomplete_characters(tiny_llama, tmp_path):
    """A model over 256 byte tokens emits arbitrary bytes: text is only given out
    when it does not end inside a character, and still joins to generate's."""
    dst = tmp_path / "bytes"
    shutil.copytree(tiny_llama(vocab=256, seed=3).path, dst)
    _byte_tokenizer().save(str(dst / "tokenizer.json"))
    llm = LLM(dst, {"name": "draft_model", "path": str(dst), "num_speculative_tokens": 3}, **RUNTIME)
    for prompt in ("héllo €", "😀😀", "abc"):
        out = llm.generate(prompt, GREEDY)[0]
        chunks = list(llm.stream(prompt, GREEDY))
        assert _joined(chunks) == (out.token_ids, out.text)
        assert not any(c.text.endswith("\ufffd") for c in chunks[:-1] if c.text)
    assert_all_free(llm)


def test_stream_without_a_tokenizer_gives_token_ids(tiny_llama):
    llm = LLM(tiny_llama(vocab=VOCAB, seed=0, qk_scale=0.1).path, "ngram", **RUNTIME)
    out = llm.generate([[1, 2, 3, 1, 2]], GREEDY)[0]
    chunks = list(llm.stream([1, 2, 3, 1, 2], GREEDY))
    assert out.text is None and all(c.text is None for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == out.token_ids and chunks[-1].finish_reason == "length"
    (bad,) = list(llm.stream("text needs a tokenizer", GREEDY))
    # (The LLM's third request: ids run on across its calls and streams.)
    assert bad.request_id == "req-2" and bad.finish_reason == "error"
    assert "'req-2'" in bad.error and "no tokenizer.json" in bad.error


# -- abandoned streams --------------------------------------------------------------


@pytest.mark.parametrize("method", list(METHODS))
def test_an_abandoned_stream_frees_its_request(llms, method):
    llm = llms[method]
    want = llm.generate("the cat sat", GREEDY)[0].token_ids
    for chunk in llm.stream("the cat sat", GREEDY):
        assert chunk.finish_reason is None
        break
    assert_all_free(llm)

    g = llm.stream("Hello world.", GREEDY)
    next(g), next(g)
    g.close()
    assert_all_free(llm)

    with pytest.raises(RuntimeError, match="consumer"):
        for _ in llm.stream("abc abc ab", GREEDY):
            raise RuntimeError("consumer failed")
    assert_all_free(llm)

    # An open stream holds its blocks; the LLM meanwhile serves others, and after both it is as new.
    g = llm.stream("Q?", GREEDY)
    next(g)
    assert llm.generate("the cat sat", GREEDY)[0].token_ids == want
    g.close()
    assert_all_free(llm)
    assert llm.generate("the cat sat", GREEDY)[0].token_ids == want


@pytest.mark.parametrize("method", list(METHODS))
def test_generate_steps_is_generate_one_step_at_a_time_on_its_clock(llms, method):
    """What a benchmark timing runs by turns drives (specdec.measure.lockstep)."""
    llm = llms[method]
    want = llm.generate(PROMPTS, GREEDY)
    ticks = iter(range(1, 10_000))
    steps = llm.generate_steps(PROMPTS, GREEDY, clock=lambda: float(next(ticks)))
    n = 0
    while True:
        try:
            next(steps)
            n += 1
        except StopIteration as done:
            outs = done.value
            break
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == [
        (o.token_ids, o.text, o.finish_reason) for o in want]
    assert n >= 40 // 4 if method != "plain" else n >= 40  # one engine step per next()
    # Timestamps come from the clock given: whole ticks, the first step's after the requests were queued.
    assert all(o.ttft_s == int(o.ttft_s) >= 1 and o.decode_s == int(o.decode_s) >= 1 for o in outs)
    assert_all_free(llm)
    # Closed early: its requests end and free what they held; the LLM is as new.
    steps = llm.generate_steps(PROMPTS, GREEDY)
    next(steps), next(steps)
    steps.close()
    assert_all_free(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in want]
    with pytest.raises(ValueError, match="sampling params for 4 prompts"):
        llm.generate_steps(PROMPTS, [GREEDY])  # checked at the call, not at the first step


def test_a_stream_whose_step_raises_frees_its_request(llms, monkeypatch):
    llm = llms["draft"]
    module = llm.pipeline.target.module
    calls = {"n": 0}
    real = module.forward

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "forward", failing)
    with pytest.raises(RuntimeError, match="injected fault"):
        list(llm.stream("the cat sat", GREEDY))
    monkeypatch.undo()
    assert_all_free(llm)


# -- stop strings ----------------------------------------------------------------


def _expected(tok: Any, ids: list[int], stop: str) -> tuple[list[int], str]:
    """The documented cut: text before the stop's first occurrence; ids whose whole text precedes it."""
    text = "".join(_piece(tok, t) for t in ids)
    cut = text.index(stop)
    keep, end = 0, 0
    for t in ids:
        end += len(_piece(tok, t))
        if end > cut:
            break
        keep += 1
    return ids[:keep], text[:cut]


def _stop_at(tok: Any, ids: list[int], start: int, min_tokens: int = 2) -> tuple[str, int] | None:
    """A stop string made of the texts of ``n >= min_tokens`` tokens from
    ``ids[start]`` on, whose first occurrence in the output begins there: (stop, n)."""
    text = "".join(_piece(tok, t) for t in ids)
    begin = len("".join(_piece(tok, t) for t in ids[:start]))
    for n in range(min_tokens, min(8, len(ids) - start) + 1):
        stop = "".join(_piece(tok, t) for t in ids[start : start + n])
        if stop and text.find(stop) == begin:
            return stop, n
    return None


def _check_stop(llm: LLM, prompt: str, stop: str) -> list[StreamChunk]:
    """generate and stream with ``stop``: both cut by the rule, and equal."""
    full = llm.generate(prompt, GREEDY)[0]
    want_ids, want_text = _expected(llm.tokenizer, full.token_ids, stop)
    sp = SamplingParams(max_new_tokens=GREEDY.max_new_tokens, ignore_eos=True, stop=["never-there", stop])
    out = llm.generate(prompt, sp)[0]
    assert (out.token_ids, out.text, out.finish_reason) == (want_ids, want_text, "stop")
    assert stop not in out.text and out.error is None
    chunks = list(llm.stream(prompt, sp))
    assert _joined(chunks) == (want_ids, want_text) and chunks[-1].finish_reason == "stop"
    assert not any(stop in c.text for c in chunks)
    assert_all_free(llm)
    return chunks


@pytest.mark.parametrize("method", list(METHODS))
def test_a_stop_spanning_tokens(llms, method):
    """A stop of two tokens or more; with speculation, one that begins after the
    first token of a step and ends within it: inside a run of accepted drafts."""
    llm = llms[method]
    for prompt in PROMPTS:
        steps = [c.token_ids for c in llm.stream(prompt, GREEDY)]  # no stop: one chunk per step
        ids = [t for s in steps for t in s]
        pos = 0
        for s in steps:
            start = pos if method == "plain" else pos + 1
            found = _stop_at(llm.tokenizer, ids, start) if method == "plain" or len(s) >= 3 else None
            if found is not None and (method == "plain" or start + found[1] <= pos + len(s)):
                _check_stop(llm, prompt, found[0])
                return
            pos += len(s)
    pytest.fail("no prompt gave a usable stop string")


@pytest.mark.parametrize("method", list(METHODS))
def test_a_stop_spanning_two_steps_is_held_back_while_streaming(llms, method):
    llm = llms[method]
    for prompt in PROMPTS:
        steps = [c.token_ids for c in llm.stream(prompt, GREEDY)]
        ids = [t for s in steps for t in s]
        ends = [sum(map(len, steps[: i + 1])) for i in range(len(steps))]
        for end in ends[1:-1]:  # the stop begins with a step's last token and goes on into the next step
            found = _stop_at(llm.tokenizer, ids, end - 1)
            if found is not None:
                chunks = _check_stop(llm, prompt, found[0])
                assert len(chunks) >= 2
                return
    pytest.fail("no prompt gave a usable stop string")


def test_a_stop_beginning_inside_a_token(llms):
    """The stop begins in the middle of a multi-character token: the text keeps
    that token's part before the stop; its id is dropped."""
    llm = llms["draft"]
    tok = llm.tokenizer
    multi = set(range(len(SINGLE), VOCAB))
    for prompt in [*PROMPTS, "zz", "END", "a->b", "x"]:
        ids = llm.generate(prompt, GREEDY)[0].token_ids
        for i, t in enumerate(ids[:-1]):
            if t in multi:
                head, rest = _piece(tok, t)[:1], _piece(tok, t)[1:]
                text = "".join(_piece(tok, u) for u in ids)
                stop = rest + _piece(tok, ids[i + 1])
                if text.find(stop) != len("".join(_piece(tok, u) for u in ids[:i])) + 1:
                    continue
                chunks = _check_stop(llm, prompt, stop)
                ids_out, text_out = _joined(chunks)
                assert ids_out == ids[:i] and text_out.endswith(head)
                assert tok.decode(ids_out) + head == text_out
                return
    pytest.fail("no output had a multi-character token to stop inside")


def test_a_stop_at_the_first_token(llms):
    llm = llms["draft"]
    ids = llm.generate("the cat sat", GREEDY)[0].token_ids
    found = _stop_at(llm.tokenizer, ids, 0, min_tokens=1)
    assert found is not None
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True, stop=found[0])  # one string: one stop string
    out = llm.generate("the cat sat", sp)[0]
    assert (out.token_ids, out.text, out.finish_reason) == ([], "", "stop")
    assert [(c.token_ids, c.text, c.finish_reason) for c in llm.stream("the cat sat", sp)] == [([], "", "stop")]


def test_a_stop_before_eos_in_the_same_step_wins(llms, tiny_llama, with_eos):
    """EOS and a stop string earlier in the text arrive in one speculative step:
    the output ends before the stop (finish_reason "stop"), not at EOS."""
    tok = llms["draft"].tokenizer

    def pick() -> tuple[str, list[int], int, str]:
        for prompt in PROMPTS:
            steps = [c.token_ids for c in llms["draft"].stream(prompt, GREEDY)]
            ids = [t for s in steps for t in s]
            pos = 0
            for s in steps:
                eos_at = pos + len(s) - 1  # the step's last token, made EOS where it first appears
                found = _stop_at(tok, ids, pos + 1, min_tokens=1) if ids.index(ids[eos_at]) == eos_at else None
                if found is not None and pos + 1 + found[1] <= eos_at:
                    return prompt, ids, eos_at, found[0]
                pos += len(s)
        pytest.fail("no step had a fresh last token to make EOS")

    prompt, ids, eos_at, stop = pick()
    path = with_eos(tiny_llama(vocab=VOCAB, seed=0, qk_scale=0.1), ids[eos_at])
    _char_tokenizer().save(str(path / "tokenizer.json"))
    llm = LLM(path, {"name": "draft_model", "path": str(path), "num_speculative_tokens": 3}, **RUNTIME)
    plain = llm.generate(prompt, SamplingParams(max_new_tokens=40))[0]
    assert (plain.token_ids, plain.finish_reason) == (ids[: eos_at + 1], "eos")
    out = llm.generate(prompt, SamplingParams(max_new_tokens=40, stop=[stop]))[0]
    want_ids, want_text = _expected(tok, ids, stop)
    assert (out.token_ids, out.text, out.finish_reason) == (want_ids, want_text, "stop")
    assert len(want_ids) < eos_at
    assert_all_free(llm)


def test_stop_strings_need_a_tokenizer(tiny_llama):
    """Without tokenizer.json a stop string rejects its request (naming it and
    the field); the other requests run as they would alone."""
    llm = LLM(tiny_llama(vocab=VOCAB, seed=0).path, "ngram", **RUNTIME)
    outs = llm.generate([[1, 2, 3], [4, 5]], [GREEDY, SamplingParams(stop=["x"])])
    assert outs[0].error is None and outs[0].token_ids == llm.generate([[1, 2, 3]], GREEDY)[0].token_ids
    assert outs[1].finish_reason == "error" and outs[1].token_ids == []
    assert "'req-1'" in outs[1].error and "sampling.stop" in outs[1].error and "tokenizer" in outs[1].error
    (only,) = list(llm.stream([4, 5], SamplingParams(stop="x")))
    assert only.finish_reason == "error" and "sampling.stop" in only.error
    assert_all_free(llm)


@pytest.mark.parametrize("stop", ["", [""], [3], b"x", None])
def test_a_bad_stop_value_names_the_field(stop):
    with pytest.raises(ValueError, match=r"sampling\.stop must be"):
        SamplingParams(stop=stop).validate()


# -- method by name or dict, settings as keywords -------------------------------------


def test_method_by_name_dict_or_config_is_the_same(llms, target):
    by_name = LLM(target, method="ngram", **RUNTIME)
    assert by_name.method == NgramConfig()
    by_dict = LLM(target, method={"name": "draft_model", "path": str(target), "num_speculative_tokens": 3},
                  **RUNTIME)
    assert by_dict.method == DraftModelConfig(path=str(target), num_speculative_tokens=3)
    ngram3 = LLM(target, method={"name": "ngram", "num_speculative_tokens": 3}, **RUNTIME)
    for llm, ref in ((by_dict, llms["draft"]), (ngram3, llms["ngram"])):
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [
            o.token_ids for o in ref.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("method, exc, words", [
    ("ngarm", ValueError, ["unknown drafting method 'ngarm'", "did you mean 'ngram'", "draft_model"]),
    ({"name": "ngram", "max_m": 2}, TypeError, ["method 'ngram' has no option 'max_m'", "did you mean 'max_n'",
                                                "num_speculative_tokens"]),
    ({"path": "/x"}, ValueError, ["needs a 'name'", "ngram"]),
    ({"name": "ngram", "min_n": 3, "max_n": 2}, ValueError, ["method 'ngram'", "min_n"]),
    ("draft_model", ValueError, ["method 'draft_model'", "path"]),
    (3, TypeError, ["method must be", "int"]),
])
def test_a_bad_method_fails_before_loading_naming_it(method, exc, words):
    with pytest.raises(exc) as e:
        LLM("/no/such/checkpoint", method=method)  # the error comes before any file is read
    for w in words:
        assert w in str(e.value), str(e.value)


def test_runtime_and_engine_settings_as_keywords(target):
    llm = LLM(target, method="ngram", device="cpu", dtype="float32", compile=False, threads=1,
              max_batch_size=3, max_seq_len=80, block_size=8, max_tokens_per_step=64, seed=5)
    assert llm.runtime == RuntimeConfig(max_batch_size=3, max_seq_len=80, block_size=8, dtype="float32",
                                        device="cpu", compile=False, threads=1)
    assert llm.engine_config == EngineConfig(max_batch_size=3, max_tokens_per_step=64, seed=5)
    assert llm.pipeline.max_seq_len == 80 and llm.pipeline.target.num_blocks == 3 * 11
    # Keywords override the objects' fields; the objects' other fields stay.
    llm = LLM(target, runtime=RuntimeConfig(max_seq_len=64, block_size=4), engine_config=EngineConfig(seed=9),
              max_batch_size=2)
    assert (llm.runtime.max_seq_len, llm.runtime.block_size, llm.runtime.max_batch_size) == (64, 4, 2)
    assert (llm.engine_config.seed, llm.engine_config.max_batch_size) == (9, 2)


def test_an_unknown_or_bad_keyword_names_it():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_seqlen' \(did you mean 'max_seq_len'\?\)"):
        LLM("/no/such/checkpoint", max_seqlen=64)
    with pytest.raises(TypeError, match="'temperature'.*runtime settings are .*engine settings are"):
        LLM("/no/such/checkpoint", temperature=0.5)
    with pytest.raises(ValueError, match=r"runtime\.max_seq_len must be >= 1"):
        LLM("/no/such/checkpoint", max_seq_len=0)
    with pytest.raises(ValueError, match=r"engine\.max_tokens_per_step must be >= 1"):
        LLM("/no/such/checkpoint", max_tokens_per_step=0)
