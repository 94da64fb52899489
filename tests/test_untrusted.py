"""Issue 27: what a model file, a manifest, a hub reference or a request carries is untrusted input.
A model folder never runs code, one input never takes the process down, an error quotes a bad value
in a few words. (The server's limits, against a real `mtad-edge serve`: test_server_limits.py.)"""

from __future__ import annotations

import re

import pytest

from helpers import EXE, fake_engine
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
    from mtad_edge.runtime.text.chat import render

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="chat template refused") as e:
        render(attack, [{"role": "user", "content": "hi"}])
    assert "\n" not in str(e.value) and not (tmp_path / "MARK").exists()


def test_a_chat_template_that_asks_for_gigabytes_is_refused():
    from mtad_edge.runtime.text.chat import render

    # Sizes that a machine survives without the bound (100 MB, 80 MB), so the test is safe anywhere.
    for bomb in ("{{ 'x' * 100000000 }}", "{{ [0] * 10000000 }}", "{{ 10 ** 100000 }}"):
        with pytest.raises(ModelLoadError, match="refused"):
            render(bomb, [{"role": "user", "content": "hi"}])


def test_real_templates_still_render_in_the_sandbox():
    from mtad_edge.runtime.text.chat import render

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render("gemma", msgs) == "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    hf_style = (  # the constructs Hugging Face templates use: namespace, loop, tojson, raise-free filters
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ m.role | upper }}:{{ m.content | trim }}{% if not loop.last %}|{% endif %}{% endfor %}"
        "{{ ns.n }}{{ messages | length }}{{ {'a': 1} | tojson }}"
    )
    assert render(hf_style, msgs) == 'SYSTEM:Be brief.|USER:Hi22{"a": 1}'


