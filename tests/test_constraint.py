"""Constrained decoding (runtime/text/constraint.py): grammars compiled by llguidance, masks along
paths and trees, the loop's end on a complete answer or a dead end, every method under a mask,
sd lossless with respect to the masked target, and hostile grammars refused or bounded."""

import json
import re
import time

import numpy as np
import pytest

from helpers import ASCII, TWO_TOKEN_RUN, FakeLM, chi2_critical, chi2_stat, counted, fake_engine, generate_tokens
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.drafting.beams import BeamDrafter
from mtad_edge.runtime.errors import OptionError
from mtad_edge.runtime.rules.sampling import filtered_logprobs
from mtad_edge.runtime.rules.shape import Shape
from mtad_edge.runtime.text import constraint as C
from mtad_edge.runtime.text.constraint import Grammar
from mtad_edge.textstream import detokenize

GREEDY = SamplingConfig(temperature=0.0)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "ok"],
    "additionalProperties": False,
}


def text_of(model, tokens) -> str:
    return detokenize(model, [t for t in tokens if not model.is_eog(t)])


def ascii_pair(target_seqs=9, aux_seqs=9, sharpness=2.0):
    """Target and a different aux over the printable-ASCII vocabulary."""
    return (
        FakeLM(salt=1, n_seq_max=target_seqs, alphabet=ASCII, sharpness=sharpness),
        FakeLM(salt=2, n_seq_max=aux_seqs, alphabet=ASCII, sharpness=sharpness),
    )


def walk(matcher, n, rng):
    """A legal path of up to n tokens from the matcher's state: a random allowed token each step."""
    m = matcher.compiled.start()
    m.commit(matcher.answer)
    path = []
    for _ in range(n):
        allowed = m.allowed(())
        ids = np.flatnonzero(allowed)
        ids = ids[~np.isin(ids, m.vocab.eog)]
        if not len(ids):
            break
        tok = int(rng.choice(ids))
        assert m.commit([tok]) == 1
        path.append(tok)
    return path


# -- grammars -----------------------------------------------------------------------------------
def test_grammar_constructors_and_their_refusals():
    g = Grammar.json_schema(PERSON)
    assert (
        g.kind == "json_schema" and json.loads(g.text) == PERSON and list(json.loads(g.text)["properties"])[0] == "name"
    )
    assert Grammar.json_schema(json.dumps(PERSON)).key != Grammar.json_schema(json.dumps(PERSON), strict=False).key
    assert hash(g) == hash(Grammar.json_schema(PERSON)) and g.key == Grammar.json_schema(PERSON).key
    assert Grammar.of("regex", "a+") == Grammar.regex("a+") and Grammar.of("json_object", "") == Grammar.json_object()
    deep: dict = {}
    for _ in range(100_000):
        deep = {"a": deep}
    for bad, words in [
        (lambda: Grammar.json_schema(deep), "nested too deeply"),
        (lambda: Grammar.json_schema({"x": {1, 2}}), "not JSON"),
        (lambda: Grammar.json_schema(12), "must be an object"),
        (lambda: Grammar.of("yaml", "a"), "unknown grammar kind"),
        (lambda: Grammar.of("lark", {"a": 1}), "must be text"),
        (lambda: Grammar.regex("a" * (C.MAX_GRAMMAR_BYTES + 1)), "more than the 131072 allowed"),
        (lambda: Grammar("regex", "a", strict="yes"), "strict must be"),
    ]:
        with pytest.raises(OptionError, match=words) as e:
            bad()
        assert "\n" not in str(e.value) and e.value.param == "grammar"


