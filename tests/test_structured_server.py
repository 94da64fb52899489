"""Structured output and tool calls through the real openai client against a real `mtad-edge serve`
on the default pair: parsed Pydantic answers, a tools round trip (auto and required, streamed and
not) whose arguments validate, and hostile schemas refused within 2 s while another request runs."""

import json
import subprocess
import threading
import time
from typing import Literal

import pytest

from helpers import EXE, read_until

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    }
]
# A turn that called the tool and read its result: the model, asked again, calls it again (auto).
EARLIER = [
    {"role": "user", "content": "What's the weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "It is 21 degrees in Rome."},
]  # fmt: skip
PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(smol_files):
    args = ["serve", "--port", "0", "--ctx-size", "2048", "--threads", "2", "--max-tokens", "48", "--queue-size", "8"]
    proc = subprocess.Popen([EXE, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found = read_until(proc, r"on http://127\.0\.0\.1:(\d+)/v1 ", timeout=180)
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # its log lines must not fill the pipe
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{found.group(1)}/v1", api_key="none", max_retries=0, timeout=120)
    proc.terminate()
    proc.wait(timeout=30)


def assert_calls(calls):
    assert calls and all(c.type == "function" and c.function.name == "get_weather" for c in calls), calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), WEATHER)


def streamed_calls(chunks):
    """The calls a stream's deltas add up to, and its finish reason."""
    calls, reason = {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        reason = ch.choices[0].finish_reason or reason
        for d in ch.choices[0].delta.tool_calls or ():
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
    return list(calls.values()), reason


def test_parse_gives_a_pydantic_object_that_validates(client):
    class Person(pydantic.BaseModel):
        name: str
        age: int
        color: Literal["red", "green", "blue"]

    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], response_format=Person,
        temperature=0, max_tokens=48,
    )  # fmt: skip
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop", r
    # llama-server's fields: a schema on /v1/completions, a GBNF grammar
    text = client.completions.create(
        model=MODEL, prompt="A city:", max_tokens=24, temperature=0, extra_body={"json_schema": WEATHER}
    )
    jsonschema.validate(json.loads(text.choices[0].text), WEATHER)
    yes = client.chat.completions.create(
        model=MODEL, messages=PARIS, max_tokens=8, extra_body={"grammar": 'root ::= "yes" | "no"'}
    )
    assert yes.choices[0].message.content in ("yes", "no") and yes.choices[0].finish_reason == "stop"


def test_a_tools_round_trip_required_then_the_result_fed_back(client):
    r = client.chat.completions.create(model=MODEL, messages=PARIS, tools=TOOLS, tool_choice="required", temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert_calls(choice.message.tool_calls)
    call = choice.message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'}
    answer = client.chat.completions.create(
        model=MODEL, messages=[*PARIS, choice.message.model_dump(exclude_none=True), result], tools=TOOLS,
        tool_choice="none", temperature=0, max_tokens=24,
    )  # fmt: skip
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    streamed, reason = streamed_calls(
        client.chat.completions.create(
            model=MODEL, messages=PARIS, tools=TOOLS, tool_choice="required", temperature=0, stream=True
        )
    )
    assert reason == "tool_calls" and streamed == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls
    ]


def test_auto_calls_when_the_model_chooses_to_streamed_and_not(client):
    r = client.chat.completions.create(model=MODEL, messages=[*EARLIER, *PARIS], tools=TOOLS, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    assert_calls(r.choices[0].message.tool_calls)
    chunks = client.chat.completions.create(
        model=MODEL, messages=[*EARLIER, *PARIS], tools=TOOLS, temperature=0, stream=True
    )
    streamed, reason = streamed_calls(chunks)
    assert reason == "tool_calls" and [c["arguments"] for c in streamed] == [
        c.function.arguments for c in r.choices[0].message.tool_calls
    ]
    # and answers in text where it does not call (the same tools offered)
    poem = [{"role": "user", "content": "Write one line about the sea."}]
    text = client.chat.completions.create(model=MODEL, messages=poem, tools=TOOLS, temperature=0, max_tokens=16)
    assert text.choices[0].message.content and not text.choices[0].message.tool_calls


HOSTILE = {
    "recursive $ref": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    "nested 100 deep": json.loads('{"type":"object","properties":{"a":' * 100 + "{}" + "}}" * 100),
    "unimplemented keyword": {"type": "object", "dependentSchemas": {"a": {}}},
    "missing $ref": {"$ref": "#/$defs/nope"},
    "unsatisfiable": {"type": "integer", "minimum": 10, "maximum": 1},
    "over 128 KiB": {"enum": [f"value-{i}" for i in range(20_000)]},
}


def test_hostile_schemas_are_refused_within_2_s_while_another_request_runs(client):
    warm = {"type": "json_object"}  # the model's vocabulary is read once, at its first grammar (~1 s)
    client.chat.completions.create(model=MODEL, messages=PARIS, response_format=warm, max_tokens=1)
    pieces = []

    def normal():
        stream = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=48, stream=True, seed=1)
        pieces.extend(c.choices[0].delta.content or "" for c in stream if c.choices)

    runner = threading.Thread(target=normal)
    runner.start()
    for name, schema in HOSTILE.items():
        spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
        t0 = time.perf_counter()
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=PARIS, response_format=spec, max_tokens=8)
        took = time.perf_counter() - t0
        message = e.value.body["message"]
        assert took < 2.0 and e.value.body["param"] == "response_format" and "\n" not in message, (name, took, message)
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": HOSTILE["missing $ref"]}}]
    with pytest.raises(openai.BadRequestError, match="the tools' grammar is refused"):
        client.chat.completions.create(model=MODEL, messages=PARIS, tools=bad_tool, tool_choice="required")
    runner.join(120)
    assert not runner.is_alive() and "".join(pieces)  # the other request was served meanwhile
