"""The surfaces' structured output: OpenAI's ``response_format``, llama-server's ``json_schema``
and ``grammar`` fields, and tool calls, as ``Grammar`` constraints (runtime/text/constraint.py).

Tool calls are structured output plus a parser. The answer format is the one Qwen 2.5, Hermes
and SmolLM3 are trained on, one call a block::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(blocks joined by a newline where several calls are allowed). ``ToolPlan.grammar`` is a Lark
grammar of it: the name a choice of the tools' names, the arguments each tool's ``parameters``
schema (a ``%json`` of its own, so its ``$ref``s resolve), the JSON in one line. ``auto`` lets the
answer be either calls or text (or the ``response_format``'s JSON); a text answer may not begin
with ``<tool`` (the format's markers), so a model that starts one writes a call. ``CallStream``
reads the answer back as it streams: content, or calls as OpenAI's deltas.

A chat template that takes ``tools`` and writes this format (``takes_tools``) is given them; any
other gets the fallback: a system block describing the tools and the format (``ToolPlan.block``),
assistant calls in the history written as blocks, and tool results as a user turn of
``<tool_response>`` blocks (``plain_messages``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..errors import OptionError, json_problem, quoted
from .constraint import JSON_OPTIONS, Grammar

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"  # around each call; calls are joined by "\n"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>\n", "\n</tool_response>"  # a tool's result, in the fallback
MARKER = "<tool"  # a text answer may not begin with it (auto)
MAX_TOOLS = 128
MAX_CALLS = 8  # calls one answer may make with parallel_tool_calls (a small model may repeat itself)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names: no escaping in JSON or Lark
CHOICES = ("none", "auto", "required")
HEAD = '{"name": "'  # a call's JSON up to its name, then NAME_END, the arguments and "}"
NAME_END = '", "arguments": '

Message = dict[str, Any]


# -- response formats ------------------------------------------------------------------------------
def constraint_of(
    response_format: Any = None, json_schema: Any = None, grammar: Any = None
) -> Optional[tuple[Grammar, str]]:
    """The grammar a request's format fields ask for, and the field it came from: OpenAI's
    ``response_format`` ({"type": "text" | "json_object" | "json_schema", ...}), llama-server's
    ``json_schema`` (a schema) and ``grammar`` (GBNF, or Lark where it says ``start:`` or
    ``%llguidance``); at most one. None: free text."""
    given = [(n, v) for n, v in (("response_format", response_format), ("json_schema", json_schema)) if v is not None]
    given += [("grammar", grammar)] if grammar is not None else []
    if len(given) > 1:
        raise OptionError(f"give one of {' and '.join(n for n, _ in given)}, not both", given[1][0])
    if not given:
        return None
    name, value = given[0]
    try:
        if name == "grammar":
            if not isinstance(value, str) or not value.strip():
                raise OptionError(f"grammar must be GBNF or Lark text, got {quoted(value)}", name)
            return Grammar.gbnf(value), name
        if name == "json_schema":
            if not isinstance(value, (Mapping, bool)):
                raise OptionError(f"json_schema must be a JSON schema object, got {quoted(value)}", name)
            return Grammar.json_schema(_schema_object(value, name), strict=False), name
        found = _response_format(value)
        return (found, name) if found is not None else None
    except OptionError as e:
        raise OptionError(str(e), name) from None


def _response_format(value: Any) -> Optional[Grammar]:
    if not isinstance(value, Mapping):
        raise OptionError(f"response_format must be an object with a 'type', got {quoted(value)}")
    kind = value.get("type")
    unknown = [k for k in value if k not in ("type", "json_schema")]
    if kind not in ("text", "json_object", "json_schema"):
        raise OptionError(f"response_format.type must be text, json_object or json_schema, got {quoted(kind)}")
    if unknown or (kind != "json_schema" and "json_schema" in value):
        raise OptionError(
            f"response_format has a field {quoted((unknown or ['json_schema'])[0])} its type does not take"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise OptionError("response_format json_schema needs a 'json_schema' object with its 'schema'")
    extra = [k for k in spec if k not in ("name", "description", "schema", "strict")]
    if extra:
        raise OptionError(f"response_format.json_schema has a field {quoted(extra[0])} (it takes name, schema, strict)")
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and NAME.fullmatch(name)):
        raise OptionError(f"response_format.json_schema.name must be 1-64 letters, digits, _ or -, got {quoted(name)}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise OptionError(f"response_format.json_schema.strict must be true or false, got {quoted(strict)}")
    schema = spec.get("schema", {})  # OpenAI: no schema is any JSON value
    return Grammar.json_schema(_schema_object(schema, "response_format.json_schema.schema"), strict=bool(strict))


def _schema_object(schema: Any, what: str) -> Mapping[str, Any]:
    if isinstance(schema, bool):  # JSON schema's true / false
        return {} if schema else {"not": {}}
    if not isinstance(schema, Mapping):
        raise OptionError(f"{what} must be a JSON schema object, got {quoted(schema)}")
    return schema


def is_json(grammar: Grammar) -> bool:
    return grammar.kind in ("json_schema", "json_object")


# -- tools -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tool:
    """One function a model may call: OpenAI's ``{"type": "function", "function": {...}}``."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # a JSON schema of the arguments (an object)
    strict: bool  # refuse what llguidance cannot enforce in it (else that is ignored)

    def spec(self) -> dict[str, Any]:
        """As a chat template and the fallback block show it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and what it asks of them: ``mode`` none (the tools are not offered),
    auto (calls or an answer), required (calls); ``name``: the one function it must call;
    ``parallel``: up to MAX_CALLS calls, else exactly one (the default, as llama-server's: a
    small model asked for calls at temperature 0 repeats its call until max_tokens)."""

    tools: tuple[Tool, ...]
    mode: str
    name: Optional[str] = None
    parallel: bool = False

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the prompt describes (none with tool_choice none)."""
        return () if self.mode == "none" else self.tools

    def grammar(self, answer: Optional[Grammar] = None) -> Optional[Grammar]:
        """The answer's grammar: ``answer`` (a response format, or free text where None) with
        tool_choice none; calls only where required or named; either where auto."""
        if self.mode == "none":
            return answer
        if answer is not None and not is_json(answer):
            raise OptionError(
                f"tools take a JSON response format beside them, not {answer.what}: drop one of them", "tools"
            )
        tools = [t for t in self.tools if self.name is None or t.name == self.name]
        more = f" ({_lit(chr(10))} call){{0,{MAX_CALLS - 1}}}" if self.parallel else ""
        names = " | ".join(f"fn{i}" for i in range(len(tools)))
        head, tail = _lit(OPEN + HEAD), _lit("}" + CLOSE)
        rules = [f"calls: call{more}", f"call: {head} ({names}) {tail}"]
        for i, t in enumerate(tools):
            rules.append(f"fn{i}: {_lit(t.name + NAME_END)} args{i}")
            rules.append(f"args{i}: %json {_json_rule(t.parameters, t.strict)}")
        if self.mode == "required":
            start = "start: calls"
        elif answer is None:
            start = f"start: calls | TEXT\nTEXT: /(?s:.*)/ & ~/{MARKER}(?s:.*)/"
        else:
            try:
                schema = json.loads(answer.text) if answer.kind == "json_schema" else {"type": "object"}
            except (ValueError, RecursionError) as e:
                raise OptionError(f"the JSON schema beside the tools is not JSON: {json_problem(e)}", "tools") from None
            rule = _json_rule(_schema_object(schema, "the JSON schema beside the tools"), answer.strict)
            start = f"start: calls | answer\nanswer: %json {rule}"
        return Grammar("lark", "\n".join([start, *rules]) + "\n", about="the tools' grammar")

    def block(self) -> str:
        """The fallback: a system block describing the tools and the format to call them in."""
        lines = "\n".join(json.dumps(t.spec(), ensure_ascii=False) for t in self.offered)
        how = "one or more functions" if self.parallel else "a function"
        return (
            f"# Tools\n\nYou may call {how} to answer the user.\n\n"
            f"The functions, one a line within <tools></tools>:\n<tools>\n{lines}\n</tools>\n\n"
            "To call a function, answer with a JSON object of its name and arguments within "
            "<tool_call></tool_call> tags:\n"
            f'{OPEN}{{"name": <function-name>, "arguments": <args-json-object>}}{CLOSE}'
        )


def _lit(text: str) -> str:
    """A Lark string literal of ``text`` (ASCII here: names are NAME, the rest our markup)."""
    return json.dumps(text)


def _json_rule(schema: Mapping[str, Any], strict: bool) -> str:
    """A schema for a Lark ``%json`` rule: our JSON options (one line) unless it sets its own,
    lenient unless strict."""
    own = schema.get("x-guidance") or {}
    if not isinstance(own, Mapping):
        raise OptionError(f"a schema's x-guidance must be an object, got {quoted(own)}", "tools")
    options = {**JSON_OPTIONS, "lenient": not strict, **own}
    try:
        return json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)
    except RecursionError:
        raise OptionError("a schema beside the tools is nested too deeply", "tools") from None
    except (TypeError, ValueError) as e:
        raise OptionError(f"a schema beside the tools is not JSON: {e}", "tools") from None


def tool_plan(tools: Any = None, tool_choice: Any = None, parallel_tool_calls: Any = None) -> Optional[ToolPlan]:
    """OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked (OptionError naming
    the field); None where no tools are given (tool_choice then may only be none or auto)."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise OptionError(
            f"parallel_tool_calls must be true or false, got {quoted(parallel_tool_calls)}", "parallel_tool_calls"
        )
    if tools is None or (isinstance(tools, list) and not tools):
        if tool_choice is not None and tool_choice not in ("none", "auto"):
            raise OptionError("tool_choice needs tools to choose from", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise OptionError(f"tools must be a list of functions, got {quoted(tools)}", "tools")
    if len(tools) > MAX_TOOLS:
        raise OptionError(f"{len(tools)} tools is more than the {MAX_TOOLS} allowed", "tools")
    checked: list[Tool] = []
    for i, spec in enumerate(tools):
        tool = _tool(spec, f"tools[{i}]")
        if any(t.name == tool.name for t in checked):
            raise OptionError(f"tools[{i}]: a second function named {tool.name!r}", "tools")
        checked.append(tool)
    mode, name = "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise OptionError(
                f"tool_choice must be none, auto, required or a function, got {quoted(tool_choice)}", "tool_choice"
            )
        mode = tool_choice
    elif isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(function, Mapping):
            raise OptionError(
                'tool_choice names a function as {"type": "function", "function": {"name": ...}}', "tool_choice"
            )
        name = function.get("name")
        if not any(t.name == name for t in checked):
            raise OptionError(f"tool_choice names {quoted(name)}, which is not among the tools", "tool_choice")
        mode = "required"
    elif tool_choice is not None:
        raise OptionError(
            f"tool_choice must be none, auto, required or a function, got {quoted(tool_choice)}", "tool_choice"
        )
    return ToolPlan(tuple(checked), mode, name, bool(parallel_tool_calls))


