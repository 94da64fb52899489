"""Repacked CPU weights where AMX forces them off: the GGUF header read as untrusted input, the
tensors named from it, the child that tells whether the build's AMX kernels run, and the
default pair's aux loaded that way."""

from __future__ import annotations

import os
import re
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from mtad_edge.runtime.backends.gguf_header import MAX_KV, Header, HeaderError, Tensor, read_header
from mtad_edge.runtime.backends.repack import (
    CPU_BUFFER,
    REPACK_BUFFER,
    REPACK_KINDS,
    Overrides,
    amx_kinds,
    placements,
)

Q4_0, Q8_0, Q4_K, Q6_K, F16 = 2, 8, 12, 14, 1


def repack_patterns(header) -> list[str]:
    """The patterns named for CPU_REPACK where AMX's kernels do not run (every one is)."""
    named = placements(header, amx=False)
    assert all(buffer == REPACK_BUFFER for _, buffer in named)
    return [pattern for pattern, _ in named]


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def gguf(
    tensors: dict | list, arch: str = "llama", *, n_kv: int | None = None, extra_kv: bytes = b"", version: int = 3
):
    """A GGUF header as llama.cpp writes it: architecture, a string array, then the tensor table."""
    kv = _s("general.architecture") + struct.pack("<I", 8) + _s(arch)
    kv += _s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + b"".join(_s(t) for t in ("a", "bb", "<s>"))
    kv += _s("llama.block_count") + struct.pack("<II", 4, 2) + extra_kv
    count = 3 + (1 if extra_kv else 0) if n_kv is None else n_kv
    table = list(tensors.items()) if isinstance(tensors, dict) else list(tensors)  # a list may repeat a name
    out = b"GGUF" + struct.pack("<IQQ", version, len(table), count) + kv
    for name, (ggml_type, shape) in table:
        raw = name if isinstance(name, bytes) else name.encode()
        out += _s(raw) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", n) for n in shape)
        out += struct.pack("<IQ", ggml_type, 0)
    return out + b"\0" * 32  # (tensor data would follow)


def model(layers: int = 2, ggml_type: int = Q4_0, rows: int = 64) -> dict:
    t = {"token_embd.weight": (ggml_type, (64, 1000)), "output_norm.weight": (0, (64,))}
    for i in range(layers):
        t |= {f"blk.{i}.{kind}.weight": (ggml_type, (64, rows)) for kind in REPACK_KINDS}
        t[f"blk.{i}.attn_norm.weight"] = (0, (64,))
    return t


def header(tensors: dict, arch: str = "llama") -> Header:
    """A header as read_header() gives it, from (type, shape) by tensor name."""
    return Header(arch, {n: Tensor(t, s) for n, (t, s) in tensors.items()})


def test_a_gguf_header_is_read_as_llama_cpp_writes_it(tmp_path, smol_files):
    aux = read_header(smol_files.aux)
    assert aux.architecture == "llama" and len(aux.tensors) == 272
    assert aux.tensors["blk.0.attn_k.weight"] == Tensor(Q4_0, (576, 192))  # 3 KV heads of 64
    assert aux.tensors["token_embd.weight"].shape == (576, 49152)
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf(model()))
    made = read_header(path)
    assert made.tensors["blk.1.ffn_down.weight"] == Tensor(Q4_0, (64, 64))


