"""llama.cpp as a peer: its prompt lookup over its plain decoding, against our n-gram over ours.

    PYTHONPATH=/tmp/llamacpp/lib/python3.11/site-packages \\
        .venv/bin/python experiments/bench/llama_cpp_peer.py quick=true

It needs ``llama_cpp`` (llama-cpp-python) beside specdec. PyPI has only its sdist, which
compiles llama.cpp (cmake, a C++ compiler; about 20 minutes on a shared 2-core VM), so keep it out of
the project's venv: build it in a venv of its own (the same Python version) and put that
venv's site-packages on ``PYTHONPATH`` as above::

    python3.11 -m venv /tmp/llamacpp
    CMAKE_BUILD_PARALLEL_LEVEL=2 /tmp/llamacpp/bin/pip install llama-cpp-python

Four engines on the same SmolLM2-135M-Instruct GGUF (``target``: llama.cpp runs its Q4_1
weights with its own kernels, ours dequantizes them to ``dtype``) and the same Spec-Bench
questions (first turns, ``per_category`` of each category, rendered with the GGUF's chat
template as ``experiment=real`` renders them and encoded once by our tokenizer: both engines
get the same prompt ids): llama.cpp plain, llama.cpp with prompt lookup
(``LlamaPromptLookupDecoding(num_pred_tokens=gamma)`` as ``draft_model``), ours plain and
ours n-gram (``num_speculative_tokens=gamma``). Greedy, batch 1, ``new_tokens`` each (fewer
where the model ends its answer: both stop at the GGUF's EOS), ``threads`` for both.

Timed by turns: every prompt of a pass runs on all four, one request after another, the
order rotated by prompt and pass, so a slow spell of the machine lands on all of them.
tok/s is a pass's new tokens over its request wall time (prefill included; ``*_decode``:
after the prefill's step). Each engine's speculative speedup is the median over passes of its
tok/s over its own plain's; ``ngram_speedup_vs_llamacpp_lookup_speedup`` divides ours by
llama.cpp's (>= 1: our n-gram gains at least as much over our plain decoding as llama.cpp's
prompt lookup over its). llama-cpp-python turns on ``logits_all`` with a draft model (every
prompt row's logits computed and copied out), a prefill cost its plain run does not pay:
part of what its prompt lookup costs, shown apart by the decode-phase figures.

Outputs are compared, not forced equal: ours (n-gram against plain) must be equal; llama.cpp's
quantized kernels round differently from our dequantized float ones, so its greedy text may
leave ours after some tokens, and its verification of several rows at once rounds differently
from its one-row steps, so its lookup's text may leave its own plain's (``*_equal``: prompts
whose ids agree; ``first_mismatch``).

Prints a table and ends with one JSON line: the headline ratio, the speedups, tok/s, τ (new
tokens per target forward step, the prefill's included), the output checks and the ``machine``
(:func:`specdec.experiment.machine.machine_record`, with llama.cpp's version and build).
``quick=true``: one question per category, 64 tokens, two passes (2-3 minutes on a shared
2-core VM, most of it llama.cpp prefilling the two long prompts).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.data.chat import conversation_prompt, load_chat_template
from specdec.data.prompts import DataConfig, load_prompts
from specdec.experiment.machine import machine_record
from specdec.measure import first_mismatch, load_config, print_table
from specdec.zoo_fetch import resolve_target

SPEC_BENCH = Path(__file__).resolve().parents[2] / "specdec" / "data" / "spec_bench" / "question.jsonl"
INSTALL = ("llama_cpp is not importable: build llama-cpp-python in a venv of its own and put its "
           "site-packages on PYTHONPATH:\n"
           "  python3.11 -m venv /tmp/llamacpp\n"
           "  CMAKE_BUILD_PARALLEL_LEVEL=2 /tmp/llamacpp/bin/pip install llama-cpp-python\n"
           "  PYTHONPATH=/tmp/llamacpp/lib/python3.11/site-packages .venv/bin/python "
           "experiments/bench/llama_cpp_peer.py quick=true")


@dataclass
class PeerConfig:
    quick: bool = False
    target: str = "smollm2"  # a fetchable name or a .gguf file (llama.cpp reads GGUF only)
    per_category: int = 3  # Spec-Bench questions per category (first turns)
    new_tokens: int = 128
    gamma: int = 4  # our num_speculative_tokens = llama.cpp's num_pred_tokens
    lookup_max_ngram: int = 2  # LlamaPromptLookupDecoding's max_ngram_size (its default)
    repeats: int = 3  # timed passes
    # torch's and llama.cpp's (n_threads, n_threads_batch). 1: on a shared 2-core VM, 2 threads let
    # ggml's spinning barriers wait out a descheduled thread (a 4 s request took 30-40 s at times).
    threads: int = 1
    max_seq_len: int = 2048  # Spec-Bench's long prompts run to ~800 tokens with the template
    dtype: str = "float32"  # ours


ENGINES = ("llama.cpp plain", "llama.cpp lookup", "ours plain", "ours ngram")


@dataclass
class Out:
    ids: list[int]
    wall_s: float
    first_s: float  # to the first new tokens (the prefill's step)
    first_n: int = 1  # tokens the prefill's step gave (ours may verify drafts in it)
    steps: int = 0  # target forward steps, the prefill's one included (speculative runs)


def prompts_of(cfg: PeerConfig, gguf: Path) -> tuple[list[str], list[str]]:
    """(ids, texts): the first turns of ``per_category`` Spec-Bench questions of each category,
    through the GGUF's chat template (as ``experiment=real`` with ``data.turn=0``)."""
    data = DataConfig(path=str(SPEC_BENCH), text_field="turns", id_field="question_id", source_field="category",
                      turn=0, chat=True, limit_per_source=cfg.per_category)
    template = load_chat_template(gguf)
    ps = load_prompts(data)
    return [p.id for p in ps], [conversation_prompt([p.text], [], template, prompt_id=p.id) for p in ps]