# -- 3. stop strings: linear matching, bounded size -----------------------------------------------
def reference_stop_text(stops, pieces):
    """The old StopText, the behaviour to keep (quadratic in a stop string's length)."""
    stops, buf, outs = [s for s in stops if s], "", []
    for piece in pieces:
        buf += piece
        hits = [i for i in (buf.find(s) for s in stops) if i >= 0]
        if hits:
            outs.append((buf[: min(hits)], True))
            return outs, ""
        hold = max((k for s in stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        outs.append((buf[: len(buf) - hold], False))
        buf = buf[len(buf) - hold :]
    return outs, buf


def test_stop_text_matches_as_before_on_random_text():
    import random

    from mtad_edge.textstream import StopText

    rng = random.Random(0)
    for _ in range(3000):
        word = lambda n: "".join(rng.choice("ab") for _ in range(n))  # noqa: E731
        stops = [word(rng.randint(0, 5)) for _ in range(rng.randint(0, 4))]
        pieces = [word(rng.randint(0, 4)) for _ in range(rng.randint(1, 8))]
        s = StopText(stops)
        outs = []
        for p in pieces:
            outs.append(s.push(p))
            if outs[-1][1]:
                break
        assert (outs, s.flush()) == reference_stop_text(stops, pieces), (stops, pieces)


def test_long_stop_strings_cost_linear_time():
    """Four 30000-character stop strings that the text keeps almost matching: the old matcher sliced every
    prefix of each at every push (5 s here, 43 s for 16 tokens at 250 kB); now each character is
    read once (0.03 s)."""
    import time

    from mtad_edge.textstream import StopText

    stops = ["a" * 29999 + c for c in "bcde"]
    s, start = StopText(stops), time.perf_counter()
    emitted = "".join(s.push("a" * 400)[0] for _ in range(100))
    assert time.perf_counter() - start < 1.0
    assert emitted == "a" * (100 * 400 - 29999)  # the tail that may still become a stop string is held


def test_stop_strings_are_bounded_in_number_and_size_with_a_short_error():
    from mtad_edge.runtime.errors import OptionError
    from mtad_edge.runtime.options import STOP_CHARS_MAX, check

    assert check("stop", ["x" * STOP_CHARS_MAX]) == ["x" * STOP_CHARS_MAX]
    for bad in (["a" * 250_000] * 4, ["x" * (STOP_CHARS_MAX + 1)], ["a"] * 5, "z" * 450_000):
        with pytest.raises(OptionError) as e:
            check("stop", bad)
        message = str(e.value)
        assert e.value.param == "stop" and len(message) < 300 and "\n" not in message, message
        assert f"{STOP_CHARS_MAX} characters in all" in message
    with pytest.raises(OptionError, match=r"\(4 items, 1000000 characters of text\)"):
        check("stop", ["a" * 250_000] * 4)


# -- 10. an error quotes a bad value in a few words, with its length -----------------------------
def test_errors_quote_a_long_bad_value_as_a_prefix_and_its_length():
    from mtad_edge import hub, pairs
    from mtad_edge.runtime.errors import MtadEdgeError, quoted
    from mtad_edge.server import protocol as P

    big = "x" * 450_000
    assert quoted(big) == "'" + "x" * 60 + "... (450000 characters)"
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    assert len(quoted(nested)) < 100  # no RecursionError, no megabytes
    errors = []
    for body in ({"prompt": "hi", big: 1}, {"prompt": "hi", "model": big}, {"prompt": "hi", "stream": big}):
        with pytest.raises(P.BadRequest) as e:
            P.parse(body, "text", "m")
        errors.append(e.value)
        assert len(e.value.param or "") < 100
    for call in (lambda: hub.parse("hf:" + big), lambda: pairs.load_manifest(big)):
        with pytest.raises(MtadEdgeError) as e:
            call()
        errors.append(e.value)
    for e in errors:
        assert len(str(e)) < 300 and re.search(r"45000\d characters", str(e)), str(e)[:400]


def test_a_field_name_or_model_with_a_lone_surrogate_or_a_newline_is_a_4xx_not_a_500():
    """JSON's "\\ud800" is a lone surrogate: echoed as it was into the error, the reply could not be
    encoded as UTF-8 and the server answered 500 (a newline made a two-line message)."""
    from helpers import Served
    from mtad_edge.runtime.errors import quoted

    assert quoted("a\nb", bare=True) == "a\\nb" and quoted("caf\u00e9 x", bare=True) == "caf\u00e9 x"
    served = Served(fake_engine(), strict_model=True)  # a model name is echoed in its 404
    try:
        for raw, status, shown in (
            (b'{"prompt": "hi", "\\ud800x": 1}', 400, "\\ud800x"),
            (b'{"prompt": "hi", "model": "\\ud800"}', 404, "\\ud800"),
            (b'{"prompt": "hi", "a\\nb": 1}', 400, "a\\nb"),
        ):
            got, body = served.post(raw)
            message = body["error"]["message"]
            assert got == status and shown in message and "\n" not in message, (got, body)
    finally:
        served.close()


# -- 8. a manifest is checked whole when it is loaded: one line naming the bad field ----------------
GOOD = {
    "schema": 1,
    "name": "mine",
    "context_size": 512,
    "target": {"file": "t.gguf", "sha256": "a" * 64},
    "aux": {"file": "sub/a.gguf", "derive": None},
}


@pytest.mark.parametrize(
    "change,field",
    [
        (None, "missing schema, name, target, aux"),  # the manifest is JSON null
        ({"target": 3}, "target must be an object"),
        ({"aux": "a.gguf"}, "aux must be an object"),
        ({"context_size": "2048"}, "context_size must be an integer"),
        ({"context_size": -1}, "context_size must be an integer"),
        ({"context_size": 1e20}, "context_size must be an integer"),
        ({"context_size": 10**20}, "context_size must be an integer in 1..2147483647"),
        ({"context_size": True}, "context_size must be an integer"),
        ({"aux_gpu_layers": "0"}, "aux_gpu_layers must be an integer in -1..2147483647, got '0'"),
        ({"aux_gpu_layers": -2}, "aux_gpu_layers must be an integer in -1..2147483647, got -2"),
        ({"aux_gpu_layers": 0.5}, "aux_gpu_layers must be an integer"),
        ({"aux_gpu_layers": False}, "aux_gpu_layers must be an integer"),
        ({"aux_gpu_layers": 2**31}, "aux_gpu_layers must be an integer"),
        ({"aux_gpu_layers": [0]}, "aux_gpu_layers must be an integer"),
        ({"name": 7}, "name must be"),
        ({"name": "../x"}, "name must be"),
        ({"target": {"file": 3}}, "target.file must be a non-empty string"),
        ({"target": {"file": "../../etc/x.gguf"}}, "target.file must be a path inside"),
        ({"aux": {"file": "/etc/x.gguf"}}, "aux.file must be a path inside"),
        ({"target": {"file": "t.gguf", "sha256": "abc"}}, "target.sha256 must be 64 lowercase hex"),
        ({"target": {"file": "t.gguf", "derive": "Q4_0"}}, "target.derive must be an object"),
        ({"chat_template": "gemma"}, "chat_template must be an object"),
        ({"chat_template": {"source": "jinja"}}, "chat_template.source must be"),
        ({"chat_template": {"source": "builtin"}}, "chat_template.name must be"),
        ({"source": {"kind": "ftp"}}, "source.kind must be"),
        ({"aux": {"hub": {"repo": "a/b", "file": "../../x.gguf"}}}, "aux.hub: hub reference refused"),
        ({"aux": {"hub": "hf:a/b/../../../../x.gguf"}}, "aux.hub: hub reference refused"),
        ({"aux": {"hub": {"repo": "a/b", "file": 5}}}, "file must be a string"),
        ({"name": "a\nb"}, "name must be a printable name"),
        ({"name": "\ud800"}, "name must be a printable name"),  # the server's model id: every reply was a 500
        ({"target": {"file": "x" * 300 + ".gguf"}}, "target.file must be a file name the OS takes"),  # was an OSError
        ({"aux": {"file": "a\0.gguf"}}, "aux.file must be a file name the OS takes"),
        ({"schema": True}, "not a schema-1"),  # true == 1 in Python: it passed as schema 1
        ({"schema": 1.0}, "not a schema-1"),
        ({"defaults": [0.7]}, "defaults must be an object"),
        ({"defaults": {"temperature": 9}}, "defaults.temperature must be a number in [0, 2], got 9"),
        ({"defaults": {"top_k": 1.5}}, "defaults.top_k must be an integer >= 0"),
        ({"defaults": {"top_p": 0}}, "defaults.top_p must be a number in (0, 1]"),
        ({"defaults": {"max_tokens": "lots"}}, "defaults.max_tokens must be an integer >= 1, got 'lots'"),
        ({"defaults": {"temperature": float("nan")}}, "defaults.temperature must be a number"),
        (
            {"defaults": {"method": "ar"}},
            "defaults has an unknown option 'method' (a pair may set max_tokens, temperature",
        ),
    ],
)
def test_a_malformed_manifest_is_one_line_naming_the_field(tmp_path, change, field):
    import json

    from mtad_edge import pairs
    from mtad_edge.runtime.errors import MtadEdgeError

    data = None if change is None else {**GOOD, **change}
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(MtadEdgeError) as e:
        pairs.load_manifest(tmp_path)
    assert field in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_manifest_with_a_number_past_pythons_digit_limit_is_one_line_of_ours(tmp_path):
    """json.loads refuses a 5000-digit integer with a message telling a programmer to call
    sys.set_int_max_str_digits; the user gets what is wrong with the file."""
    from mtad_edge import pairs
    from mtad_edge.runtime.errors import MtadEdgeError

    (tmp_path / "manifest.json").write_text('{"schema": 1, "context_size": ' + "9" * 5000 + "}")
    with pytest.raises(MtadEdgeError) as e:
        pairs.load_manifest(tmp_path)
    assert "a number over 4300 digits long" in str(e.value) and "sys." not in str(e.value), str(e.value)


def test_a_model_path_too_long_for_the_os_is_a_missing_file_not_a_traceback(tmp_path):
    """Short parts, but over PATH_MAX in all: is_file raised ENAMETOOLONG out of prepare."""
    import json

    from mtad_edge import pairs

    deep = "d/" * 2100 + "t.gguf"
    (tmp_path / "manifest.json").write_text(json.dumps({**GOOD, "target": {"file": deep}}))
    with pytest.raises(pairs.MtadEdgeError, match="missing model file") as e:
        pairs.prepare(pairs.load_manifest(tmp_path))
    assert "\n" not in str(e.value)


def test_a_good_manifest_and_the_packaged_ones_pass_the_schema(tmp_path):
    import json

    from mtad_edge import pairs

    (tmp_path / "manifest.json").write_text(json.dumps(GOOD))
    assert pairs.load_manifest(tmp_path).context_size == 512 and pairs.load_manifest(tmp_path).aux_gpu_layers is None
    for layers in (-1, 0, 12):
        (tmp_path / "manifest.json").write_text(json.dumps({**GOOD, "aux_gpu_layers": layers}))
        assert pairs.load_manifest(tmp_path).aux_gpu_layers == layers
    for name in pairs.builtin_names() + pairs.hub_pair_names():
        pairs.load_manifest(name)
    for junk in (b"\xff\xfe binary", b"[" * 100_000, b"{}" + b" " * (pairs.MANIFEST_MAX + 1)):
        (tmp_path / "manifest.json").write_bytes(junk)
        with pytest.raises(pairs.MtadEdgeError):
            pairs.load_manifest(tmp_path)


def test_a_bad_aux_gpu_layers_is_one_line_from_the_command_and_the_api(tmp_path):
    """The manifest's value is checked before any model loads; the option's as the API is called."""
    import json

    from click.testing import CliRunner

    from mtad_edge.cli import cli
    from mtad_edge.engine import Engine
    from mtad_edge.runtime.errors import MtadEdgeError

    (tmp_path / "manifest.json").write_text(json.dumps({**GOOD, "aux_gpu_layers": "all"}))
    r = CliRunner().invoke(cli, ["generate", "hi", "--manifest", str(tmp_path / "manifest.json")])
    assert r.exit_code == 1 and r.output.count("\n") == 1, r.output
    assert (
        r.output.startswith("Error: ") and "aux_gpu_layers must be an integer in -1..2147483647, got 'all'" in r.output
    )
    for bad in ("0", -2, True, 2**40):
        with pytest.raises(
            MtadEdgeError, match=r"^aux_gpu_layers must be an integer in -1\.\.2147483647 \(-1: all\), got"
        ):
            Engine.load(pair=str(tmp_path), aux_gpu_layers=bad)


def test_a_thread_count_llama_cpp_cannot_hold_is_one_line_from_the_command_and_the_api(smol_files):
    """llama.cpp keeps per-thread state in arrays of 512: `--threads 100000` crashed the process
    (SIGSEGV) as the model loaded."""
    import subprocess

    from mtad_edge.engine import Engine
    from mtad_edge.runtime.errors import MtadEdgeError

    r = subprocess.run([EXE, "generate", "hi", "--threads", "100000"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == "Error: Invalid value for '--threads': 100000 is not in the range 1<=x<=512."
    for bad in (0, -1, 513, "2", 2.0, True):
        with pytest.raises(MtadEdgeError, match=r"^threads must be an integer in 1\.\.512, got"):
            Engine.load(pair="smollm2-135m", threads=bad)


# -- 9. a hub reference never names a file outside the hub cache --------------------------------
@pytest.mark.parametrize(
    "ref",
    [
        "hf:a/b/../../../../x.gguf",
        "hf:a/b/dir/../../x.gguf",
        "hf:../b/x.gguf",
        "hf:a/..@main/x.gguf",
        "hf:a/b@../x.gguf",
        "hf:a/b@..:Q4_K_M",
        "hf:a/b//etc/x.gguf",
        "hf:a/b/./x.gguf",
        "hf:a/b/dir\\..\\x.gguf",
        "hf:a/b/x.gguf\n",  # $ matched before the newline: read as x.gguf
        "hf:a/b:Q4_K_M\n",
    ],
)
def test_a_hub_reference_with_dot_dot_or_an_absolute_part_is_refused(ref):
    from mtad_edge import hub
    from mtad_edge.runtime.errors import MtadEdgeError

    with pytest.raises(MtadEdgeError, match="refused|is not a hub reference"):
        hub.parse(ref)


def test_a_hub_entry_with_dot_dot_is_refused_and_plain_ones_still_parse():
    from mtad_edge import hub
    from mtad_edge.runtime.errors import MtadEdgeError

    for spec in (
        {"repo": "a/b", "file": "../x.gguf"},
        {"repo": "a/b", "file": "/etc/x.gguf"},
        {"repo": "a/b", "file": "x.gguf", "revision": ".."},
        {"repo": "a/b/c", "file": "x.gguf"},
    ):
        with pytest.raises(MtadEdgeError, match="refused"):
            hub.from_spec(spec)
    assert hub.parse("hf:a/b/dir/x-Q4_K_M.gguf").file == "dir/x-Q4_K_M.gguf"
    assert hub.parse("hf:a/b@v1.0:q8_0").quant == "Q8_0"
    assert hub.from_spec({"repo": "a/b", "file": "d/x.gguf", "revision": "refs/pr/1"}).revision == "refs/pr/1"


def test_a_dot_dot_reference_never_loads_the_local_file_it_points_at(tmp_path, monkeypatch):
    """The probe: hf:a/b/../../../../x.gguf resolved outside the hub cache and loaded an unhashed file."""
    from mtad_edge import hub
    from mtad_edge.runtime.errors import MtadEdgeError

    cache = tmp_path / "hub"
    snapshot = cache / "models--a--b" / "snapshots" / "main"
    snapshot.mkdir(parents=True)
    (tmp_path / "x.gguf").write_bytes(b"GGUF planted")  # what ../../../../x.gguf reaches from the snapshot
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MtadEdgeError):
        hub.fetch("hf:a/b/../../../../x.gguf")


# -- 2. the context is bounded by the model's trained context and by memory ------------------------
@pytest.mark.slow
@pytest.mark.parametrize("n_ctx", [2**32, 8193])
def test_a_context_longer_than_the_model_was_trained_for_is_refused(smol_files, n_ctx):
    """--ctx-size 4294967296 wrapped at 2^32 and ran with a context of 198; 1e20 allocated until the
    kernel killed the process. (SmolLM2-135M was trained for 8192.)"""
    from mtad_edge.loader import ModelOptions, open_pair
    from mtad_edge.pairs import Pair

    with pytest.raises(ModelLoadError, match=r"longer than smollm2-135m-instruct-F16.gguf was trained for \(8192\)"):
        open_pair(Pair(smol_files.target, None), ["ar"], 1, 1, ModelOptions(n_ctx=n_ctx, threads=2)).close()
    with open_pair(Pair(smol_files.target, None), ["ar"], 1, 1, ModelOptions(n_ctx=8192, threads=2)) as models:
        assert models.target.n_ctx >= 8192


@pytest.mark.slow
def test_a_context_the_memory_cannot_hold_is_refused(smol_files, monkeypatch):
    from mtad_edge.loader import ModelOptions, open_pair
    from mtad_edge.pairs import Pair
    from mtad_edge.runtime.backends import llama_cpp_backend

    monkeypatch.setattr(llama_cpp_backend, "_physical_memory", lambda: 64 << 20)  # a 64 MiB machine
    with pytest.raises(ModelLoadError, match=r"needs about .* GiB of KV cache.*about \d+ fits"):
        open_pair(Pair(smol_files.target, None), ["ar"], 1, 1, ModelOptions(n_ctx=8192, n_gpu_layers=0)).close()


# -- 7. `models prepare` says "sha256 verified" only when it checked; a file that is not a model is
# one line where it is first read --------------------------------------------------------------------
def local_pair(folder, target_sha=None, aux_sha=None, target=b"GGUF target", aux=b"GGUF aux"):
    import json

    (folder / "t.gguf").write_bytes(target)
    (folder / "a.gguf").write_bytes(aux)
    roles = {"target": {"file": "t.gguf"}, "aux": {"file": "a.gguf"}}
    for role, sha in (("target", target_sha), ("aux", aux_sha)):
        if sha:
            roles[role]["sha256"] = sha
    (folder / "manifest.json").write_text(json.dumps({"schema": 1, "name": "mine", **roles}))
    return folder / "manifest.json"


def test_models_prepare_says_verified_only_for_what_it_checked(tmp_path):
    import hashlib

    from click.testing import CliRunner

    from mtad_edge.cli import cli

    right = hashlib.sha256(b"GGUF target").hexdigest()
    wrong = "1" * 64
    r = CliRunner().invoke(cli, ["models", "prepare", str(local_pair(tmp_path, right, wrong))])
    assert r.exit_code == 1 and "sha256" in r.output and "a.gguf" in r.output and "verified" not in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    r = CliRunner().invoke(cli, ["models", "prepare", str(local_pair(tmp_path, right, None))])
    assert r.exit_code == 0 and "sha256 verified" not in r.output
    assert "not verified: a.gguf (the manifest pins no sha256)" in r.output
    aux = hashlib.sha256(b"GGUF aux").hexdigest()
    r = CliRunner().invoke(cli, ["models", "prepare", str(local_pair(tmp_path, right, aux))])
    assert r.exit_code == 0 and "ready (sha256 verified)" in r.output


@pytest.mark.slow
def test_a_gguf_whose_weights_are_random_bytes_is_a_one_line_load_error(smol_files, tmp_path):
    """The probe's aux: a real GGUF header with random bytes for weights. It loads in llama.cpp, then
    gave NaN logits (a numpy traceback in the drafter, or a segfault in the next decode)."""
    import os
    import subprocess

    data = bytearray(smol_files.aux.read_bytes())
    data[4_000_000:] = os.urandom(len(data) - 4_000_000)  # past the header and vocabulary: tensor data
    manifest = local_pair(tmp_path, target=smol_files.target.read_bytes(), aux=bytes(data))
    r = subprocess.run(
        [EXE, "generate", "--pair", str(manifest), "--max-tokens", "4", "--threads", "2", "--ctx-size", "256", "Hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert r.stderr.strip().splitlines() == [
        f"Error: {tmp_path / 'a.gguf'} is not a usable model: "
        + ("its weights give non-finite logits (corrupt or not model data); prepare or download it again")
    ]


@pytest.mark.slow  # copies SmolLM2's aux (92 MB); before the fix llama.cpp loaded it
@pytest.mark.parametrize("layers", [0, 513])
def test_a_gguf_with_a_layer_count_llama_cpp_aborts_on_is_a_one_line_error(smol_files, tmp_path, layers):
    """block_count 0 or over 512: llama.cpp's GGML_ASSERT aborted the process (SIGABRT, a gdb backtrace)."""
    import shutil
    import subprocess

    from gguf import GGUFReader

    from mtad_edge.runtime.backends.gguf_header import read_block_count

    model = tmp_path / "m.gguf"
    shutil.copyfile(smol_files.aux, model)
    field = GGUFReader(model, "r+").fields["llama.block_count"]
    field.parts[field.data[0]][0] = layers  # in place, through the reader's writable memory map
    del field
    assert read_block_count(model) == layers and read_block_count(smol_files.aux) == 30
    args = ["generate", "--target", str(model), "--method", "ar", "--max-tokens", "2", "--ctx-size", "64", "Hi"]
    r = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"Error: {model} is not a usable model: it declares {layers} layers (block_count; 1..512)"
    ], (r.returncode, r.stderr[-1000:])


# -- 12. a model file llama.cpp aborts on loads in a child first: the child dies, not us -------------
def _generate_with(model, *extra):
    import subprocess

    args = ["generate", "--target", str(model), "--method", "ar", "--max-tokens", "2", "--ctx-size", "64", "Hi"]
    return subprocess.run([EXE, *args, *extra], capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # writes SmolLM2 GGUFs (92 MB each)
@pytest.mark.parametrize(
    "ints, assertion",
    [
        ({"llama.expert_used_count": 5, "llama.expert_count": 0}, "GGML_ASSERT(n_expert_used_max <= hparams.n_expert)"),
        ({"llama.expert_used_count": 0, "llama.expert_count": 4}, "GGML_ASSERT(n_expert_used_max > 0)"),
        ({"llama.expert_count": 100_000}, "GGML_ASSERT(hparams.n_expert <= LLAMA_MAX_EXPERTS)"),
    ],
)
def test_a_gguf_whose_hyperparameters_llama_cpp_asserts_on_is_one_line_never_an_abort(
    smol_files, tmp_path, ints, assertion
):
    """expert_used_count 5 with expert_count 0 aborted the process (SIGABRT, exit 134, a gdb
    backtrace). No check of ours names these keys: the child that loads a new file first does."""
    from helpers import rewrite_gguf

    model = rewrite_gguf(smol_files.aux, tmp_path / "m.gguf", ints)
    r = _generate_with(model)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"Error: llama.cpp aborted while loading {model}: llama-model.cpp:"), line
    assert line.endswith(f"{assertion} failed"), line


@pytest.mark.slow
@pytest.mark.parametrize("where", ["first", "many"])
def test_a_header_past_the_readers_bounds_is_one_line_never_a_skipped_check(smol_files, tmp_path, where):
    """block_count 0 behind a key over 64 KiB (or 65,600 keys): the header reader gave up and
    returned None, the layer check was skipped and llama.cpp aborted (GGML_ASSERT(n_layer_all > 0))."""
    from helpers import GGUF_STRING, GGUF_U32, gguf_kv, rewrite_gguf

    if where == "first":
        first, why = [gguf_kv("x" * 70_000, GGUF_STRING, "y")], "is 70000 bytes long (at most 65536)"
    else:
        first, why = [gguf_kv(f"k{i}", GGUF_U32, i) for i in range(65_600)], "metadata keys (at most 65536)"
    model = rewrite_gguf(smol_files.aux, tmp_path / "m.gguf", {"llama.block_count": 0}, first=first)
    r = _generate_with(model)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"Error: {model}: cannot read its GGUF header: ") and why in line, line


def test_the_guard_loads_a_file_once_per_identity_and_build(tmp_path, monkeypatch):
    """A child runs for a file this build has not loaded; a clean load is kept, so the next load
    runs none; a rewritten file (new size or time) is another file."""
    import os

    from mtad_edge.loader import StoredModelFacts
    from mtad_edge.runtime.backends import guard
    from mtad_edge.runtime.backends.child import Outcome

    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("mtad_edge.loader._llama_build", lambda: ["a build"])
    children = []
    monkeypatch.setattr(guard, "_run_child", lambda kind, path: children.append(path) or Outcome(0, ("loaded",)))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    for _ in range(3):
        guard.check_loads("gguf", model, StoredModelFacts())
    assert children == [model]
    os.utime(model, ns=(1, 1))
    guard.check_loads("gguf", model, StoredModelFacts())
    assert children == [model, model]
    monkeypatch.setattr("mtad_edge.loader._llama_build", lambda: ["another build"])
    guard.check_loads("gguf", model, StoredModelFacts())
    assert len(children) == 3


def test_a_child_that_fails_cleanly_or_runs_out_of_time_proves_nothing_and_keeps_nothing(tmp_path, monkeypatch):
    """llama.cpp's own refusal is reported by the load that follows (its words, not ours); a
    child past its time (a slow disk) lets the load go on as before the guard; an exit 0 that did
    not prove the load with the nonce (code not ours ran, issue 67) keeps nothing either."""
    from mtad_edge.loader import StoredModelFacts
    from mtad_edge.runtime.backends import guard
    from mtad_edge.runtime.backends.child import Outcome

    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("mtad_edge.loader._llama_build", lambda: ["a build"])
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    for outcome in [Outcome(3, (), b"llama_model_load: error loading model"), Outcome(None), Outcome(0)]:
        monkeypatch.setattr(guard, "_run_child", lambda kind, path, outcome=outcome: outcome)
        guard.check_loads("gguf", model, StoredModelFacts())  # no error: the load goes on
        assert StoredModelFacts().get("gguf", model, "loaded") is None


def test_a_child_killed_by_a_signal_is_named_with_its_last_words(tmp_path, monkeypatch):
    from mtad_edge.runtime.backends import guard
    from mtad_edge.runtime.backends.child import Outcome

    model = tmp_path / "m.onnx"
    err = b"noise\n/src/onnxruntime/core/graph.cc:88: something broke\nmore\n"
    monkeypatch.setattr(guard, "_run_child", lambda kind, path: Outcome(-11, (), err))
    with pytest.raises(ModelLoadError) as e:
        guard.check_loads("onnx", model, None)
    assert str(e.value) == f"onnxruntime crashed (SIGSEGV) while loading {model}: graph.cc:88: something broke"


# -- 13. every OS error is one line and loses nothing ------------------------------------------------
def _in_a_small_mount(tmp_path, script: str, options: str = "size=4k"):
    """``script`` (sh) in a private mount namespace where MNT is a tmpfs mounted with ``options``
    (root only: unshare -m)."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "tmpfs", str(mnt)], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount in a private namespace here: {probe.stderr.decode(errors='replace').strip()}")
    wrapped = f"mount -t tmpfs -o {options} tmpfs {mnt} && MNT={mnt} && {script}"
    return subprocess.run(["unshare", "-m", "sh", "-c", wrapped], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_bench_on_a_full_disk_prints_its_report_keeps_its_results_and_says_enospc(smol_files, tmp_path):
    """It was a traceback (OSError: [Errno 28]) that left .results.json.partial: the report was
    never printed and the whole run was lost."""
    import json

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n')
    args = f"--methods ar --max-tokens 4 --threads 2 --prompts {prompts} --out $MNT/out"
    r = _in_a_small_mount(tmp_path, f"{EXE} bench {args}")
    assert r.returncode == 1, r.stderr[-2000:]
    assert "| ar |" in r.stdout and "Traceback" not in r.stderr  # the report reached the screen
    [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert "no space left on the device (ENOSPC)" in line and line.endswith(".json"), line
    with open(line.rsplit(" ", 1)[1]) as f:
        kept = json.load(f)
    assert kept["methods"]["ar"]["runs"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("how", [["generate"], ["generate", "--json"], ["chat"]])
def test_a_full_standard_output_is_one_line(smol_files, how):
    """generate (text or --json) and chat with stdout to /dev/full: a traceback (OSError: [Errno 28])."""
    import subprocess

    args = [EXE, *how, "--method", "ar", "--max-tokens", "4", "--ctx-size", "64", "--threads", "2"]
    args += ["Hi"] if how[0] == "generate" else []
    with open("/dev/full", "w") as full:
        r = subprocess.run(args, input="Hi\n", stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error") or "Traceback" in ln or "Exception" in ln]
    assert r.returncode == 1 and errors == [
        "Error: cannot write to standard output: no space left on the device (ENOSPC): free some space and run "
        "the command again"
    ], r.stderr[-2000:]


@pytest.mark.slow
def test_export_into_a_read_only_folder_is_one_line(smol_files, tmp_path):
    """export widen --out an existing folder on a read-only filesystem: a traceback (OSError: [Errno 30])."""
    r = _in_a_small_mount(
        tmp_path, f"{EXE} export widen --target {smol_files.target} --aux {smol_files.aux} --factor 2 --out $MNT", "ro"
    )
    assert r.returncode == 1, r.stderr[-2000:]
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"Error: cannot write into the output folder {tmp_path / 'mnt'}: "), line
    assert "Read-only file system" in line


# -- 11. a full disk and a killed derivation leave nothing that makes the next run fail ------------
def test_a_full_disk_while_stamping_removes_the_unstamped_file_and_names_enospc(tmp_path, monkeypatch):
    """An unstamped file used to stay behind: it was derived again at every run and its bytes kept
    the disk full, so every retry failed with 'failed (code 1)'."""
    import errno
    from pathlib import Path

    import mtad_edge.store as store
    from mtad_edge import pairs

    tmp, dest = tmp_path / ".m.gguf.partial-1", tmp_path / "m.gguf"
    tmp.write_bytes(b"GGUF" + b"\0" * 1000)
    real = Path.write_text

    def full_disk(self, *a, **kw):
        if "stamps" in self.parts:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *a, **kw)

    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(pairs.MtadEdgeError, match=r"cannot stamp m.gguf .*\(ENOSPC\).*removed it"):
        store.finish(tmp, dest)
    assert not tmp.exists() and not dest.exists()


def test_a_failed_quantization_on_a_full_disk_names_enospc(tmp_path, monkeypatch):
    import shutil
    from types import SimpleNamespace

    import llama_cpp

    from mtad_edge import pairs

    src = tmp_path / "src.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 100_000)
    monkeypatch.setattr(llama_cpp, "llama_model_quantize", lambda *a: 1)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(total=10**9, used=10**9 - 1000, free=1000))
    with pytest.raises(pairs.MtadEdgeError, match=r"failed \(code 1\) \(the disk is likely full, ENOSPC"):
        pairs.quantize(src, tmp_path / "out.gguf", "F16")


def test_partial_files_of_dead_derivations_are_swept(tmp_path):
    """kill -9 during a derivation left its .partial-PID file for ever."""
    import os
    import subprocess
    import sys

    from mtad_edge import pairs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    files = {
        "dead": tmp_path / f".m-F16.gguf.partial-{dead_pid}",
        "ours": tmp_path / f".m-Q4_0.gguf.partial-{os.getpid()}",
        "alive": tmp_path / f".m-Q8_0.gguf.partial-{os.getppid()}",
        "other": tmp_path / "m.gguf",
    }
    for f in files.values():
        f.write_bytes(b"x")
    pairs._writable(tmp_path)
    assert {k for k, f in files.items() if f.exists()} == {"ours", "alive", "other"}


# -- 11. closing an engine ends its responses; a response left by a dead thread never blocks it ------
def test_break_out_of_a_response_inside_with_engine_closes_cleanly():
    """__exit__ used to raise 'another response ... in this thread' and the models stayed loaded."""
    engine = fake_engine()
    with engine:
        response = engine.generate("abc", max_tokens=50)
        for _ in response:
            break
    assert engine._models is None and response.finish_reason == "cancelled"
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate("abc")


def test_a_response_half_iterated_by_a_thread_that_ended_does_not_block_the_engine():
    """A dead thread's response used to hold the engine for ever; a new thread that got the dead
    one's ident was told 'another response ... is being iterated in this thread'."""
    import threading

    engine = fake_engine()
    left = []

    def half():
        response = engine.generate("abc", max_tokens=50)
        next(iter(response))
        left.append(response)  # still referenced, never finished

    t = threading.Thread(target=half)
    t.start()
    t.join()
    result: dict = {}

    def again():
        try:
            result["text"] = engine.generate("abc", max_tokens=5, seed=1).text()
        except Exception as e:  # the false 'this thread' error
            result["error"] = e

    for _ in range(2):  # fresh threads: the first often gets the dead one's ident
        result.clear()
        t = threading.Thread(target=again, daemon=True)
        t.start()
        t.join(20)
        assert len(result.get("text", "")) == 5, result
    assert left[0].finish_reason == "cancelled"
    engine.close()


# -- cache records: a damaged one is derived again -----------------------------------------------
@pytest.mark.parametrize(
    "record",
    [
        '{"target": {"1": 1' + "0" * 400 + "}}",  # past a float: an OverflowError traceback
        '{"target": {"1": NaN, "2": NaN}}',  # these seeded the controller's plans
        '{"target": {"1": -1.0, "2": -2.0}, "aux": {"1": -1.0}}',
        '{"target": {"1": 0.0}}',
        '{"target": {"1": Infinity}}',
        '{"target": {"1": true}}',
        '{"target": {"' + "1" * 5000 + '": 0.1}}',  # a row past int()'s digit limit
        '{"target": {"7": 0.1}}',  # a row it did not time
        '{"target": [], "aux": null}',
        '{"other": {}}',
        "[]",
        '{"target": {"1": 1',
    ],
)
def test_a_damaged_calibration_record_is_timed_again(record, tmp_path, monkeypatch):
    from types import SimpleNamespace

    import mtad_edge.calibrate as calibrate
    import mtad_edge.store as store
    from mtad_edge.loader import ModelOptions

    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path))
    fresh = {"target": {1: 0.01, 2: 0.02, 3: 0.03}, "aux": {1: 0.005}}
    monkeypatch.setattr(calibrate, "measure", lambda models, t, a: calibrate.Timings(fresh))
    pair = SimpleNamespace(target=tmp_path / "t.gguf", aux=tmp_path / "a.gguf")
    models = SimpleNamespace(target=SimpleNamespace(), aux=SimpleNamespace(n_seq_max=3), pair=pair, rpc=None)
    calibrate.calibrated_model(models, ModelOptions(), 2, 1, False)
    (file,) = tmp_path.glob("calibration/*.json")
    file.write_text(record)
    model = calibrate.calibrated_model(models, ModelOptions(), 2, 1, False)
    assert model.target.seed == fresh["target"] and model.aux.seed == fresh["aux"]
    assert calibrate.stored_tables(store.read_json(file), {"target": [1, 2, 3], "aux": [1]}) == fresh