def test_a_header_that_breaks_a_bound_or_ends_early_is_a_one_line_error_never_none(tmp_path):
    """It was None, and the layer check that read it was skipped: llama.cpp then aborted on the file."""
    path = tmp_path / "m.gguf"
    whole = gguf(model(layers=1))
    for n in range(len(whole) - 32):  # every truncation of the header
        path.write_bytes(whole[:n])
        with pytest.raises(HeaderError, match=f"^{re.escape(str(path))}: cannot read its GGUF header: ") as e:
            read_header(path)
        assert "\n" not in str(e.value), n
    bad = {
        "counts past every model's": (gguf(model(), n_kv=MAX_KV + 1), f"declares {MAX_KV + 1} metadata keys"),
        "a string longer than the file": (
            gguf(model(), extra_kv=_s("k") + struct.pack("<IQ", 8, 2**62)),
            "past the end",
        ),
        "a string array longer than the file": (
            gguf(model(), extra_kv=_s("k") + struct.pack("<IIQ", 9, 8, 2**40)),
            "claims 1099511627776 strings",
        ),
        "an array of arrays": (gguf(model(), extra_kv=_s("k") + struct.pack("<IIQ", 9, 9, 1)), "of type 9"),
        "an unknown value type": (gguf(model(), extra_kv=_s("k") + struct.pack("<I", 77)), "type 77"),
        "version 1": (gguf(model(), version=1), "GGUF version 1"),
        "a tensor name C reads shorter": (gguf({b"blk.0.attn_q.weight\0x": (Q6_K, (64, 12))}), "NUL byte"),
        "a tensor named twice": (gguf([("a", (Q4_0, (64, 64))), ("a", (Q4_0, (64, 64)))]), "named twice"),
        "a tensor name longer than llama.cpp takes": (
            gguf({"blk.0.attn_q.weight" + "x" * 60: (Q4_0, (64, 64))}),
            "79 bytes long (at most 63)",
        ),
        "a key longer than any": (
            gguf(model(), extra_kv=_s("k" * (1 << 17)) + struct.pack("<II", 4, 1)),
            "131072 bytes long (at most 65536)",
        ),
        "no magic": (b"GGUX" + gguf(model())[4:], "GGUF magic"),
    }
    for what, (data, why) in bad.items():
        path.write_bytes(data)
        t0 = time.perf_counter()
        with pytest.raises(HeaderError, match=re.escape(why)):
            read_header(path)
        assert time.perf_counter() - t0 < 1.0, what  # bounded by the file, not by what it claims
    with pytest.raises(HeaderError, match="No such file"):
        read_header(tmp_path / "missing.gguf")
    path.write_bytes(gguf(model(), arch="llama" * 200_000))  # a value is skipped, not copied, unless short
    long_arch = read_header(path)
    assert long_arch.architecture == "" and repack_patterns(long_arch) == []


def test_only_kinds_whose_every_tensor_llama_cpp_can_repack_are_named():
    every = [rf"^blk\.[0-9]+\.{kind}\.weight$" for kind in REPACK_KINDS]
    assert repack_patterns(header(model())) == every
    assert repack_patterns(header(model(ggml_type=Q4_K))) == every
    assert repack_patterns(header(model(), "gemma3")) == every
    assert repack_patterns(header(model(ggml_type=F16))) == []  # nothing to repack
    assert repack_patterns(header(model(rows=12))) == []  # rows not a multiple of 8: llama.cpp would abort
    assert repack_patterns(header(model(), "qwen2")) == []  # an architecture not checked
    assert repack_patterns(None) == []
    odd = model()
    odd["blk.1.attn_v.weight"] = (Q6_K, (64, 64))  # one layer's tensor of a type it does not repack
    odd["blk.0.ffn_up.weight"] = (Q4_0, (64, 64, 2))  # not a matrix
    named = repack_patterns(header(odd))
    assert named == [p for p in every if "attn_v" not in p and "ffn_up" not in p]
    assert "token_embd" not in "".join(named)  # the embedding is also read by row (get_rows)


def test_with_working_amx_llama_cpp_places_the_weights_but_float_matrices_stay_in_the_plain_buffer():
    every = [rf"^blk\.[0-9]+\.{kind}\.weight$" for kind in REPACK_KINDS]
    tied = model() | {"token_embd.weight": (Q4_0, (64, 1024))}  # the embedding is the output matrix too
    assert amx_kinds(header(tied)) == every + [r"^token_embd\.weight$"]
    assert amx_kinds(header(model())) == every  # a vocabulary of 1000: not a multiple of 32 rows
    assert amx_kinds(header(model(ggml_type=Q8_0))) == every  # Q8_0: AMX only, never repacked
    assert amx_kinds(header(model(rows=40))) == []  # rows not a multiple of 32
    assert amx_kinds(header(model(ggml_type=Q4_K))) == []  # a Q4_K row must hold 256 weights
    assert amx_kinds(header(model(ggml_type=F16))) == [] and amx_kinds(None) == []
    untied = model(ggml_type=Q8_0) | {"output.weight": (Q8_0, (64, 1024))}
    assert r"^output\.weight$" in amx_kinds(header(untied))
    # extra buffer types on: llama.cpp places quantized weights itself; F16 ones are kept out of AMX
    assert placements(header(tied), amx=True) == []
    f16 = model(ggml_type=F16) | {"output.weight": (F16, (64, 1024))}
    kept = every + [r"^output\.weight$", r"^token_embd\.weight$"]
    assert placements(header(f16), amx=True) == [(p, CPU_BUFFER) for p in kept]
    assert placements(header(tied), amx=False) == [(p, REPACK_BUFFER) for p in every]  # never an output matrix
    assert placements(header(model(), "qwen2"), amx=True) == [] and amx_kinds(header(model(), "qwen2")) == []