def llama_runner(llama: Any, eos: set[int], n: int, lookup: Any = None) -> Callable[[list[int]], Out]:
    """One greedy request on ``llama`` from scratch (its prefix cache dropped: every engine prefills)."""

    def run(ids: list[int]) -> Out:
        if lookup is not None:
            lookup.calls = 0
        llama.reset()
        out: list[int] = []
        t0 = time.perf_counter()
        first = 0.0
        for tok in llama.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
            if not out:
                first = time.perf_counter() - t0
            out.append(int(tok))
            if len(out) >= n or tok in eos:
                break
        wall = time.perf_counter() - t0
        return Out(out, wall, first, 1, 1 + lookup.calls if lookup is not None else 0)

    return run


def ours_runner(llm: LLM, n: int) -> Callable[[list[int]], Out]:
    sp = SamplingParams(temperature=0.0, max_new_tokens=n)

    def run(ids: list[int]) -> Out:
        if llm.method is not None:
            llm.pipeline.reset_stats()
        t0 = time.perf_counter()
        (o,) = llm.generate([ids], sp)
        wall = time.perf_counter() - t0
        if o.error:
            raise SystemExit(f"ours failed on a prompt: {o.error}")
        steps = llm.pipeline.stats().counts.steps if llm.method is not None else 0
        return Out(list(o.token_ids), wall, o.ttft_s or 0.0, len(o.token_ids) - o.decode_tokens, steps)

    return run


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: Sequence[str]) -> None:
    cfg = load_config(PeerConfig, argv)
    if cfg.quick:
        cfg.per_category, cfg.new_tokens, cfg.repeats = 1, 64, 2
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        raise SystemExit(f"{INSTALL}\n({e})") from None

    class CountedLookup(LlamaPromptLookupDecoding):
        """Prompt lookup counting its calls: one per verification step."""

        calls = 0

        def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
            self.calls += 1
            return super().__call__(input_ids, **kwargs)

    gguf = resolve_target(cfg.target)
    if Path(gguf).suffix.lower() != ".gguf":
        raise SystemExit(f"target={cfg.target!r} is {gguf}: llama.cpp needs a .gguf file")
    rids, texts = prompts_of(cfg, Path(gguf))

    common = dict(threads=cfg.threads, max_seq_len=cfg.max_seq_len, dtype=cfg.dtype)
    ours_plain = LLM(gguf, **common)
    ours_ngram = LLM(gguf, method={"name": "ngram", "num_speculative_tokens": cfg.gamma}, **common)
    assert ours_plain.tokenizer is not None
    prompts = [list(ours_plain.tokenizer.encode(t, add_special_tokens=False).ids) for t in texts]
    eos = set(ours_plain.eos_token_ids)

    lookup = CountedLookup(max_ngram_size=cfg.lookup_max_ngram, num_pred_tokens=cfg.gamma)
    kw = dict(model_path=str(gguf), n_ctx=cfg.max_seq_len, n_threads=cfg.threads, n_threads_batch=cfg.threads,
              seed=0, verbose=False)
    lc_plain = llama_cpp.Llama(**kw)
    # logits_all=True said again: with a draft model it is on, but 0.3.36 sizes its logits buffer by
    # the argument (n_batch rows without it), and a prompt past n_batch tokens then fails to copy.
    lc_lookup = llama_cpp.Llama(draft_model=lookup, logits_all=True, **kw)
    # Does llama.cpp's tokenizer read the rendered prompts as ours does? (Both get our ids regardless.)
    same_prompt_ids = sum(lc_plain.tokenize(t.encode("utf-8"), add_bos=False, special=True) == p
                          for t, p in zip(texts, prompts))

    runs = {
        ENGINES[0]: llama_runner(lc_plain, eos, cfg.new_tokens),
        ENGINES[1]: llama_runner(lc_lookup, eos, cfg.new_tokens, lookup),
        ENGINES[2]: ours_runner(ours_plain, cfg.new_tokens),
        ENGINES[3]: ours_runner(ours_ngram, cfg.new_tokens),
    }
    for run in runs.values():  # warm-up: one short request each
        run(prompts[0][:64])

    n = len(ENGINES)
    passes: list[dict[str, list[Out]]] = []
    for p in range(cfg.repeats):
        this: dict[str, list[Out]] = {k: [] for k in ENGINES}
        for i, ids in enumerate(prompts):
            first = (p + i) % n
            for name in ENGINES[first:] + ENGINES[:first]:
                this[name].append(runs[name](ids))
            print(f"  prompt {rids[i]}: " + ", ".join(f"{k} {this[k][-1].wall_s:.2f}s" for k in ENGINES),
                  file=sys.stderr, flush=True)
        passes.append(this)
        print(f"pass {p + 1}/{cfg.repeats} done", file=sys.stderr, flush=True)

    def rate(outs: list[Out], decode: bool = False) -> float:
        if decode:
            return sum(len(o.ids) - o.first_n for o in outs) / sum(o.wall_s - o.first_s for o in outs)
        return sum(len(o.ids) for o in outs) / sum(o.wall_s for o in outs)

    def speedup(spec: str, plain: str, decode: bool = False) -> float:
        return median([rate(ps[spec], decode) / rate(ps[plain], decode) for ps in passes])

    last = passes[-1]
    ref = {"llama.cpp": last[ENGINES[0]], "ours": last[ENGINES[2]]}

    def equal(a: list[Out], b: list[Out]) -> int:
        return sum(x.ids == y.ids for x, y in zip(a, b))

    rows = []
    for name in ENGINES:
        outs = last[name]
        spec = name.endswith(("lookup", "ngram"))
        steps = sum(o.steps for o in outs)
        rows.append({
            "engine": name,
            "tok/s": median([rate(ps[name]) for ps in passes]),
            "tok/s decode": median([rate(ps[name], True) for ps in passes]),
            "speedup": speedup(name, ENGINES[0] if name.startswith("llama") else ENGINES[2]) if spec else 1.0,
            "speedup decode": (speedup(name, ENGINES[0] if name.startswith("llama") else ENGINES[2], True)
                               if spec else 1.0),
            "tau": sum(len(o.ids) for o in outs) / steps if spec and steps else None,
            "= its plain": f"{equal(outs, ref[name.split()[0]])}/{len(outs)}",
            "= ours plain": f"{equal(outs, ref['ours'])}/{len(outs)}",
        })
    print_table(rows, f"SmolLM2-135M-Instruct (GGUF Q4_1), {len(prompts)} Spec-Bench first turns, "
                      f"{cfg.new_tokens} new tokens, greedy, batch 1, γ = {cfg.gamma}, {cfg.threads} threads, "
                      f"{cfg.repeats} passes (medians)")
    mism = [first_mismatch(a.ids, b.ids) for a, b in zip(last[ENGINES[0]], ref["ours"])]
    by = {r["engine"]: r for r in rows}
    ngram, lookup_s = by["ours ngram"]["speedup"], by["llama.cpp lookup"]["speedup"]
    figures = {
        "ngram_speedup_vs_llamacpp_lookup_speedup": ngram / lookup_s,
        "ngram_speedup_vs_llamacpp_lookup_speedup_decode": (by["ours ngram"]["speedup decode"]
                                                            / by["llama.cpp lookup"]["speedup decode"]),
        "ours_ngram_speedup": ngram,
        "llamacpp_lookup_speedup": lookup_s,
        "ours_ngram_speedup_decode": by["ours ngram"]["speedup decode"],
        "llamacpp_lookup_speedup_decode": by["llama.cpp lookup"]["speedup decode"],
        "tok_s": {r["engine"]: r["tok/s"] for r in rows},
        "tau": {r["engine"]: r["tau"] for r in rows if r["tau"] is not None},
        "ours_ngram_equals_ours_plain": equal(last[ENGINES[3]], ref["ours"]),
        "llamacpp_lookup_equals_llamacpp_plain": equal(last[ENGINES[1]], ref["llama.cpp"]),
        "llamacpp_plain_equals_ours_plain": equal(last[ENGINES[0]], ref["ours"]),
        "llamacpp_vs_ours_first_mismatch": mism,
        "prompts": len(prompts),
        "prompt_ids": rids,
        "llamacpp_tokenizes_prompts_as_ours": same_prompt_ids,
        "new_tokens": cfg.new_tokens,
        "gamma": cfg.gamma,
        "threads": cfg.threads,
        "repeats": cfg.repeats,
    }
    machine = {**machine_record("cpu"), "llama_cpp": llama_cpp.__version__,
               "llama_cpp_system": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()}
    print(json.dumps({**figures, "machine": machine}, sort_keys=True), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