def _tool(spec: Any, where: str) -> Tool:
    if not isinstance(spec, Mapping) or spec.get("type") != "function" or not isinstance(spec.get("function"), Mapping):
        raise OptionError(f'{where} must be {{"type": "function", "function": {{"name": ..., ...}}}}', "tools")
    f = spec["function"]
    extra = [k for k in f if k not in ("name", "description", "parameters", "strict")]
    if extra:
        raise OptionError(
            f"{where}.function has a field {quoted(extra[0])} (it takes name, description, parameters, strict)", "tools"
        )
    name, description = f.get("name"), f.get("description") or ""
    if not (isinstance(name, str) and NAME.fullmatch(name)):
        raise OptionError(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {quoted(name)}", "tools")
    if not isinstance(description, str):
        raise OptionError(f"{where}.function.description must be a string", "tools")
    parameters = f.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}  # OpenAI: a function that takes no arguments
    if not isinstance(parameters, Mapping):
        raise OptionError(
            f"{where}.function.parameters must be a JSON schema object, got {quoted(parameters)}", "tools"
        )
    strict = f.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise OptionError(f"{where}.function.strict must be true or false, got {quoted(strict)}", "tools")
    return Tool(name, description, parameters, bool(strict))


# -- the history -----------------------------------------------------------------------------------
def check_messages(messages: Any) -> None:
    """Messages as Engine.chat takes them: role and content (text) each; an assistant's may
    carry ``tool_calls`` (OpenAI's shape, then content may be None) and a ``tool`` message answers
    one (``tool_call_id``). OptionError naming the message."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise OptionError("messages must be a list of {'role': ..., 'content': ...} dicts", "messages")
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls:
            if m.get("role") != "assistant":
                raise OptionError(f"messages[{i}]: only an assistant message makes tool calls", "messages")
            _calls(calls, f"messages[{i}]")
        if m.get("role") == "tool" and not isinstance(m.get("tool_call_id", ""), str):
            raise OptionError(f"messages[{i}].tool_call_id must be a string", "messages")


def _calls(calls: Any, where: str) -> list[tuple[str, Any]]:
    """An assistant's tool calls as (name, arguments as JSON values)."""
    if not isinstance(calls, list):
        raise OptionError(f"{where}.tool_calls must be a list", "messages")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(f, Mapping) or not isinstance(f.get("name"), str) or not f["name"]:
            raise OptionError(
                f"{where}.tool_calls[{j}] must be "
                '{"type": "function", "function": {"name": ..., "arguments": ...}}',
                "messages",
            )
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError) as e:
                raise OptionError(
                    f"{where}.tool_calls[{j}].function.arguments is not JSON: {json_problem(e)}", "messages"
                ) from None
        out.append((f["name"], args))
    return out


