"""Manifests and `prepare`: derive into the cache, idempotently and atomically."""

import json

import pytest

import mtad_edge.pairs as pairs
import mtad_edge.store as store
from mtad_edge.runtime.errors import MtadEdgeError


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_builtin_manifests_are_complete():
    assert {"smollm2-135m", "gemma3-270m"} <= set(pairs.builtin_names())
    for name in pairs.builtin_names():
        m = pairs.load_manifest(name)
        assert m.data["schema"] == 1 and m.context_size > 0
        assert m.data["source"]["package"] and m.data["chat_template"]["source"] in ("gguf", "builtin")
        for role in ("target", "aux"):
            assert m.data[role]["file"].endswith(".gguf") and len(m.data[role]["sha256"]) == 64


@pytest.mark.slow
def test_prepare_derives_the_manifest_files_then_is_idempotent(home):
    m = pairs.load_manifest("smollm2-135m")
    said = []
    p = pairs.prepare(m, said.append)
    assert p.target == home / "smollm2-135m" / m.data["target"]["file"]
    for role, path in (("target", p.target), ("aux", p.aux)):
        assert store.sha256_file(path) == m.data[role]["sha256"]  # deterministic derivation
    assert not any("warning" in s for s in said)
    mtimes = [p.target.stat().st_mtime_ns, p.aux.stat().st_mtime_ns]
    said.clear()
    again = pairs.prepare(m, said.append)
    assert again == p and said == []
    assert [p.target.stat().st_mtime_ns, p.aux.stat().st_mtime_ns] == mtimes
    assert not list(p.target.parent.glob(".*partial*"))


@pytest.mark.slow
def test_interrupted_prepare_leaves_no_loadable_half_file(home, monkeypatch):
    import llama_cpp

    def crash_midway(src, dst, params):
        with open(dst, "wb") as f:
            f.write(b"GGUF" + b"\0" * 1000)  # half a file under the temporary name
        raise KeyboardInterrupt

    monkeypatch.setattr(llama_cpp, "llama_model_quantize", crash_midway)
    m = pairs.load_manifest("smollm2-135m")
    with pytest.raises(KeyboardInterrupt):
        pairs.prepare(m)
    folder = home / "smollm2-135m"
    assert not (folder / m.data["target"]["file"]).exists()
    assert list(folder.iterdir()) == []  # temporary file removed too
    monkeypatch.undo()
    monkeypatch.setenv("MTAD_EDGE_HOME", str(home))
    p = pairs.prepare(m)
    assert store.sha256_file(p.target) == m.data["target"]["sha256"]


@pytest.mark.slow
def test_file_changed_after_prepare_is_derived_again(home):
    m = pairs.load_manifest("smollm2-135m")
    p = pairs.prepare(m)
    p.aux.write_bytes(b"GGUF broken")
    pairs.prepare(m)
    assert store.sha256_file(p.aux) == m.data["aux"]["sha256"]


def test_unknown_pair_and_bad_manifest(tmp_path):
    with pytest.raises(MtadEdgeError, match="unknown pair 'nope'"):
        pairs.load_manifest("nope")
    bad = tmp_path / "manifest.json"
    bad.write_text("{not json")
    with pytest.raises(MtadEdgeError, match="cannot read manifest"):
        pairs.load_manifest(tmp_path)
    bad.write_text(json.dumps({"schema": 1, "name": "x"}))
    with pytest.raises(MtadEdgeError, match="missing target, aux"):
        pairs.load_manifest(bad)


def test_local_manifest_files_live_beside_it(tmp_path):
    (tmp_path / "manifest.json").write_text(
        json.dumps(
            {
                "schema": 1,
                "name": "mine",
                "target": {"file": "t.gguf", "derive": {"ftype": "Q4_K_M"}},
                "aux": {"file": "a.gguf", "derive": None},
            }
        )
    )
    with pytest.raises(MtadEdgeError, match="missing model file"):
        pairs.prepare(pairs.load_manifest(tmp_path / "manifest.json"))
    for name in ("t.gguf", "a.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    p = pairs.prepare(pairs.load_manifest(tmp_path / "manifest.json"))  # checked, never re-derived
    assert (p.target, p.aux) == (tmp_path / "t.gguf", tmp_path / "a.gguf")


def test_home_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path))
    assert store.home() == tmp_path
    monkeypatch.delenv("MTAD_EDGE_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert store.home() == tmp_path / "xdg" / "mtad-edge"