def test_compiled_grammars_are_cached_per_vocabulary_with_a_bound(monkeypatch):
    t = FakeLM(alphabet=ASCII)
    first = C.compile(Grammar.regex("a+"), t)
    assert C.compile(Grammar.regex("a+"), t) is first
    assert C.compile(Grammar.regex("a+"), FakeLM(alphabet=ASCII)) is not first  # another model: its own
    with pytest.raises(OptionError, match="refused") as refused:
        C.compile(Grammar.lark("start: foo"), t)
    calls = []
    monkeypatch.setattr(C, "_compile", lambda g, v: calls.append(g))
    with pytest.raises(OptionError) as again:  # a refusal is kept too: not compiled twice
        C.compile(Grammar.lark("start: foo"), t)
    assert str(again.value) == str(refused.value) and not calls
    monkeypatch.undo()
    for i in range(C.CACHE_GRAMMARS + 5):
        C.compile(Grammar.regex(f"a{{{i}}}"), t)
    assert len(C.vocab_of(t).compiled) == C.CACHE_GRAMMARS


def test_a_compile_past_the_time_bound_is_refused_without_waiting_for_it(monkeypatch):
    monkeypatch.setattr(C, "COMPILE_S", 0.2)
    real = C._compile
    monkeypatch.setattr(C, "_compile", lambda g, v: (time.sleep(1.0), real(g, v))[1])
    t0 = time.perf_counter()
    with pytest.raises(OptionError, match="takes longer than 0.2 s to compile"):
        C.compile(Grammar.regex("slow"), FakeLM(alphabet=ASCII))
    assert time.perf_counter() - t0 < 0.6


# -- masks --------------------------------------------------------------------------------------
def test_masks_along_a_path_equal_masks_one_token_at_a_time():
    t = FakeLM(alphabet=ASCII)
    compiled = C.compile(Grammar.json_schema(PERSON), t)
    rng = np.random.default_rng(0)
    for _ in range(5):
        m = compiled.start()
        path = walk(m, 30, rng)
        rows = m.masks(path)
        step = compiled.start()
        for i, tok in enumerate([*path, None]):
            assert (step.allowed(()) == rows[i]).all(), i
            if tok is not None:
                step.commit([tok])
        logits = np.random.default_rng(1).normal(size=(len(path) + 1, t.n_vocab)).astype(np.float32)
        masked = compiled.start().apply_along(logits, path)
        np.testing.assert_array_equal(masked, np.where(rows, logits, -np.inf))
        # a tree's rows: each node's path, in any order, the same masks
        nodes = [tuple(path[:3]), (), tuple(path[:1])]
        tree = compiled.start().apply(logits[:3], nodes)
        np.testing.assert_array_equal(tree, np.where(rows[[3, 0, 1]], logits[:3], -np.inf))


def test_rows_past_an_illegal_token_are_left_as_they_are():
    t = FakeLM(alphabet=ASCII)
    m = C.compile(Grammar.regex("[a-c]+"), t).start()
    path = t.tokenize("ab9c")  # 9 is illegal
    assert m.legal(path) == 2 and m.allowed(path[:3]) is None
    rows = m.masks(path)
    assert rows[:3].any(axis=1).all() and not rows[3:].any()
    logits = np.zeros((5, t.n_vocab), dtype=np.float32)
    out = m.apply_along(logits, path)
    assert np.isinf(out[:3]).any(axis=1).all() and (out[3:] == 0).all()


def test_a_wider_row_never_allows_the_tokens_past_the_grammars_vocabulary():
    t = FakeLM(alphabet=ASCII)
    m = C.compile(Grammar.regex("a+"), t).start()
    out = m.apply(np.zeros((1, t.n_vocab + 3), dtype=np.float32), [()])
    assert np.flatnonzero(np.isfinite(out[0])).tolist() == t.tokenize("a")


def test_the_committed_answer_is_followed_and_its_state_told():
    t = FakeLM(alphabet=ASCII)
    m = C.compile(Grammar.regex("(yes|no)!?"), t).start(at=3)
    assert m.state() == C.OPEN and m.commit(t.tokenize("ye")) == 2 and m.at == 5
    assert m.path([0, 0, 0, *t.tokenize("ye"), *t.tokenize("s")]) == tuple(t.tokenize("s"))
    assert m.commit(t.tokenize("sX")) == 1 and m.state() == C.OPEN  # "yes" may end or take a "!"
    assert m.commit(t.tokenize("!")) == 1 and m.state() == C.DONE
    assert m.commit([t.eog, *t.tokenize("a")]) == 1  # up to the end token, which a complete answer allows