def test_the_amx_child_tries_a_kind_of_every_weight_type_amx_takes_but_never_the_embedding():
    from mtad_edge.runtime.backends.amx import probed_kinds

    kind = [rf"^blk\.[0-9]+\.{kind}\.weight$" for kind in REPACK_KINDS]
    tied = model() | {"token_embd.weight": (Q8_0, (64, 1024))}  # the default pair's aux: Q4_0, Q8_0 output
    assert probed_kinds(header(tied)) == kind[:1]  # a tied output's name is the input table's too
    untied = tied | {"output.weight": (Q8_0, (64, 1024))}
    assert probed_kinds(header(untied)) == [kind[0], r"^output\.weight$"]
    mixed = model(ggml_type=Q8_0) | {f"blk.{i}.ffn_up.weight": (Q4_0, (64, 64)) for i in range(2)}
    assert probed_kinds(header(mixed)) == [kind[0], kind[REPACK_KINDS.index("ffn_up")]]
    assert probed_kinds(header(model(ggml_type=F16))) == [] and probed_kinds(None) == []


def test_a_child_counts_only_what_it_proves_with_the_nonce_and_how_it_ended(tmp_path, monkeypatch):
    """runtime/backends/child.py: a child's word counts only with the parent's nonce before it (an exit 0
    alone proves nothing); its end by a signal, its timeout and a missing interpreter are told apart."""
    import subprocess
    import sys

    from mtad_edge.runtime.backends import child

    probe = tmp_path / "probe"  # a package the child loads from its folder, as it loads ours
    probe.mkdir()
    (probe / "__init__.py").write_text(
        "import os, signal, sys, time\n"
        "def main(argv, prove):\n"
        "    what = argv[0]\n"
        "    if what == 'prove': prove('ran')\n"
        "    if what == 'forge': print('0' * 32 + ' ran')\n"
        "    if what in ('SIGSEGV', 'SIGILL'): os.kill(os.getpid(), getattr(signal, what))\n"
        "    if what == 'sleep': time.sleep(30)\n"
        "    return 3 if what == 'fail' else 0\n"
    )
    boot = ["-I", "-c", child.BOOT, f"probe={probe}", "--", "probe"]
    monkeypatch.setattr(child, "command", lambda module, args, packages=(): [sys.executable, *boot, *args])
    assert child.run("probe", ["prove"], 60) == child.Outcome(0, ("ran",), b"")
    assert child.run("probe", ["forge"], 60).said == ()  # printed, but without the nonce
    assert child.run("probe", ["exit"], 60) == child.Outcome(0)  # a clean exit that proves nothing
    assert child.run("probe", ["SIGSEGV"], 60).rc == -11 and child.run("probe", ["SIGILL"], 60).rc == -4
    assert child.run("probe", ["fail"], 60).rc == 3
    assert child.run("probe", ["sleep"], 0.5).rc is None
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert child.run("probe", ["prove"], 60).rc is None
    monkeypatch.undo()
    if sys.platform == "linux":  # the child's expected crash leaves no core dump or crash report
        code = "import ctypes; from mtad_edge.runtime.backends import child; child.no_core_dump(); "
        code += "raise SystemExit(ctypes.CDLL(None).prctl(child.PR_GET_DUMPABLE, 0, 0, 0, 0))"
        assert subprocess.run([sys.executable, "-c", code]).returncode == 0  # not dumpable
        assert subprocess.run([sys.executable, "-c", code.replace("child.no_core_dump(); ", "")]).returncode == 1


class Crashes:
    """A VerdictStore in memory."""

    def __init__(self):
        self.kept: set[tuple[int, ...]] = set()

    def crashed(self, types):
        return types in self.kept

    def record_crash(self, types):
        self.kept.add(types)