def test_a_cache_record_nested_too_deeply_is_missing_not_a_recursion_error(tmp_path, monkeypatch):
    """Every record goes through store.read_json: a stamp, read at each start, was a traceback."""
    import mtad_edge.store as store

    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    store.stamp(model)
    (record,) = tmp_path.glob("stamps/*.json")
    record.write_text("[" * 200_000 + "]" * 200_000)
    assert store.read_json(record) is None and store.stamped(model) is None


# -- export: a Hugging Face folder's config.json, checked before the converters run -------------
@pytest.mark.parametrize(
    "config,needle",
    [
        ('{"num_hidden_layers": 1' + "0" * 30 + "}", r"num_hidden_layers must be an integer in 1\.\.512"),  # OOM kill
        ('{"num_hidden_layers": 1000000}', "num_hidden_layers"),  # hours of the converter
        ('{"text_config": {"num_hidden_layers": 0}}', "num_hidden_layers .* got 0"),
        ('{"n_layer": "2"}', "n_layer .* got '2'"),
        ('{"vocab_size": 10000000000}', r"vocab_size must be an integer in 1\.\.2097152"),  # MemoryError
        ('{"vocab_size": 0}', "vocab_size"),  # the converter's bare AssertionError
        ('{"vocab_size": true}', "vocab_size"),
        ('{"vocab_size": 1' + "0" * 5000 + "}", "not valid JSON .*over 4300 digits"),
        ("[" * 100_000 + "]" * 100_000, r"not valid JSON \(nested too deeply\)"),
        ("[1, 2]", "not a JSON object"),
        (b'{"model_type": "\xff"}', "not valid JSON .*utf-8"),
    ],
)
def test_an_hf_folder_whose_config_sizes_are_absurd_is_one_line_before_converting(tmp_path, config, needle):
    from mtad_edge.export.staging import check_hf_dir
    from mtad_edge.runtime.errors import MtadEdgeError

    (tmp_path / "config.json").write_bytes(config if isinstance(config, bytes) else config.encode())
    with pytest.raises(MtadEdgeError, match=needle) as e:
        check_hf_dir(tmp_path, "target")
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--target {tmp_path / 'config.json'}: ")
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 30, "vocab_size": 262144, "n_layer": null}')
    check_hf_dir(tmp_path, "target")


