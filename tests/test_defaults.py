"""What a command does with no options: the model's recommended sampling (a pair's manifest, a
GGUF's general.sampling.*), a chat where the model has a template, a short --help. Fast, on fake
models; a real GGUF's metadata through llama.cpp: the slow test last."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import mtad_edge.engine as engine_module
from helpers import FakeLM
from mtad_edge.cli import cli
from mtad_edge.cli.options import ModelChoice
from mtad_edge.engine import Engine
from mtad_edge.loader import LoadedPair
from mtad_edge.pairs import Manifest, Pair, recommended_options
from mtad_edge.runtime.config import DecodeConfig
from mtad_edge.runtime.errors import ModelLoadError

SAMPLING = {"general.sampling.temp": "0.000000", "general.sampling.top_k": "-1", "general.sampling.top_p": "0.500000"}


class MetaLM(FakeLM):
    """A fake target whose GGUF metadata (as llama.cpp prints it) holds ``meta``."""

    def __init__(self, meta, **kw):
        super().__init__(vocab=40, salt=1, **kw)
        self.meta = dict(meta).get


def manifest(path, defaults) -> Manifest:
    return Manifest({"name": "crafted", "defaults": defaults}, path, builtin=False)


class NoTemplateLM(FakeLM):
    def apply_chat_template(self, messages, template=None, add_assistant=True) -> str:
        raise ModelLoadError("m.gguf has no chat template in its GGUF metadata")


@pytest.fixture
def loads(monkeypatch):
    """Commands resolve to ``pair`` and load a fake target over it (``lm``): set them with use()."""
    chosen = {}

    def use(pair, lm=None):
        chosen.update(pair=pair, lm=lm or FakeLM(vocab=40, salt=1))

    monkeypatch.setattr(ModelChoice, "resolve", lambda self: chosen["pair"])
    monkeypatch.setattr(
        engine_module, "open_pair", lambda pair, names, *a, **k: LoadedPair(chosen["lm"], None, pair, None, names)
    )
    return use


def run(*args):
    r = CliRunner().invoke(cli, ["generate", "--method", "ar", "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_a_ggufs_recommended_sampling_is_read_as_llama_cpp_reads_it(tmp_path):
    meta = {"general.sampling.temp": "0.600000", "general.sampling.top_k": "-1", "general.sampling.top_p": "0.95"}
    found = recommended_options(Pair(tmp_path / "m.gguf", None), meta.get)
    assert found["temperature"][0] == pytest.approx(0.6) and found["top_p"][0] == pytest.approx(0.95)
    assert found["top_k"] == (0, "m.gguf's general.sampling.top_k")  # llama.cpp's <= 0: every token, ours 0
    said: list[str] = []  # a value the table refuses is the file's problem: left out, with a note
    bad = {"general.sampling.temp": "7.000000", "general.sampling.top_k": "4.5", "general.sampling.top_p": "nan"}
    assert recommended_options(Pair(tmp_path / "b.gguf", None), bad.get, said.append) == {}
    assert said == [
        "note: b.gguf's general.sampling.temp is not used: temperature must be a number in [0, 2], got 7",
        "note: b.gguf's general.sampling.top_k is not used: not an integer: '4.5'",
        "note: b.gguf's general.sampling.top_p is not used: top_p must be a number in (0, 1], got nan",
    ]


def test_the_manifest_wins_over_the_gguf_and_an_option_given_over_both(tmp_path, loads):
    gguf = tmp_path / "m.gguf"
    pair = Pair(gguf, None, manifest(tmp_path / "manifest.json", {"temperature": 2.0, "max_tokens": 7}))
    loads(pair, MetaLM(SAMPLING))
    engine = Engine.open(pair, defaults=DecodeConfig("ar"), given={"top_p"})  # what engine.open does for every command
    assert engine.recommended == {
        "max_tokens": (7, "the pair's manifest"),
        "temperature": (2.0, "the pair's manifest"),
        "top_k": (0, "m.gguf's general.sampling.top_k"),
    }
    s = engine.defaults.sampling
    assert (s.temperature, s.top_k, s.top_p, engine.defaults.max_tokens) == (2.0, 0, 0.9, 7)
    assert Engine.open(pair, defaults=DecodeConfig("ar")).recommended == {}  # given=None: the defaults as they are
    # Through the command line: the model's defaults give what the same options given give...
    default = run("--seed", "1", "hi")
    same = run("--seed", "1", "--temperature", "2", "--top-k", "0", "--top-p", "0.5", "--max-tokens", "7", "hi")
    assert default["tokens"] == same["tokens"] and len(default["tokens"]) == 7
    # ... and an option given wins: greedy here equals greedy from the table's defaults
    loads(Pair(gguf, None), MetaLM(SAMPLING))
    greedy = run("--seed", "1", "--max-tokens", "7", "hi")  # the GGUF's temperature 0
    assert run("--seed", "1", "--temperature", "0", "--max-tokens", "7", "hi")["tokens"] == greedy["tokens"]
    assert greedy["tokens"] != default["tokens"]


def test_generate_chats_by_default_and_raw_continues_the_text(tmp_path, loads):
    loads(Pair(tmp_path / "none.gguf", None))
    chat = run("--seed", "1", "--max-tokens", "2", "hi")
    assert chat["stats"]["prompt_tokens"] == len("<user>hi<assistant>")  # the fake model's chat template
    assert run("--seed", "1", "--max-tokens", "2", "--chat", "hi")["tokens"] == chat["tokens"]  # --chat: kept
    assert run("--seed", "1", "--max-tokens", "2", "--raw", "hi")["stats"]["prompt_tokens"] == len("hi")
    system = run("--seed", "1", "--max-tokens", "2", "--system", "be", "hi")
    assert system["stats"]["prompt_tokens"] == len("<system>be<user>hi<assistant>")
    for bad, words in ((["--raw", "--chat"], "give --raw or --chat, not both"), (["--raw", "--system", "x"], "--raw")):
        r = CliRunner().invoke(cli, ["generate", *bad, "hi"])
        assert r.exit_code == 2 and words in r.output, r.output
    loads(Pair(tmp_path / "none.gguf", None), NoTemplateLM(vocab=40, salt=1))  # a base model: plain text, said so
    r = CliRunner().invoke(cli, ["generate", "--method", "ar", "--json", "--max-tokens", "2", "hi"])
    assert r.exit_code == 0 and json.loads(r.stdout)["stats"]["prompt_tokens"] == len("hi")
    assert "note: the model has no chat template: continuing PROMPT as plain text" in r.stderr
    r = CliRunner().invoke(cli, ["generate", "--method", "ar", "--chat", "hi"])  # asked for: the template's error
    assert r.exit_code == 1 and "has no chat template" in r.stderr and "Traceback" not in r.output


def test_generate_help_is_short_and_help_all_shows_every_option():
    short = CliRunner().invoke(cli, ["generate", "--help"], terminal_width=80).output
    full = CliRunner().invoke(cli, ["generate", "--help-all"], terminal_width=80).output
    assert len(short.splitlines()) <= 60 and "et al" not in short and "ICLR" not in short
    for everyday in ("--temperature", "--max-tokens", "--raw", "--json", "--pair", "Default: the model's, else 1.0"):
        assert everyday in short
    for expert in ("--gamma ", "--drafter", "--rpc", "--flash-attn", "--vocab-mismatch"):
        assert expert not in short and expert in full
    assert CliRunner().invoke(cli, ["generate", "--gamma", "2", "--help"]).exit_code == 0  # hidden, still taken


@pytest.mark.slow
def test_a_real_ggufs_general_sampling_keys_set_the_defaults(smol_files, tmp_path):
    from helpers import GGUF_STRING, gguf_kv, rewrite_gguf

    f32 = 6
    extra = [gguf_kv("general.sampling.temp", f32, 0.25), gguf_kv("general.sampling.top_k", 5, 20)]
    extra.append(gguf_kv("general.sampling.top_p", GGUF_STRING, "high"))  # not a number: left out
    model = rewrite_gguf(smol_files.aux, tmp_path / "m.gguf", extra=extra)
    said: list[str] = []
    with Engine.load(target=str(model), method="ar", n_ctx=256, top_k=30, say=said.append) as engine:
        assert engine.recommended == {"temperature": (0.25, "m.gguf's general.sampling.temp")}
        s = engine.defaults.sampling
        assert (s.temperature, s.top_k, s.top_p) == (0.25, 30, 0.9)  # top_k given: it wins
    assert said == ["note: m.gguf's general.sampling.top_p is not used: not a number: 'high'"]