def test_only_a_child_killed_by_a_signal_is_kept_and_a_kept_crash_asks_no_child(monkeypatch):
    import sys

    from mtad_edge.runtime.backends import amx
    from mtad_edge.runtime.backends.child import Outcome

    children: list[str] = []
    # SIGILL, clean, timed out, failed to load, SIGKILL (the OOM killer), SIGINT (Ctrl-C), SIGSEGV,
    # and an exit 0 that proved nothing (not this package's child)
    status = {"a": -4, "b": 0, "c": None, "d": 5, "e": -9, "f": -2, "g": -11, "h": 0}

    def child(module, args, timeout, packages=()):
        children.append(args[-1][-1])
        rc = status[args[-1][-1]]
        return Outcome(rc, ("ran",) if rc == 0 and args[-1][-1] != "h" else ())

    monkeypatch.setattr(amx.child, "run", child)
    monkeypatch.setattr(amx, "_VERDICTS", {})
    kept = Crashes()
    verdicts = [False, True, False, False, False, False, False, False]
    assert [amx._works((i,), name, kept) for i, name in enumerate("abcdefgh")] == verdicts
    assert kept.kept == {(0,), (6,)} and children == list("abcdefgh")  # never a clean run: a wrong "yes" crashes
    monkeypatch.setattr(amx, "_VERDICTS", {})  # a later process
    assert [amx._works((i,), name, kept) for i, name in enumerate("abcdefgh")] == verdicts
    assert children == list("abcdefgh") + list("bcdefh")  # the kept crashes were not asked again
    monkeypatch.setattr(amx, "_VERDICTS", {})
    assert amx._works((0,), "a", None) is False and children[-1] == "a"  # without a store, asked
    for frozen, executable in ((True, sys.executable), (False, "")):  # a frozen app, an embedding
        monkeypatch.setattr(amx, "_VERDICTS", {})
        monkeypatch.setattr(sys, "frozen", frozen, raising=False)
        monkeypatch.setattr(sys, "executable", executable)
        assert amx._works((1,), "b", None) is False and len(children) == 15  # no child started


def test_crashes_are_kept_in_the_cache_by_build_and_weight_types(monkeypatch, tmp_path):
    from mtad_edge import loader
    from mtad_edge.runtime.backends import amx

    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path))
    library = tmp_path / "libggml-cpu.so"
    library.write_bytes(b"build 1")
    build = {"libraries": [str(library)], "cpu": "model name : X", "kernel": "6.1", "features": "AMX_INT8 = 1"}
    monkeypatch.setattr(amx, "build_identity", lambda: build)
    loader.StoredAmxCrashes().record_crash((2, 8))
    later = loader.StoredAmxCrashes()
    assert later.crashed((2, 8)) and not later.crashed((2,)) and not later.crashed((8, 12))
    library.write_bytes(b"build 2, longer")  # the library rebuilt: another build, asked again
    assert not loader.StoredAmxCrashes().crashed((2, 8))
    library.write_bytes(b"build 1")
    os.utime(library, ns=(1, 1))  # same size, another mtime: another build
    assert not loader.StoredAmxCrashes().crashed((2, 8))
    for f in (tmp_path / "amx").iterdir():
        f.unlink()
    loader.StoredAmxCrashes().record_crash((2, 8))
    (record,) = (tmp_path / "amx").iterdir()
    record.write_text("{not json")  # damaged: asked again
    assert not loader.StoredAmxCrashes().crashed((2, 8))
    record.write_text('{"types": [2, 8], "crashed": false}')
    assert not loader.StoredAmxCrashes().crashed((2, 8))
    monkeypatch.setattr(amx, "build_identity", lambda: None)  # no /proc: nothing kept, nothing read
    record.unlink()
    loader.StoredAmxCrashes().record_crash((2, 8))
    assert not any((tmp_path / "amx").iterdir()) and not loader.StoredAmxCrashes().crashed((2, 8))


def test_the_build_identity_names_the_llama_cpp_libraries_this_process_mapped():
    import sys

    llama_cpp = pytest.importorskip("llama_cpp")
    from mtad_edge.runtime.backends.amx import build_identity

    identity = build_identity()
    if not sys.platform.startswith("linux"):
        assert identity is None
        return
    assert identity is not None
    names = [f.rsplit("/", 1)[-1] for f in identity["libraries"]]
    assert any(n.startswith("libllama") for n in names)  # ggml beside it where the build splits it out
    assert all(Path(f).is_file() for f in identity["libraries"])
    assert identity["features"] == llama_cpp.llama_print_system_info().decode(errors="replace")