def test_forced_tokens_are_the_bytes_the_grammar_fixes():
    t = FakeLM(alphabet=ASCII)
    m = C.compile(Grammar.json_schema(PERSON), t).start()
    assert text_of(t, m.forced()) == '{"name": "'  # one byte a token: no token could merge across its end
    m.commit(t.tokenize('{"name": "Al", "age": 7, "color": "g'))
    assert text_of(t, m.forced()) == 'reen", "ok": '
    assert m.forced(t.tokenize('reen", "ok": ')) == []  # true or false: nothing forced
    assert m.forced(t.tokenize("X")) == []  # an illegal path forces nothing


# -- the loop under a constraint ----------------------------------------------------------------
@pytest.mark.parametrize("method", ["ar", "sd", "mtad", "mmtad", "beam"])
def test_every_method_writes_only_what_the_grammar_allows(method):
    t, a = ascii_pair(target_seqs=9)
    schema = C.compile(Grammar.json_schema(PERSON), t)
    finished = 0
    for seed in range(6):
        for sampling in (GREEDY, SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)):
            cfg = DecodeConfig(method, 60, gamma=3, beam_width=2, sampling=sampling, seed=seed)
            out, st = generate_tokens(t, a, t.tokenize(f"person {seed}:"), cfg, constraint=schema)
            check = schema.start()
            assert check.commit(out) == len(out) and st.mask_s > 0
            if st.finish_reason == "stop":
                finished += 1
                answer = json.loads(text_of(t, out))
                assert set(answer) == set(PERSON["properties"]) and answer["color"] in ("red", "green", "blue")
                assert 0 <= answer["age"] <= 120 and len(answer["name"]) <= 6 and isinstance(answer["ok"], bool)
            else:
                assert st.finish_reason == "length" and len(out) == 60
    assert finished >= 6


def test_prompt_lookup_drafts_are_rejected_where_the_grammar_forbids_them():
    t = FakeLM(salt=1, alphabet=ASCII, sharpness=2.0)
    prompt = t.tokenize("abcabcabc zzz abcabcabc")  # lookup drafts "abc..." continuations
    cfg = DecodeConfig("sd", 30, gamma=3, drafter="ngram", seed=4)
    out, st = generate_tokens(t, None, prompt, cfg, constraint=Grammar.regex("[x-z]{1,20}"))
    assert counted(st, "ngram") > 0 and set(text_of(t, out)) <= set("xyz")


@pytest.mark.parametrize("method", ["ar", "sd", "mtad", "mmtad", "beam"])
def test_a_complete_answer_stops_and_a_dead_end_ends_bounded(method):
    t, a = ascii_pair(target_seqs=9)
    for seed in range(3):
        cfg = DecodeConfig(method, 50, gamma=3, beam_width=2, seed=seed)
        out, st = generate_tokens(t, a, t.tokenize("q"), cfg, constraint=Grammar.regex("(yes|no)"))
        assert text_of(t, out) in ("yes", "no") and st.finish_reason == "stop" and t.eog not in out
        # "{" then a character no token of this vocabulary writes: the answer can go no further
        out, st = generate_tokens(t, a, t.tokenize("q"), cfg, constraint=Grammar.lark('start: "{" "é"'))
        assert text_of(t, out) == "{" and st.finish_reason == "dead_end"
        assert st.target_calls <= 3  # one step (beam's window: gamma calls), not a run to max_tokens


def test_a_grammar_that_matches_nothing_is_refused_when_compiled():
    t = FakeLM(alphabet=ASCII)
    with pytest.raises(OptionError, match="matches no text the model can write"):
        C.compile(Grammar.lark('start: "é"'), t)
    with pytest.raises(OptionError, match="matches no text"):
        C.compile(Grammar.json_schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}), t)