def test_a_converter_the_os_killed_is_named_as_killed_not_by_its_last_progress_line(tmp_path, monkeypatch):
    """Out of memory, the converter's last stderr line was progress ("INFO:gguf.gguf_writer: ... Little
    Endian only"), which the error quoted as the cause."""
    import subprocess

    import mtad_edge.export.gguf as gguf
    from mtad_edge.runtime.errors import MtadEdgeError

    def killed(cmd, **kw):
        progress = "INFO:gguf.gguf_writer:gguf: This GGUF file is for Little Endian only\n"
        return subprocess.CompletedProcess(cmd, -9, "", progress)

    monkeypatch.setattr(gguf.subprocess, "run", killed)
    with pytest.raises(MtadEdgeError, match=r"killed by SIGKILL while converting .* \(out of memory\?\)$"):
        gguf.convert(tmp_path, tmp_path / "out.gguf", "f16")


@pytest.mark.parametrize(
    "ref,what",
    [
        ("hf:" + "a" * 100_000 + "/b", "repository"),  # its error message was 100 kB long
        ("hf:a/" + "b" * 97 + ":Q4_K_M", "repository"),
        ("hf:a/b/" + "x" * 300 + ".gguf", "file"),
        ("hf:a/b@" + "v" * 300 + "/x.gguf", "revision"),
    ],
)
def test_a_hub_reference_with_a_name_no_file_can_have_is_a_short_error(ref, what):
    from mtad_edge import hub
    from mtad_edge.runtime.errors import MtadEdgeError

    with pytest.raises(MtadEdgeError, match=f"hub reference refused: its {what} .* has a part over") as e:
        hub.parse(ref)
    assert len(str(e.value)) < 200
    assert hub.parse("hf:" + "a" * 96 + "/b/" + "x" * 250 + ".gguf").repo == "a" * 96 + "/b"