def test_overrides_name_the_extra_buffers_of_the_ggml_llama_cpp_uses():
    llama_cpp = pytest.importorskip("llama_cpp")
    assert Overrides(llama_cpp, []).pointer is None
    q, o = r"^blk\.[0-9]+\.attn_q\.weight$", r"^output\.weight$"
    made = Overrides(llama_cpp, [(q, REPACK_BUFFER), (o, CPU_BUFFER), ("^x$", b"NO_SUCH_BUFFER")])
    if "AVX2 = 1" not in llama_cpp.llama_print_system_info().decode():
        assert made.pointer is None
    else:  # a buffer type this ggml lacks is left out
        assert made.pointer is not None and made.named == {REPACK_BUFFER: 1, CPU_BUFFER: 1}  # two named


@pytest.mark.slow
def test_on_amx_machines_the_q4_0_aux_runs_repacked_and_drafts_the_same_distribution(smol_files, monkeypatch):
    """Where AMX turns llama.cpp's extra buffer types off, the aux's projections are repacked by
    name, or sent to AMX where a child ran this build's AMX kernels; its logits stay those of the
    same weights (llama.cpp rounds activations a little differently there), and the F16 target
    has nothing to repack."""
    from mtad_edge.runtime.backend import Batch
    from mtad_edge.runtime.backends import amx as amx_probe
    from mtad_edge.runtime.backends import llama_cpp_backend as lb
    from mtad_edge.runtime.backends.gguf_header import read_header

    if not lb.uses_amx():
        pytest.skip("extra buffer types stay on without AMX: llama.cpp repacks by itself")
    config = lb.LlamaCppConfig(n_ctx=256, n_threads=2)
    tiles = amx_probe.amx_works(smol_files.aux, read_header(smol_files.aux))
    aux = lb.LlamaCppBackend(smol_files.aux, config)
    target = lb.LlamaCppBackend(smol_files.target, config)
    try:
        if tiles:  # this build's AMX kernels ran in the child: every matrix goes there, the output too
            assert aux.amx == len(REPACK_KINDS) + 1 and aux.repacked == 0
        else:
            assert aux.repacked == len(REPACK_KINDS) and aux.amx == 0
        assert target.repacked == target.amx == 0
        tokens = target.tokenize("The history of the Roman Empire begins with the founding of the city of Rome")
        repacked = aux.decode(Batch.run(tokens, 0, logits="all")).copy()  # a view of the context
    finally:
        aux.close()
        target.close()
    import llama_cpp

    with monkeypatch.context() as m:  # layers offloaded to a GPU keep their weights there: nothing is named
        m.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
        offloaded = lb.LlamaCppBackend(smol_files.aux, lb.LlamaCppConfig(n_ctx=256, n_threads=2, n_gpu_layers=-1))
        assert offloaded.repacked == offloaded.amx == 0
        offloaded.close()
    monkeypatch.setattr(lb, "placements", lambda header, amx: [])
    monkeypatch.setattr(lb, "amx_works", lambda path, header, store=None: False)
    plain = lb.LlamaCppBackend(smol_files.aux, config)
    try:
        assert plain.repacked == plain.amx == 0
        reference = plain.decode(Batch.run(tokens, 0, logits="all")).copy()
    finally:
        plain.close()
    from mtad_edge.runtime.rules.sampling import log_softmax

    p, q = log_softmax(reference), log_softmax(repacked)
    kl = float((np.exp(p) * (p - q)).sum(-1).mean())
    assert kl < 0.02, kl  # measured 0.004; the Q4_0 aux is 0.48 nats from its F16 target: this is rounding
    assert (reference.argmax(-1) == repacked.argmax(-1)).mean() > 0.85


def test_the_one_row_probe_asks_its_own_child_and_keeps_nothing(monkeypatch):
    """Where the tiles crash, a child asked for one row tells whether AMX's one-row kernel runs
    (LlamaCppConfig.one_row): a verdict of its own, never read from or written to the store,
    whose crashes are the tiles'."""
    from mtad_edge.runtime.backends import amx
    from mtad_edge.runtime.backends.child import Outcome

    asked: list[list[str]] = []

    def child(module, args, timeout, packages=()):
        asked.append([args[0], Path(args[1]).name])
        return Outcome(-4) if args[0] == str(amx.PROBE_ROWS) else Outcome(0, ("ran",))  # the tiles die, one row runs

    monkeypatch.setattr(amx.child, "run", child)
    monkeypatch.setattr(amx, "_VERDICTS", {})
    kept = Crashes()
    assert amx._works((2,), "m", kept) is False and kept.kept == {(2,)}
    assert amx._works((2,), "m", None, 1) is True
    assert amx._works((2,), "m", None, 1) is True  # one verdict per process
    assert asked == [[str(amx.PROBE_ROWS), "m"], ["1", "m"]]


