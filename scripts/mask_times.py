"""What a grammar's masks cost on our vocabularies (llguidance, through runtime/text/constraint.py):
building the vocabulary's tokenizer, compiling a few JSON schemas, one mask per position while
following a valid answer token by token (as constrained ``ar`` does), applying a mask to a row of
logits, and the forced (fast-forward) tokens along the answer.

    .venv/bin/python scripts/mask_times.py [--pairs smollm2-135m,gemma3-270m] [--repeats 3]
    .venv/bin/python scripts/mask_times.py --runs smollm2-135m [--methods ar,sd,mtad] [--repeats 3]

``--runs PAIR`` (a name or a manifest: the x4 stand-in's) times whole constrained runs instead:
per method, the share of the run's time its masks took (``Stats.mask_s``) and its speed beside
the same method unconstrained.

Run it on an idle machine: masks are tens of microseconds, and a busy core doubles them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from mtad_edge.pairs import resolve
from mtad_edge.runtime.backends.llama_cpp_backend import LlamaCppBackend, LlamaCppConfig
from mtad_edge.runtime.text import constraint as C

# (name, schema or None for any JSON object, an answer that follows it, written with C.JSON_OPTIONS' separators)
CASES: list[tuple[str, Any, dict[str, Any]]] = [
    (
        "person",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string", "format": "email"},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            },
            "required": ["name", "age", "email", "tags"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines"]},
    ),
    (
        "order",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                            "price": {"type": "number"},
                        },
                        "required": ["sku", "quantity", "price"],
                        "additionalProperties": False,
                    },
                },
                "note": {"type": "string"},
            },
            "required": ["id", "status", "items"],
            "additionalProperties": False,
        },
        {
            "id": 1042,
            "status": "shipped",
            "items": [
                {"sku": "ABC-1234", "quantity": 2, "price": 9.5},
                {"sku": "XYZ-0001", "quantity": 1, "price": 120},
            ],
        },
    ),
    (
        "tool call",
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
    ),
    (
        "json object",
        None,
        {"title": "Rivers", "facts": ["They carry water to the sea.", "They shape valleys."], "count": 2},
    ),
]


def answer_text(answer: dict[str, Any]) -> str:
    return json.dumps(answer, separators=(C.JSON_OPTIONS["item_separator"], C.JSON_OPTIONS["key_separator"]))


def measure(model: LlamaCppBackend, name: str, schema: Any, answer: dict[str, Any], repeats: int) -> dict[str, Any]:
    grammar = C.Grammar.json_object() if schema is None else C.Grammar.json_schema(schema)
    vocab = C.vocab_of(model)
    compile_ms = []
    for _ in range(repeats):
        vocab.compiled.clear()  # a cold compile each time
        t0 = time.perf_counter()
        compiled = C.compile(grammar, model)
        compile_ms.append((time.perf_counter() - t0) * 1000)
    tokens = model.tokenize(answer_text(answer), add_special=False, special=False)
    masks_us: list[float] = []
    forced_us: list[float] = []
    forced_at = 0  # positions where the grammar forces a token or more
    forced_tokens = 0  # tokens of the answer a forced span covered (each forced run counted once)
    first_forced: list[int] = []
    for _ in range(repeats):
        m = compiled.start()
        covered = 0  # answer tokens still inside the last forced span
        for i, tok in enumerate(tokens):
            t0 = time.perf_counter()
            allowed = m.allowed(())
            masks_us.append((time.perf_counter() - t0) * 1e6)
            assert allowed is not None and allowed[tok], (name, i, tok)
            t0 = time.perf_counter()
            ff = m.forced()
            forced_us.append((time.perf_counter() - t0) * 1e6)
            if i == 0:
                first_forced = ff
            if ff:
                forced_at += 1
                if covered == 0 and tokens[i : i + len(ff)] == ff:
                    forced_tokens += len(ff)
                    covered = len(ff)
            covered = max(0, covered - 1)
            assert m.commit([tok]) == 1
        assert m.state() in (C.DONE, C.OPEN)
    # applying a mask (cached) to one row of logits: unpack the bits, set the rest to -inf
    m = compiled.start()
    m.commit(tokens[: len(tokens) // 2])
    row = np.random.default_rng(0).normal(size=(1, model.n_vocab)).astype(np.float32)
    m.apply(row, [()])
    t0 = time.perf_counter()
    for _ in range(200):
        m.apply(row, [()])
    apply_us = (time.perf_counter() - t0) / 200 * 1e6
    # a verify's rows along a drafted path of 4, none cached: 5 masks
    m = compiled.start()
    t0 = time.perf_counter()
    m.masks(tokens[:4])
    path_us = (time.perf_counter() - t0) * 1e6
    n = repeats
    return {
        "schema": name,
        "tokens": len(tokens),
        "compile_ms": statistics.median(compile_ms),
        "mask_mean_us": statistics.fmean(masks_us),
        "mask_p50_us": statistics.median(masks_us),
        "mask_p99_us": float(np.percentile(masks_us, 99)),
        "forced_mean_us": statistics.fmean(forced_us),
        "apply_row_us": apply_us,
        "path4_us": path_us,
        "forced_positions": forced_at / n,
        "forced_share": forced_tokens / n / len(tokens),
        "first_forced": model_text(model, first_forced),
    }


def model_text(model: LlamaCppBackend, tokens: list[int]) -> str:
    return "|".join(model.token_bytes(t).decode("utf-8", "replace") for t in tokens)


def runs(pair: str, methods: list[str], repeats: int, threads: int) -> None:
    """Whole runs on a pair through the Engine: constrained (the person schema) and not."""
    from mtad_edge.engine import Engine

    schema = C.Grammar.json_schema(CASES[0][1])
    msgs = [{"role": "user", "content": "Describe a famous scientist as a JSON object with name, age, email, tags."}]
    print(f"| {pair} method | constrained tok/s | unconstrained tok/s | ratio | mask share of the run | finish |")
    print("|---|---|---|---|---|---|")
    with Engine.load(pair=pair, threads=threads) as engine:
        engine.chat(msgs, constraint=schema, max_tokens=4).text()  # the vocabulary and grammar built once, apart
        for method in methods:
            speeds: dict[bool, list[float]] = {True: [], False: []}
            shares, ends = [], set()
            for seed in range(repeats):
                for constrained in (True, False):
                    grammar = schema if constrained else None
                    r = engine.chat(msgs, constraint=grammar, method=method, max_tokens=48, seed=seed, temperature=1.0)
                    r.text()
                    speeds[constrained].append(r.stats.tokens_per_s or 0.0)
                    if constrained:
                        shares.append(r.stats.mask_s / max(r.stats.decode_s, 1e-9))
                        ends.add(r.finish_reason)
            on, off = statistics.median(speeds[True]), statistics.median(speeds[False])
            print(
                f"| {method} | {on:.1f} | {off:.1f} | {on / off:.2f} | {statistics.median(shares):.1%} "
                f"| {', '.join(sorted(ends))} |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", metavar="PAIR", help="time whole constrained runs on PAIR instead")
    ap.add_argument("--methods", default="ar,sd,mtad,mmtad")
    args = ap.parse_args()
    if args.runs:
        runs(args.runs, args.methods.split(","), args.repeats, args.threads)
        return
    print(f"llguidance {C.llg.__version__}")
    print(
        "| vocabulary | schema | answer tokens | compile ms | mask mean / p50 / p99 us | apply a row us "
        "| 5 masks along a path us | forced-tokens call us | forced share | forced at the start |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for pair in args.pairs.split(","):
        files = resolve(pair)
        assert files.aux is not None
        model = LlamaCppBackend(files.aux, LlamaCppConfig(n_ctx=64, n_threads=args.threads))
        t0 = time.perf_counter()
        C.vocab_of(model)
        build_s = time.perf_counter() - t0
        label = f"{pair} ({model.n_vocab})"
        print(f"| {label} | tokenizer built in {build_s:.2f} s | | | | | | | | |", flush=True)
        for name, schema, answer in CASES:
            r = measure(model, name, schema, answer, args.repeats)
            print(
                f"| {label} | {r['schema']} | {r['tokens']} | {r['compile_ms']:.1f} "
                f"| {r['mask_mean_us']:.0f} / {r['mask_p50_us']:.0f} / {r['mask_p99_us']:.0f} "
                f"| {r['apply_row_us']:.0f} | {r['path4_us']:.0f} | {r['forced_mean_us']:.0f} "
                f"| {r['forced_share']:.0%} | `{r['first_forced']}` |",
                flush=True,
            )
        model.close()


if __name__ == "__main__":
    main()
