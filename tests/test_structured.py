"""The surfaces of structured output (runtime/text/structured.py): response formats and
llama-server's fields as grammars, tools as a grammar of calls plus a parser (whole and streamed),
the history's tool turns for a template that takes tools and for one that does not, finish
reasons, and the server's request and response shapes. Fake backends only: the real client
against a real server is tests/test_structured_server.py."""

import json

import pytest

from helpers import ASCII, FakeLM, fake_engine
from mtad_edge.runtime.errors import OptionError
from mtad_edge.runtime.text import structured as S
from mtad_edge.runtime.text.constraint import Grammar
from mtad_edge.server import protocol as P

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {  # with a $ref: each tool's parameters are a schema of their own, so refs resolve
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/small"}, "b": {"$ref": "#/$defs/small"}},
    "required": ["a", "b"],
    "additionalProperties": False,
    "$defs": {"small": {"type": "integer", "minimum": 0, "maximum": 9}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def engine():
    t = FakeLM(salt=1, n_seq_max=9, alphabet=ASCII, sharpness=2.0, n_ctx=2048)
    a = FakeLM(salt=2, n_seq_max=9, alphabet=ASCII, n_ctx=2048)
    return fake_engine(t, a, max_tokens=120)


def valid_calls(calls, names=("get_weather", "add")):
    assert calls, calls
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_") and c["function"]["name"] in names
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])


# -- formats -------------------------------------------------------------------------------------
def test_response_formats_and_llama_server_fields_become_grammars():
    assert S.constraint_of() is None and S.constraint_of(response_format={"type": "text"}) is None
    g, param = S.constraint_of(response_format={"type": "json_object"})
    assert g == Grammar.json_object() and param == "response_format"
    spec = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    g, _ = S.constraint_of(response_format=spec)
    assert g.kind == "json_schema" and json.loads(g.text) == WEATHER and g.strict
    g, _ = S.constraint_of(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})
    assert not g.strict  # OpenAI's default: strict false (ignore what cannot be enforced, enforce the rest)
    assert S.constraint_of(json_schema=WEATHER) == (Grammar.json_schema(WEATHER, strict=False), "json_schema")
    assert S.constraint_of(grammar='root ::= "a"')[0].kind == "gbnf"
    for kw, param, words in [
        (dict(response_format={"type": "yaml"}), "response_format", "must be text, json_object or json_schema"),
        (dict(response_format={"type": "json_schema"}), "response_format", "needs a 'json_schema' object"),
        (dict(response_format={"type": "json_object", "x": 1}), "response_format", "does not take"),
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": 3}}), "response_format", "schema"),
        (dict(json_schema=[1]), "json_schema", "must be a JSON schema object"),
        (dict(grammar=7), "grammar", "GBNF or Lark text"),
        (dict(json_schema={}, grammar="root ::= x"), "grammar", "give one of json_schema and grammar"),
    ]:
        with pytest.raises(OptionError, match=words) as e:
            S.constraint_of(**kw)
        assert e.value.param == param


def test_a_response_format_on_the_engine_gives_valid_json_and_a_refusal_names_its_field():
    with engine() as e:
        spec = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
        r = e.chat([{"role": "user", "content": "w"}], response_format=spec, seed=1, temperature=1.0)
        text = r.text()
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(text), WEATHER)
        bad = {
            "type": "json_schema",
            "json_schema": {"schema": {"type": "object", "dependentSchemas": {}}, "strict": True},
        }
        with pytest.raises(OptionError, match="Unimplemented keys") as err:
            e.chat([{"role": "user", "content": "w"}], response_format=bad)
        assert err.value.param == "response_format"


def test_a_stop_string_that_cuts_a_constrained_answer_short_is_not_stop():
    with engine() as e:
        schema = {
            "type": "object",
            "properties": {"a": {"enum": ["x,y"]}, "b": {"enum": ["z"]}},
            "required": ["a", "b"],
        }
        r = e.generate("j", json_schema=schema, stop=[","], seed=1)
        assert r.text() == '{"a": "x' and r.finish_reason == "cut" and r.stats.finish_reason == "cut"
        # a stop string after a complete answer cut nothing the grammar needed
        for seed in range(4):
            r = e.generate("j", grammar='root ::= "ab" | "ab;c"', stop=[";"], seed=seed)
            assert r.text() == "ab" and r.finish_reason == "stop"
    assert P.finish_reason("cut") == P.finish_reason("dead_end") == "length"  # never reported as whole
    assert P.finish_reason("tool_calls") == "tool_calls" and P.finish_reason("stop") == "stop"


