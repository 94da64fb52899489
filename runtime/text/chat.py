"""Chat templates for backends without llama.cpp's template engine (ONNX Runtime).

A template is jinja text, as Hugging Face tokenizers carry it, or the name of one of llama.cpp's
built-in formats that manifests use (``"chat_template": {"source": "builtin", "name": "gemma"}``),
written here in jinja so both backends render the same prompt text.
"""

from __future__ import annotations

import datetime
import json
import re
import secrets
from collections.abc import Callable
from typing import Any, Optional

from ..errors import ModelLoadError, first_line, quoted

Segment = tuple[str, bool]  # text, and whether special tokens written in it are parsed (backend.Segments)

# A template's `*` may repeat a string or list into at most this many items: real templates
# repeat a few spaces, and a template that asks for gigabytes is not one (a model file is untrusted).
ROLES = ("system", "user", "assistant", "tool")  # the roles a message may have (a tool turn answers a call)
REPEAT_MAX = 1 << 20
POWER_MAX = 64  # `**` exponents a template may use: big-integer powers only burn CPU

BUILTIN = {
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Gemma has no system turn: llama.cpp merges system text into the next user turn.
    "gemma": (
        "{% set ns = namespace(system='') %}{% for m in messages %}"
        "{% if m.role == 'system' %}{% set ns.system = ns.system + m.content | trim %}"
        "{% else %}{% set role = 'model' if m.role == 'assistant' else m.role %}"
        "{{ '<start_of_turn>' + role + '\\n' }}"
        "{% if ns.system and role != 'model' %}{{ ns.system + '\\n\\n' }}{% set ns.system = '' %}{% endif %}"
        "{{ m.content | trim + '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
}


def render(
    template: str,
    messages: list[dict[str, Any]],
    add_assistant: bool = True,
    tools: Optional[list[dict[str, Any]]] = None,
    **special: str,
) -> str:
    """Render ``messages`` with jinja ``template`` text or a BUILTIN name; ``special`` gives
    bos_token/eos_token for templates that print them; ``tools``: OpenAI's function list, for a
    template that takes them (None: the template sees no tools).

    A template comes from a model folder or a manifest, so it is untrusted: it renders in jinja2's
    immutable sandbox (as llama-cpp-python does since CVE-2024-34359), where reaching for Python
    internals (``__class__``, ``__globals__``, ...) is a SecurityError, never a call."""
    import jinja2
    from jinja2.sandbox import SecurityError

    if not isinstance(template, str):
        raise ModelLoadError(f"a chat template must be text, got {quoted(template)}")
    if template in BUILTIN:
        template = BUILTIN[template]
    elif "{{" not in template and "{%" not in template:
        raise ModelLoadError(f"unknown built-in chat template {quoted(template)} (known here: {', '.join(BUILTIN)})")
    env = _sandbox()
    try:
        text: str = env.from_string(template).render(
            messages=messages, add_generation_prompt=add_assistant, tools=tools, **special
        )
        return text
    except SecurityError as e:
        raise ModelLoadError(f"chat template refused: it tries something unsafe ({_line(e)}); not rendered") from None
    except jinja2.TemplateError as e:
        raise ModelLoadError(f"chat template failed: {_line(e)}") from None
    except Exception as e:  # a template's own TypeError, ZeroDivisionError, ...: still a bad model file
        raise ModelLoadError(f"chat template failed: {type(e).__name__}: {_line(e)}") from None


def _line(e: BaseException) -> str:
    return quoted(first_line(e), bare=True)


def _sandbox() -> Any:
    """jinja2's ImmutableSandboxedEnvironment, with `*` and `**` bounded (REPEAT_MAX, POWER_MAX)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > REPEAT_MAX:
                        raise SecurityError(f"repeating {len(seq)} items {n} times is over {REPEAT_MAX}")
            elif isinstance(right, (int, float)) and abs(right) > POWER_MAX:
                raise SecurityError(f"exponent {right} is over {POWER_MAX}")
            return super().call_binop(context, operator, left, right)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True)
    # What Hugging Face's templates call beside jinja's own (transformers' chat template utils):
    # tojson without HTML escaping, raise_exception, strftime_now.
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(str(fmt))
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Optional[int] = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: Any) -> None:
    import jinja2

    raise jinja2.TemplateError(str(message))


# Around a placeholder, the characters a template's trim() drops (llama.cpp's trim: C's isspace).
_SPACE = " \t\n\v\f\r"
_MARK = "\ue000{nonce}{i}\ue001"  # private-use characters: in no template's markup
_MARKS = "\ue000{nonce}(\\d+)\ue001"


def segments(render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]]) -> Optional[list[Segment]]:
    """``messages`` rendered by ``render`` as segments of the template's markup (special tokens
    written in it become control tokens) and of the messages' text (they stay text), so a user's
    ``<|im_end|>`` cannot close their turn and open a system one.

    Each content is rendered as a placeholder (its leading and trailing whitespace kept around it,
    so a template that trims the content trims it alike), then the placeholders are replaced by
    the contents. None where the result is not the text ``render`` gives for the real messages (a
    template that transforms a content otherwise than trimming it). A content of whitespace only is
    left as it is (a template may test a content for being empty: an assistant's tool calls)."""
    nonce = secrets.token_hex(8)
    cores, shown = [], []
    for i, m in enumerate(messages):
        content = m["content"]
        core = content.strip(_SPACE)
        if not core:
            cores.append("")
            shown.append(m)
            continue
        lead = content[: len(content) - len(content.lstrip(_SPACE))]
        trail = content[len(lead) + len(core) :]
        cores.append(core)
        shown.append({**m, "content": lead + _MARK.format(nonce=nonce, i=i) + trail})
    text = render(shown)
    out: list[Segment] = []
    pos = 0
    for found in re.finditer(_MARKS.format(nonce=nonce), text):
        i = int(found.group(1))
        if i >= len(cores):
            return None
        out += [(text[pos : found.start()], True), (cores[i], False)]
        pos = found.end()
    out.append((text[pos:], True))
    if "".join(t for t, _ in out) != render(messages):
        return None
    return [(t, parse) for t, parse in out if t]