@pytest.mark.parametrize("tree", ["final", "full"])
def test_greedy_drafting_gives_constrained_ar_text_token_for_token(tree):
    t, a = ascii_pair(target_seqs=4 * 5 + 1, aux_seqs=9, sharpness=1.5)
    schema = C.compile(Grammar.json_schema(PERSON), t)
    for prompt in ("a:", "bb:", "ccc:"):
        ids = t.tokenize(prompt)
        ar, _ = generate_tokens(t, None, ids, DecodeConfig("ar", 40, sampling=GREEDY), constraint=schema)
        for method in ("sd", "mtad", "mmtad"):
            for gamma in (1, 3, 5):
                cfg = DecodeConfig(method, 40, gamma=gamma, tree=tree, sampling=GREEDY)
                out, st = generate_tokens(t, a, ids, cfg, constraint=schema)
                assert out == ar, (prompt, method, gamma)
                assert st.accepted > 0
        for method in ("sd", "mtad"):  # the aux drafting the next block during the verify, masked too
            # (the aux alone: a forced span's step joins the aux's draft to it, and drafts nothing ahead)
            cfg = DecodeConfig(method, 40, gamma=3, sampling=GREEDY, draft_ahead="on", drafter="aux")
            out, st = generate_tokens(t, a, ids, cfg, constraint=schema)
            assert out == ar and counted(st, "aux", "ahead_drafts") > 0, (prompt, method)


def test_the_aux_beams_never_leave_the_grammar():
    t, a = ascii_pair()
    compiled = C.compile(Grammar.json_schema(PERSON), t)
    rng = np.random.default_rng(3)
    for seed in range(8):
        tokens = t.tokenize("p:")
        m = compiled.start(len(tokens))
        answer = walk(m, int(rng.integers(0, 25)), rng)
        m.commit(answer)
        tokens += answer
        drafter = BeamDrafter(a, SamplingConfig(temperature=1.5), np.random.default_rng(seed), 4, shape=Shape(mask=m))
        drafter.start(tokens)
        draft = drafter.propose(tokens, 5, 4, rows=True)
        paths = [p[p >= 0] for p in draft.paths(full=True)]
        assert len(paths) >= 1
        for p in paths:
            assert m.legal(p) == len(p), (seed, p)
        q = draft.q.dense()  # sd's q rows along the best beam are masked too
        rows = m.masks(draft.tokens)
        assert not np.isfinite(q[~rows[: len(q)]]).any()


@pytest.mark.parametrize(
    "sampling,verify",
    [(SamplingConfig(1.0, 0, 1.0), "block"), (SamplingConfig(0.8, 3, 0.9), "token")],
)
def test_sd_is_lossless_for_the_masked_target(sampling, verify):
    """The first two tokens of constrained sd are distributed as constrained sampling from the
    target alone: the filtered softmax of the masked logits, position by position."""
    alphabet = b"abc{}01"
    t = FakeLM(salt=1, sharpness=1.0, alphabet=alphabet)
    aux = FakeLM(salt=7, n_seq_max=3, sharpness=1.0, alphabet=alphabet)
    compiled = C.compile(Grammar.regex("[ab][a-c01][a-c01{}]+"), t)
    prompt = t.tokenize("0}")
    m = compiled.start()

    def p(ctx, path):
        allowed = m.allowed(path)
        return np.exp(filtered_logprobs(np.where(allowed, t.logits_for(ctx), -np.inf), sampling))

    v = t.n_vocab
    joint = np.zeros((v, v))
    p1 = p(prompt, ())
    for x in np.flatnonzero(p1):
        joint[x] = p1[x] * p([*prompt, int(x)], (int(x),))
    counts = np.zeros(v * v)
    for seed in range(1500):
        cfg = DecodeConfig("sd", TWO_TOKEN_RUN, gamma=3, sampling=sampling, verify=verify, seed=seed)
        out, _ = generate_tokens(t, aux, prompt, cfg, constraint=compiled)
        counts[out[0] * v + out[1]] += 1
    stat, df = chi2_stat(counts, joint.ravel())
    assert stat < chi2_critical(df)