# -- tools -----------------------------------------------------------------------------------------
def test_tool_choices_are_checked_and_refusals_name_the_field():
    plan = S.tool_plan(TOOLS)
    assert plan.mode == "auto" and [t.name for t in plan.tools] == ["get_weather", "add"] and not plan.parallel
    assert S.tool_plan(TOOLS, "none").offered == ()
    assert S.tool_plan(TOOLS, {"type": "function", "function": {"name": "add"}}).name == "add"
    assert S.tool_plan(None, "auto") is None and S.tool_plan([], "none") is None
    fn = {"type": "function", "function": {"name": "f"}}
    for args, param, words in [
        ((None, "required"), "tool_choice", "needs tools"),
        (("f",), "tools", "must be a list"),
        (([{"type": "function", "function": {"name": "a b"}}],), "tools", "letters, digits"),
        (([fn, fn],), "tools", "a second function named 'f'"),
        (([{"type": "function", "function": {"name": "f", "parameters": 3}}],), "tools", "parameters must be"),
        (([{"type": "function", "function": {"name": "f", "extra": 1}}],), "tools", "has a field 'extra'"),
        (([fn], "sometimes"), "tool_choice", "must be none, auto, required"),
        (([fn], {"type": "function", "function": {"name": "g"}}), "tool_choice", "not among the tools"),
        (([fn], "auto", "yes"), "parallel_tool_calls", "true or false"),
        ([[fn] * 200], "tools", "more than the 128"),
    ]:
        with pytest.raises(OptionError, match=words) as e:
            S.tool_plan(*args)
        assert e.value.param == param


@pytest.mark.parametrize("method", ["ar", "sd", "mtad"])
def test_required_tool_calls_parse_and_their_arguments_validate(method):
    with engine() as e:
        for seed in range(3):
            r = e.chat(
                [{"role": "user", "content": "w"}], tools=TOOLS, tool_choice="required", method=method, seed=seed
            )
            text = r.text()
            assert r.finish_reason == "tool_calls", (text, r.finish_reason)
            valid_calls(r.tool_calls)
            assert len(r.tool_calls) == 1 and text.startswith(S.OPEN) and text.endswith(S.CLOSE)


def test_a_named_function_is_the_one_called_and_parallel_calls_are_bounded():
    with engine() as e:
        named = {"type": "function", "function": {"name": "add"}}
        for seed in range(3):
            r = e.chat([{"role": "user", "content": "w"}], tools=TOOLS, tool_choice=named, seed=seed)
            r.text()
            assert [c["function"]["name"] for c in r.tool_calls] == ["add"]
        made = []
        for seed in range(6):
            asked = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=True, max_tokens=800)
            r = e.chat([{"role": "user", "content": "w"}], seed=seed, **asked)
            r.text()
            valid_calls(r.tool_calls)
            made.append(len(r.tool_calls))
        assert max(made) <= S.MAX_CALLS and max(made) > 1 and min(made) == 1, made
        grammar = S.tool_plan(TOOLS, "required", True).grammar().text
        assert f"{{0,{S.MAX_CALLS - 1}}}" in grammar and "{0," not in S.tool_plan(TOOLS, "required").grammar().text


def test_auto_is_either_text_that_does_not_start_a_call_or_calls():
    with engine() as e:
        kinds = set()
        for seed in range(12):
            r = e.chat([{"role": "user", "content": "w"}], tools=TOOLS, seed=seed, max_tokens=60, temperature=1.0)
            text = r.text()
            if r.tool_calls:
                valid_calls(r.tool_calls)
                kinds.add("calls")
            else:
                assert not text.startswith(S.MARKER) and r.finish_reason in ("stop", "length")
                kinds.add("text")
        assert "text" in kinds  # the fake model starts with '<' one time in 95
        # a JSON response format beside auto: the answer is calls or that JSON
        g = S.tool_plan(TOOLS).grammar(Grammar.json_schema(WEATHER))
        assert "start: calls | answer" in g.text and g.about == "the tools' grammar"
        with pytest.raises(OptionError, match="JSON response format") as err:
            S.tool_plan(TOOLS).grammar(Grammar.regex("a+"))
        assert err.value.param == "tools"
        assert S.tool_plan(TOOLS, "none").grammar(None) is None


def test_a_tools_grammar_that_cannot_compile_is_refused_naming_tools():
    lookahead = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}}
    bad = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": lookahead}}]
    with engine() as e, pytest.raises(OptionError, match="the tools' grammar is refused") as err:
        e.chat([{"role": "user", "content": "w"}], tools=bad, tool_choice="required")
    assert err.value.param == "tools"


def test_the_call_reader_is_the_same_however_the_text_is_split():
    text = (
        S.call_text("get_weather", {"city": "Par\u00eds\\n}", "unit": "c"})
        + "\n"
        + S.call_text("add", {"a": 1, "b": 2})
    )

    def read(step):
        stream, events = S.CallStream(), []
        for i in range(0, len(text), step):
            events += stream.push(text[i : i + step])
        return events + stream.finish(), stream.calls()

    whole_events, whole = read(len(text))
    assert [c["function"] for c in whole] == [
        {"name": "get_weather", "arguments": '{"city": "Par\u00eds\\\\n}", "unit": "c"}'},
        {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    ]
    for step in (1, 2, 3, 5, 8, 13):
        events, calls = read(step)
        assert [c["function"] for c in calls] == [c["function"] for c in whole]
        assert "".join(e[2] for e in events if e[0] == "arguments" and e[1] == 0) == whole[0]["function"]["arguments"]
        assert [e[3] for e in events if e[0] == "call"] == ["get_weather", "add"]
    # text is content, held back only while it may still become a call
    stream = S.CallStream()
    assert stream.push("<to") == [] and stream.push("p>") == [("content", "<top>")] and stream.calls() is None
    stream = S.CallStream()
    assert stream.push("<") == [] and stream.finish() == [("content", "<")]
    for cut in (S.OPEN, text[:40], text + "x", text[:-1]):  # cut short, or not the format: no calls
        stream = S.CallStream()
        stream.push(cut)
        stream.finish()
        assert stream.calls() is None


# -- the history -------------------------------------------------------------------------------------
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
HISTORY = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
    {"role": "user", "content": "And Paris?"},
]


