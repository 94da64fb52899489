"""Issue 27: what a model file, a manifest, a hub reference or a request carries is untrusted input.
A model folder never runs code, one input never takes the process down, an error quotes a bad value
in a few words. (The server's limits, against a real `mtad-edge serve`: test_server_limits.py.)"""

from __future__ import annotations

import pytest

from mtad_edge.runtime.errors import ModelLoadError


# -- 1. chat templates render in jinja2's sandbox ------------------------------------------------
@pytest.mark.parametrize(
    "attack",
    [
        "{{ cycler.__init__.__globals__.os.popen('touch MARK').read() }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ joiner.__init__.__globals__['os'].system('touch MARK') }}",
        "{% set x = messages.append({'role': 'x'}) %}",  # the immutable sandbox: no mutation either
    ],
)
def test_a_chat_template_that_reaches_for_python_internals_is_refused(attack, tmp_path, monkeypatch):
    from mtad_edge.runtime.chat import render

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="chat template refused") as e:
        render(attack, [{"role": "user", "content": "hi"}])
    assert "\n" not in str(e.value) and not (tmp_path / "MARK").exists()


def test_a_chat_template_that_asks_for_gigabytes_is_refused():
    from mtad_edge.runtime.chat import render

    for bomb in ("{{ 'x' * 10000000000 }}", "{{ [0] * 10000000000 }}", "{{ 10 ** 100000000 }}"):
        with pytest.raises(ModelLoadError, match="refused"):
            render(bomb, [{"role": "user", "content": "hi"}])


def test_real_templates_still_render_in_the_sandbox():
    from mtad_edge.runtime.chat import render

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render("gemma", msgs) == "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    hf_style = (  # the constructs Hugging Face templates use: namespace, loop, tojson, raise-free filters
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ m.role | upper }}:{{ m.content | trim }}{% if not loop.last %}|{% endif %}{% endfor %}"
        "{{ ns.n }}{{ messages | length }}{{ {'a': 1} | tojson }}"
    )
    assert render(hf_style, msgs) == 'SYSTEM:Be brief.|USER:Hi22{"a": 1}'