# -- the engine ---------------------------------------------------------------------------------
def test_the_engine_takes_a_constraint_and_refuses_a_bad_one_before_running():
    t, a = ascii_pair(target_seqs=5)
    with fake_engine(t, a) as engine:
        r = engine.generate("q", constraint=Grammar.regex("(yes|no)"), max_tokens=10, method="mtad", seed=1)
        assert r.text() in ("yes", "no") and r.finish_reason == "stop"
        r = engine.chat([{"role": "user", "content": "hi"}], constraint=Grammar.json_schema(PERSON), max_tokens=80)
        text = r.text()
        assert r.finish_reason in ("stop", "length") and (r.finish_reason == "length" or json.loads(text))
        with pytest.raises(OptionError, match="constraint must be a Grammar") as e:
            engine.generate("q", constraint='{"type": "object"}')
        assert e.value.param == "constraint"
        with pytest.raises(OptionError, match="Unimplemented keys"):
            engine.generate("q", constraint=Grammar.json_schema({"if": {"type": "string"}}))
        lenient = engine.generate("q", constraint=Grammar.json_schema({"if": {}, "type": "integer"}, strict=False))
        assert lenient.text().lstrip("-").isdigit() or lenient.finish_reason == "length"


# -- hostile grammars ------------------------------------------------------------------------------
def _nested(n):
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE = {
    "nested objects 100 deep": lambda: Grammar.json_schema(_nested(100)),
    "nested text 2000 deep": lambda: Grammar.json_schema(
        '{"type":"object","properties":{"a":' * 2000 + "{}" + "}}" * 2000
    ),
    "nested arrays 60 deep": lambda: Grammar.json_schema(json.loads('{"type":"array","items":' * 60 + "{}" + "}" * 60)),
    "enum of 100k values": lambda: Grammar.json_schema({"enum": [f"v{i}" for i in range(100_000)]}),
    "enum of 8k values": lambda: Grammar.json_schema({"enum": [f"value-{i}" for i in range(8000)]}),
    "recursive $ref": lambda: Grammar.json_schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
    "mutually recursive $ref": lambda: Grammar.json_schema(
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
    ),
    "recursive tree": lambda: Grammar.json_schema(
        {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"c": {"items": {"$ref": "#/$defs/n"}}}}}}
    ),
    "missing $ref": lambda: Grammar.json_schema({"$ref": "#/$defs/nope"}),
    "remote $ref": lambda: Grammar.json_schema({"$ref": "http://169.254.169.254/latest"}),
    "unimplemented keywords": lambda: Grammar.json_schema({"type": "object", "dependentSchemas": {"a": {}}}),
    "unknown format": lambda: Grammar.json_schema({"type": "string", "format": "weird"}),
    "unsatisfiable range": lambda: Grammar.json_schema({"type": "integer", "minimum": 10, "maximum": 1}),
    "number past 64 bits": lambda: Grammar.json_schema({"type": "integer", "maximum": 10**40}),
    "enormous pattern": lambda: Grammar.json_schema({"type": "string", "pattern": "(a|b)*c" * 15000}),
    "allOf of 2000": lambda: Grammar.json_schema(
        {"allOf": [{"type": "object", "properties": {f"p{i}": {"type": "string"}}} for i in range(2000)]}
    ),
    "anyOf of 1000": lambda: Grammar.json_schema(
        {
            "anyOf": [
                {"type": "object", "properties": {f"p{i}": {"const": i}}, "required": [f"p{i}"]} for i in range(1000)
            ]
        }
    ),
    "not JSON": lambda: Grammar.json_schema("{not json"),
    "not a schema": lambda: Grammar.json_schema("[1, 2]"),
    "nested repeats": lambda: Grammar.regex("(a{1,1000}){1,1000}"),
    "regex of 10k words": lambda: Grammar.regex("|".join(f"word{i}" for i in range(10_000))),
    "regex back-reference": lambda: Grammar.regex(r"(a)\1"),
    "regex over 128 KiB": lambda: Grammar.regex("a" * 200_000),
    "lark of 11k alternatives": lambda: Grammar.lark("start: " + " | ".join(f'"w{i}"' for i in range(11_000))),
    "lark left recursion": lambda: Grammar.lark('start: start "a" | "a"'),
    "lark undefined rule": lambda: Grammar.lark("start: foo"),
    "gbnf that recurses": lambda: Grammar.gbnf('root ::= "a" root | "b"'),
    "gbnf syntax error": lambda: Grammar.gbnf("root ::= ("),
}