def test_the_fallback_describes_the_tools_in_a_system_block_and_writes_tool_turns_as_text():
    plan = S.tool_plan(TOOLS)
    msgs = S.plain_messages([{"role": "system", "content": "Be brief."}, *HISTORY], plan.block())
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "user"]
    assert msgs[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "add"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert (
        msgs[3]["content"]
        == '<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\nsunny\n</tool_response>'
    )
    assert S.plain_messages(HISTORY)[0]["role"] == "user"  # no tools offered: no block
    with engine() as e:
        prompt = e.render_chat(HISTORY, TOOLS)
        assert prompt.startswith("<system># Tools") and "<assistant><tool_call>\n" in prompt
        with pytest.raises(OptionError, match="arguments is not JSON") as err:
            bad = [{**HISTORY[1], "tool_calls": [{"function": {"name": "f", "arguments": "{nope"}}]}]
            e.chat([HISTORY[0], *bad, HISTORY[4]])
        assert err.value.param == "messages"


QWEN_LIKE = (  # the shape of Qwen 2.5's template: tools in the system turn, calls and results its own way
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "\nCall within <tool_call></tool_call>.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{%- elif m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    '{%- for c in m.tool_calls %}<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


class TemplatedLM(FakeLM):
    """A fake model whose own chat template takes tools."""

    def chat_template_text(self):
        return QWEN_LIKE


def test_a_template_that_takes_tools_is_given_them_and_the_tool_turns():
    assert S.takes_tools(QWEN_LIKE) and not S.takes_tools("{{ messages }}")
    with fake_engine(TemplatedLM(salt=1, n_seq_max=9, alphabet=ASCII, n_ctx=2048), None, method="ar") as e:
        prompt = e.render_chat(HISTORY, TOOLS)
        assert '<tools>{"type": "function", "function": {"name": "get_weather", "description": "The weather"' in prompt
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in prompt
        assert "<tool_response>\nsunny\n</tool_response>" in prompt and "# Tools\n\nYou may call" not in prompt
        assert e.render_chat(HISTORY[:1]) == "<user>Weather in Rome?<assistant>"  # no tools: the model's own way
        r = e.chat(HISTORY, tools=TOOLS, tool_choice="required", method="ar", seed=1)
        r.text()
        valid_calls(r.tool_calls)


# -- the server's shapes ---------------------------------------------------------------------------
def test_the_server_reads_tool_turns_and_refuses_what_it_cannot_read():
    fields = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    body = {"messages": HISTORY, **fields, "response_format": {"type": "json_object"}}
    req = P.parse(body, "chat", "m")
    assert req.structured == {k: body[k] for k in ("tools", "tool_choice", "parallel_tool_calls", "response_format")}
    assert req.messages[1] == {"role": "assistant", "content": None, "tool_calls": [CALL]}
    assert req.messages[2] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "c1"}
    assert P.parse({"prompt": "x", "json_schema": WEATHER, "grammar": "g"}, "text", "m").structured["grammar"] == "g"
    for bad, param in [
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]}, "messages[0].tool_calls"),
        ({"prompt": "x", "tools": TOOLS}, "tools"),  # completions take no tools
    ]:
        kind = "text" if "prompt" in bad else "chat"
        with pytest.raises(P.BadRequest) as e:
            P.parse(bad, kind, "m")
        assert e.value.param == param, e.value.message


def test_call_events_become_openai_deltas():
    events = [
        ("call", 0, "call_a", "add"),
        ("arguments", 0, '{"a"'),
        ("arguments", 0, ": 1}"),
        ("call", 1, "call_b", "f"),
    ]
    text, calls = P.call_deltas(events)
    assert text == "" and calls == [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "f", "arguments": ""}},
    ]
    assert P.call_deltas([("arguments", 1, "}")]) == ("", [{"index": 1, "function": {"arguments": "}"}}])
    assert P.call_deltas([("content", "hi")]) == ("hi", [])
    chunk = P.chunk("chat", "id", "m", 0, None, None, calls=calls)
    assert chunk["choices"][0]["delta"] == {"tool_calls": calls}
    whole = P.full("chat", "id", "m", "<tool_call>...", "tool_calls", 3, 4, {}, None, [{"id": "x"}])
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}
