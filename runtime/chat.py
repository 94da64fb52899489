"""Chat templates for backends without llama.cpp's template engine (ONNX Runtime).

A template is jinja text, as Hugging Face tokenizers carry it, or the name of one of llama.cpp's
built-in formats that manifests use (``"chat_template": {"source": "builtin", "name": "gemma"}``),
written here in jinja so both backends render the same prompt text.
"""

from __future__ import annotations

from .errors import ModelLoadError

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


def render(template: str, messages: list[dict[str, str]], add_assistant: bool = True, **special: str) -> str:
    """Render ``messages`` with jinja ``template`` text or a BUILTIN name; ``special`` gives
    bos_token/eos_token for templates that print them."""
    import jinja2

    if template in BUILTIN:
        template = BUILTIN[template]
    elif "{{" not in template and "{%" not in template:
        raise ModelLoadError(f"unknown built-in chat template {template!r} (known here: {', '.join(BUILTIN)})")
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_assistant, **special)
    except jinja2.TemplateError as e:
        raise ModelLoadError(f"chat template failed: {e}") from None