def has_tool_turns(messages: Sequence[Message]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def call_text(name: str, arguments: Any) -> str:
    """One call as the format writes it (what the grammar makes the model write)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, separators=(", ", ": "))
    return f"{OPEN}{body}{CLOSE}"


def plain_messages(messages: Sequence[Message], block: Optional[str] = None) -> list[dict[str, str]]:
    """The fallback for a template that takes no tools: role and content only. ``block`` (the
    tools' description) joins the first system message (or becomes one); an assistant's calls are
    written after its content as the format's blocks; tool results become one user turn of
    ``<tool_response>`` blocks per run of them."""
    out: list[dict[str, str]] = []
    results: list[str] = []
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            results.append(f"{RESULT_OPEN}{content}{RESULT_CLOSE}")
            continue
        if results:
            out.append({"role": "user", "content": "\n".join(results)})
            results = []
        if m.get("tool_calls"):
            calls = "\n".join(call_text(n, a) for n, a in _calls(m["tool_calls"], f"messages[{i}]"))
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": role, "content": content})
    if results:
        out.append({"role": "user", "content": "\n".join(results)})
    if block:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def template_messages(messages: Sequence[Message]) -> list[Message]:
    """For a template that takes tools (Hugging Face's convention): an assistant's calls with
    their arguments as JSON values, content text ("" for none)."""
    out: list[Message] = []
    for i, m in enumerate(messages):
        msg: Message = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            calls = _calls(m["tool_calls"], f"messages[{i}]")
            msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
        out.append(msg)
    return out


def takes_tools(template: str) -> bool:
    """Whether a chat template (jinja text) reads ``tools`` and writes calls in this format."""
    return "<tool_call>" in template and re.search(r"\btools\b", template) is not None


# -- the answer, read back -------------------------------------------------------------------------
Event = Union[tuple[str, str], tuple[str, int, str], tuple[str, int, str, str]]


class CallStream:
    """Reads an answer as its text streams in, for OpenAI's shapes: ``push`` returns events
    ("content", text), ("call", index, id, name) as a call's name is known, ("arguments", index,
    text) as its arguments come. Text that may still become a call's marker is held back.
    ``calls()``: the calls once the answer was read whole (None where it is text or was cut)."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # start, text, head, name, named, args, between, broken
        self._calls: list[dict[str, Any]] = []
        self._sent = 0  # characters of the current call's arguments already sent

    def push(self, piece: str) -> list[Event]:
        self._buf += piece
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        """The end of the answer: text held back is content after all."""
        out: list[Event] = []
        if self._state == "start" and self._buf:
            out.append(("content", self._buf))
            self._buf, self._state = "", "text"
        return out

    def calls(self) -> Optional[list[dict[str, Any]]]:
        if self._state != "between" or self._buf or not self._calls:
            return None
        for c in self._calls:
            try:
                json.loads(c["function"]["arguments"])
            except (ValueError, RecursionError):
                return None
        return [dict(c) for c in self._calls]

    def _expect(self, literal: str, then: str) -> bool:
        """Consume ``literal`` and go to state ``then``; wait while the text may still become it."""
        if self._buf.startswith(literal):
            self._buf, self._state = self._buf[len(literal) :], then
            return True
        if not literal.startswith(self._buf):
            self._state = "broken"  # not the format (the grammar keeps a constrained answer to it)
        return False

    def _step(self, out: list[Event]) -> bool:
        state, buf = self._state, self._buf
        if state == "start":
            if buf.startswith(OPEN) or OPEN.startswith(buf):
                return self._expect(OPEN, "head")
            self._state = "text"
            return True
        if state == "text":
            if buf:
                out.append(("content", buf))
                self._buf = ""
            return False
        if state == "head":
            return self._expect(HEAD, "name")
        if state == "name":
            end = buf.find('"')
            if end < 0:
                return False
            name, self._buf = buf[:end], buf[end:]
            call: dict[str, Any] = {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            self._calls.append(call)
            self._sent = 0
            out.append(("call", len(self._calls) - 1, call["id"], name))
            self._state = "named"
            return True
        if state == "named":
            return self._expect(NAME_END, "args")
        if state == "args":
            end = buf.find("\n")  # one-line JSON: the call's "}" then the closing marker's newline
            args = buf[: end - 1] if end > 0 else buf[:-1]  # the last character may be the call's "}"
            if len(args) > self._sent:
                out.append(("arguments", len(self._calls) - 1, args[self._sent :]))
                self._calls[-1]["function"]["arguments"] += args[self._sent :]
                self._sent = len(args)
            if end < 0:
                return False
            if buf[end - 1 : end] != "}":
                self._state = "broken"
                return False
            self._buf = buf[end - 1 :]
            return self._expect("}" + CLOSE, "between")
        if state == "between":
            if not buf:
                return False
            return self._expect("\n" + OPEN, "head")
        return False  # broken: the rest is not read
