"""Whether this llama.cpp build's AMX matrix kernels run here, asked of a child process.

Builds of llama.cpp whose compiler drops the stores of its AMX tile configuration (GCC 12, as
pip builds llama-cpp-python on Debian 12) load the configuration empty and die on the first
tile instruction (SIGILL or SIGSEGV, llama.cpp #20824 / #26954), but only for calls of more than
one row: one-row calls take a VNNI path that works. A crash cannot be caught in-process, so a
child loads a matrix kind of each weight type the model holds into the AMX buffer and decodes
``PROBE_ROWS`` tokens in one call; the model loads there only if that child exits cleanly. One
verdict per process and set of weight types; a caller may keep the crashes across processes
(``VerdictStore``, keyed by ``build_identity()``), never a clean run: a "yes" kept wrongly would
crash every later run, a "no" costs only speed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Protocol

from .gguf_header import Header, read_header
from .repack import AMX_BUFFER, TIED_OUTPUT, Overrides, amx_kinds, amx_matrices, exact

PROBE_ROWS = 4  # more than one: one row takes AMX's VNNI path, which works even where tiles crash
PROBE_TIMEOUT_S = 120.0  # the child loads one matrix kind and decodes once: a second or two
PROBE_CTX = 64  # the child's context, in tokens
PROBE_MODULE = "mtad_edge.runtime.backends.amx"
PR_SET_DUMPABLE, PR_GET_DUMPABLE = 4, 3  # prctl options (linux/prctl.h)
LIBRARY_PREFIXES = ("libllama", "libggml")  # the shared libraries whose build decides the verdict
PROC_MAPS = Path("/proc/self/maps")  # where Linux lists a process's mapped files
PROC_CPUINFO = Path("/proc/cpuinfo")
# What a tile instruction raises under an empty configuration: the build's answer, kept. Other
# ends (a timeout, SIGKILL from the OOM killer, SIGINT from Ctrl-C) may not recur: asked again.
CRASH_SIGNALS = (signal.SIGILL, signal.SIGSEGV)


class VerdictStore(Protocol):
    """Crashes kept across processes, by the set of weight types (a cache of the caller's)."""

    def crashed(self, types: tuple[int, ...]) -> bool: ...

    def record_crash(self, types: tuple[int, ...]) -> None: ...


def amx_works(
    path: str | os.PathLike[str], header: Optional[Header], store: Optional[VerdictStore] = None, rows: int = PROBE_ROWS
) -> bool:
    """Whether the model at ``path`` holds weights AMX multiplies and a child decoded ``rows``
    tokens with them in one call (``store``: tile crashes of earlier processes, which are not asked
    again; ``rows`` 1 asks for the one-row kernel alone, where the tiles crash)."""
    if not amx_kinds(header):
        return False
    assert header is not None  # amx_kinds() names nothing without one
    types = tuple(sorted({t.type for t in header.tensors.values()}))
    return _works(types, str(path), store if rows == PROBE_ROWS else None, rows)


_VERDICTS: dict[tuple[tuple[int, ...], int], bool] = {}  # by the set of weight types a model holds, and rows


def _works(types: tuple[int, ...], path: str, store: Optional[VerdictStore], rows: int = PROBE_ROWS) -> bool:
    """One verdict per set of weight types and rows (``path``: the first model with it)."""
    key = (types, rows)
    if key not in _VERDICTS:
        if not can_spawn_python() or (store is not None and store.crashed(types)):
            _VERDICTS[key] = False
        else:
            rc = exit_status([sys.executable, "-m", PROBE_MODULE, str(rows), path], PROBE_TIMEOUT_S)
            _VERDICTS[key] = rc == 0
            if rc is not None and -rc in CRASH_SIGNALS and store is not None:
                store.record_crash(types)
    return _VERDICTS[key]


def can_spawn_python() -> bool:
    """Whether ``sys.executable -m`` starts a Python child: not in a frozen app (PyInstaller and
    the like), where it would start the app itself, nor in an embedding that names no interpreter."""
    return bool(sys.executable) and not getattr(sys, "frozen", False)


def exit_status(cmd: Sequence[str], timeout: float) -> Optional[int]:
    """``cmd``'s exit status (negative: the signal that killed it), or None where it did not
    finish within ``timeout`` seconds or could not start."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (subprocess.TimeoutExpired, OSError):
        return None
    return proc.returncode


def mapped_libraries(prefixes: tuple[str, ...] = LIBRARY_PREFIXES) -> list[str]:
    """The files of llama.cpp's shared libraries this process mapped (llama_cpp is imported first:
    it maps them), sorted; empty where the platform does not list them (no /proc)."""
    import llama_cpp  # noqa: F401

    try:
        maps = PROC_MAPS.read_text()
    except OSError:
        return []
    mapped = {fields[5] for fields in (ln.split(None, 5) for ln in maps.splitlines()) if len(fields) == 6}
    return sorted(f for f in mapped if Path(f).name.startswith(prefixes))


def build_identity() -> Optional[dict[str, Any]]:
    """What a kept verdict depends on beside the weight types: the llama.cpp libraries this
    process mapped (``libraries``: their paths, for the caller to identify as it does model
    files), the CPU, the kernel and the build's feature line. None where the libraries cannot be
    listed (no /proc): nothing is then kept."""
    import llama_cpp

    libraries = mapped_libraries()
    try:
        cpu = next((ln for ln in PROC_CPUINFO.read_text().splitlines() if ln.startswith("model name")), "")
    except OSError:
        return None
    if not libraries:
        return None
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return {"libraries": libraries, "cpu": cpu, "kernel": os.uname().release, "features": info}


def probed_kinds(header: Optional[Header]) -> list[str]:
    """The kinds the child sends to AMX: the first of each weight type among those AMX takes,
    less the embedding (named for a tied output, its copy and the input table share the name,
    and the table is read by row)."""
    kinds: list[str] = []
    types: set[int] = set()
    for pattern, found in amx_matrices(header):
        kind = {t.type for t in found}
        if pattern != exact(TIED_OUTPUT) and not kind <= types:
            kinds.append(pattern)
            types |= kind
    return kinds


def no_core_dump() -> None:
    """Where the build's AMX crashes, the child's crash is its answer: no core file or crash
    report (apport, systemd-coredump) for it."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def _child(path: str, rows: int = PROBE_ROWS) -> int:
    """Load the kinds probed_kinds() names into AMX's buffer and decode ``rows`` tokens in one
    call (0: it ran). llama.cpp's log goes to stderr, which the parent keeps to itself."""
    import ctypes

    no_core_dump()
    import llama_cpp

    overrides = Overrides(llama_cpp, [(p, AMX_BUFFER) for p in probed_kinds(read_header(Path(path)))])
    if overrides.pointer is None:
        return 2
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = False
    mparams.tensor_buft_overrides = overrides.pointer
    model = llama_cpp.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        return 3
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = PROBE_CTX
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        return 4
    rows = max(1, min(rows, PROBE_CTX))
    tokens = (llama_cpp.llama_token * rows)(*range(1, rows + 1))
    first = ctypes.cast(tokens, ctypes.POINTER(llama_cpp.llama_token))
    rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(first, rows))
    return 0 if rc == 0 else 5


if __name__ == "__main__":
    # argv: [ROWS] PATH
    sys.exit(_child(sys.argv[-1], int(sys.argv[1]) if len(sys.argv) > 2 and sys.argv[1].isdigit() else PROBE_ROWS))