def test_a_backend_called_one_row_at_a_time_gives_one_calls_logits(smol_files):
    """``one_row`` splits every call into calls of one row (AMX's one-row kernel where its tiles
    crash): a prompt with logits for every row, then beams on two sequences at one position, give
    the logits and the cache one call gives, on any machine (the split is forced here). The same up
    to llama.cpp's kernels: a batch and one row run different CPU kernels that round differently
    (on an AMD EPYC with AVX2, Q4_0's repacked batch kernel: logits up to 0.9 apart, probabilities
    up to 0.04), so the probabilities are compared, and the beams' top tokens."""
    from mtad_edge.runtime.backend import Batch
    from mtad_edge.runtime.backends import llama_cpp_backend as lb

    aux = lb.LlamaCppBackend(smol_files.aux, lb.LlamaCppConfig(n_ctx=256, n_seq_max=3, n_threads=2))
    try:
        tokens = aux.tokenize("The history of the Roman Empire begins with the founding of")
        n = len(tokens)
        seen = []
        for split in (False, True):
            aux.clear()
            aux.one_row = split
            prompt = aux.decode(Batch.run(tokens, 0, logits="all")).copy()
            for s in (1, 2):
                aux.copy_seq(0, s)
            beams = aux.decode(Batch().add(tokens[3], n, (1,), True).add(tokens[5], n, (2,), True)).copy()
            seen.append((prompt, beams, aux.held(1), aux.held(2)))
        (p0, b0, h10, h20), (p1, b1, h11, h21) = seen
        assert p0.shape == p1.shape == (n, aux.n_vocab) and b0.shape == b1.shape == (2, aux.n_vocab)
        assert np.abs(_probs(p0) - _probs(p1)).max() < 0.1 and np.abs(_probs(b0) - _probs(b1)).max() < 0.1
        assert (b1[0].argmax(), b1[1].argmax()) == (b0[0].argmax(), b0[1].argmax())
        assert h10 == h11 == [*tokens, tokens[3]] and h20 == h21 == [*tokens, tokens[5]]
    finally:
        aux.close()


@pytest.mark.slow
def test_on_amx_machines_an_aux_whose_tiles_crash_runs_amx_one_row_at_a_time(smol_files):
    """The default pair's Q4_0 aux loaded as the loader loads an aux: to AMX, one row a call,
    where the tiles crash and the one-row child ran; to AMX whole where the tiles run; logits of
    the same weights as the repacked load."""
    from mtad_edge.runtime.backend import Batch
    from mtad_edge.runtime.backends import amx as amx_probe
    from mtad_edge.runtime.backends import llama_cpp_backend as lb
    from mtad_edge.runtime.backends.gguf_header import read_header

    if not lb.uses_amx():
        pytest.skip("no AMX on this CPU")
    header = read_header(smol_files.aux)
    tiles = amx_probe.amx_works(smol_files.aux, header)
    one = amx_probe.amx_works(smol_files.aux, header, None, 1)
    got = []
    for one_row in (False, True):
        aux = lb.LlamaCppBackend(smol_files.aux, lb.LlamaCppConfig(n_ctx=256, n_threads=2, one_row=one_row))
        try:
            got.append((aux.one_row, aux.amx, aux.repacked))
            tokens = aux.tokenize("The history of the Roman Empire begins with the founding of the city")
            got[-1] += (aux.decode(Batch.run(tokens, 0, logits="all")).copy(),)
        finally:
            aux.close()
    (r_one, r_amx, r_rep, r_logits), (o_one, o_amx, o_rep, o_logits) = got
    assert not r_one and (r_amx > 0) == tiles and (r_rep > 0) == (not tiles)
    assert o_one == (one and not tiles) and (o_amx > 0) == (tiles or one) and (o_rep == 0) == (tiles or one)
    assert (o_logits.argmax(-1) == r_logits.argmax(-1)).mean() > 0.85


def _probs(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
