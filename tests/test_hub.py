"""hf: references and known hub pairs, against a loopback hub (tests/fakehub.py) with the real huggingface_hub
client: downloads, resumes, sha256 checks, offline use of the cache, and the one-line errors."""
import hashlib
import os

import pytest
from fakehub import FakeHub, closed_port_url

from mtad_edge import hub
from mtad_edge.runtime.errors import MtadEdgeError

MB = 1 << 20


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
    names = ["README.md", "m-IQ4_XS.gguf", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q8_0.gguf", "mmproj-m-Q4_K_M.gguf",
             "big/m-Q6_K-00002-of-00002.gguf", "big/m-Q6_K-00001-of-00002.gguf", "m-f16.gguf"]
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
    with pytest.raises(MtadEdgeError, match="no .gguf file for Q8_0"):  # offline: only what is cached
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


def test_transfer_that_keeps_breaking_is_one_line_error_and_next_run_resumes(fakehub):
    data = blob(BIG)
    fakehub.add("org/m", {"m.gguf": data})
    fakehub.cut("org/m", "m.gguf", CUT, *[0] * 50)  # one transfer gets somewhere, then none does
    with pytest.raises(MtadEdgeError, match=r"^hf:org/m/m.gguf: download interrupted .*run the command again"):
        hub.fetch("hf:org/m/m.gguf")
    kept = max(resumed_from(r) for _, r in fakehub.gets())
    fakehub.cuts.clear()
    n = len(fakehub.gets())
    assert hub.fetch("hf:org/m/m.gguf").read_bytes() == data
    assert resumed_from(fakehub.gets()[n][1]) >= kept > 0  # the next run went on from what the last one kept


def test_download_whose_sha256_differs_from_the_hubs_lfs_hash_is_refused_and_removed(fakehub):
    fakehub.add("org/m", {"m.gguf": blob(MB)}, etags={"m.gguf": "0" * 64})  # the hub advertises another hash
    with pytest.raises(MtadEdgeError, match=r"sha256 of the download is \w{12}\.\.\., not the hub's LFS hash "
                                            r"000000000000\.\.\.; removed it from the cache"):
        hub.fetch("hf:org/m/m.gguf")
    assert hub.cached("hf:org/m/m.gguf") is None
    assert not list((hub.cache_dir() / "models--org--m" / "blobs").iterdir())


def test_file_that_differs_from_the_manifest_pin_is_not_downloaded(fakehub):
    fakehub.add("org/m", {"m.gguf": blob(MB)})
    ref = hub.HubRef("org/m", "m.gguf", sha256="1" * 64)
    with pytest.raises(MtadEdgeError, match=r"the hub's file \(sha256 \w{12}\.\.\.\) is not the one the manifest "
                                            r"names \(111111111111\.\.\.\); not downloaded"):
        hub.fetch(ref)
    assert fakehub.gets() == []
    pinned = hub.HubRef("org/m", "m.gguf", sha256=hashlib.sha256(blob(MB)).hexdigest())
    path = hub.fetch(pinned)
    n = len(fakehub.log)
    assert hub.fetch(pinned) == path and len(fakehub.log) == n  # pinned and checked: the hub is not asked again