def assert_refused_or_bounded(make, model) -> str:
    """``make()`` then compiling it: an OptionError of one line, or a grammar that computes its
    first mask; either within 2 s (the issue's bound). Returns what happened."""
    t0 = time.perf_counter()
    try:
        C.compile(make(), model).start().state()
        outcome = "compiled"
    except OptionError as e:
        assert "\n" not in str(e) and len(str(e)) < 300 and e.param == "grammar", str(e)
        outcome = f"refused: {e}"
    assert time.perf_counter() - t0 < 2.0, outcome
    return outcome


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_grammars_are_refused_in_one_line_or_compiled_within_the_bound(name):
    model = FakeLM(alphabet=ASCII)
    C.vocab_of(model)  # the vocabulary is built once per model, apart from any grammar's bound
    assert_refused_or_bounded(HOSTILE[name], model)


def test_refusals_name_the_problem():
    model = FakeLM(alphabet=ASCII)
    for name, words in [
        ("regex back-reference", "backreferences are not supported"),
        ("unimplemented keywords", 'Unimplemented keys: ["dependentSchemas"]'),
        ("missing $ref", "'/$defs/nope' does not exist"),
        ("enum of 100k values", "more than the 131072 allowed"),
        ("nested objects 100 deep", "recursion limit exceeded"),
        ("recursive $ref", "matches no text the model can write"),
    ]:
        with pytest.raises(OptionError, match=re.escape(words)):
            C.compile(HOSTILE[name](), model)


# -- the real default pair (slow) ------------------------------------------------------------------
SCHEMAS = [
    PERSON,
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "minItems": 1, "maxItems": 2},
            "rain": {"type": "number", "minimum": 0, "maximum": 1},
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]},
        },
        "required": ["city", "days", "rain"],
        "additionalProperties": False,
    },
]


@pytest.mark.slow
def test_every_method_gives_valid_json_on_the_real_pair(smol_models):
    jsonschema = pytest.importorskip("jsonschema")
    t, a = smol_models.target, smol_models.aux
    ids = t.tokenize(t.apply_chat_template([{"role": "user", "content": "Answer in JSON: a person, or the weather."}]))
    finished = 0
    for schema in SCHEMAS:
        compiled = C.compile(Grammar.json_schema(schema), t)
        for method in ("ar", "sd", "mtad", "mmtad", "beam"):
            for temperature in (0.0, 1.0):
                sampling = SamplingConfig(temperature=temperature)
                cfg = DecodeConfig(method, 40, gamma=4, beam_width=2, sampling=sampling, seed=2)
                out, st = generate_tokens(t, a, ids, cfg, constraint=compiled)
                assert compiled.start().commit(out) == len(out), (method, temperature)
                if st.finish_reason == "stop":
                    jsonschema.validate(json.loads(text_of(t, out)), schema)
                    finished += 1
                else:
                    assert st.finish_reason == "length", st.finish_reason
    assert finished >= len(SCHEMAS) * 5  # most answers fit in 40 tokens (about 28 each)


@pytest.mark.slow
def test_forced_tokens_on_the_real_vocabulary_stop_before_a_token_that_could_merge(smol_models):
    t = smol_models.target
    m = C.compile(Grammar.json_schema(PERSON), t).start()
    forced = m.forced()
    text = text_of(t, forced)
    assert text == '{"name":'  # the forced bytes go on with ' "', which the name's first token may join
    assert t.tokenize('{"name": "x', add_special=False)[: len(forced)] == forced  # canonical tokens


@pytest.mark.slow
def test_hostile_grammars_are_bounded_on_a_real_vocabulary(smol_models):
    C.vocab_of(smol_models.target)
    outcomes = {name: assert_refused_or_bounded(make, smol_models.target) for name, make in HOSTILE.items()}
    assert sum(o.startswith("refused") for o in outcomes.values()) >= 15, outcomes