@pytest.mark.parametrize("content", [b"\xff\xfe", b"../../../../elsewhere", b"main", b""])
def test_a_damaged_ref_in_the_hub_cache_is_a_file_not_cached(tmp_path, monkeypatch, content):
    """huggingface_hub's refs/REVISION holds a commit: one that is not text was a UnicodeDecodeError
    traceback (`models list`, every run of the pair); '../..' named a folder outside the cache."""
    from mtad_edge import hub
    from mtad_edge.runtime.errors import MtadEdgeError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hub" / "models--a--b"
    commit = "0123456789abcdef0123456789abcdef01234567"
    for snapshot in (repo / "snapshots" / commit, tmp_path / "elsewhere"):
        snapshot.mkdir(parents=True)
        (snapshot / "m-Q8_0.gguf").write_bytes(b"GGUF")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_bytes(content)
    assert hub.cached("hf:a/b:Q8_0") is None
    with pytest.raises(MtadEdgeError, match="offline .* not in the cache"):
        hub.fetch("hf:a/b:Q8_0")
    (repo / "refs" / "main").write_text(commit)
    assert hub.cached("hf:a/b:Q8_0") == repo / "snapshots" / commit / "m-Q8_0.gguf"


def test_another_librarys_message_is_quoted_as_one_line():
    """Messages of onnxruntime, optimum, transformers and the hub client run to several lines, or
    to none (an empty message was an IndexError where the first line was taken)."""
    from mtad_edge.runtime.errors import first_line

    assert first_line(ValueError("\n  bad config  \nsee the docs\n")) == "bad config"
    assert first_line(RuntimeError("")) == first_line(RuntimeError(" \n ")) == "RuntimeError"
