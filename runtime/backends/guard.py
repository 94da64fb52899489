"""A model file this build has not loaded before loads first in a child process, so that where
llama.cpp (or ONNX Runtime) aborts on it the child dies, not us.

llama.cpp checks a GGUF's hyperparameters with GGML_ASSERT, which aborts the whole process:
block_count 0, expert_used_count over expert_count and some forty more in llama-model.cpp alone,
more in the vocabulary and graph code. A list of checks of our own is always one assert behind,
so the class is closed here instead: a child loads the model the way we would, on the CPU, and
decodes one token (graph-building asserts fire there). Where the child dies by a signal, the load
is a one-line ``ModelLoadError`` quoting llama.cpp's last words (``GGML_ASSERT(...) failed``);
where it ran, the caller keeps that (``ModelFacts``, by the file's identity and the build), so a
second load of a known file costs one small read. A child that fails cleanly, or runs past its
time, proves nothing: the model then loads here as it did before the guard (llama.cpp's own
error, or a slow disk), and nothing is kept.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Protocol

from ..errors import ModelLoadError
from .amx import can_spawn_python, no_core_dump

CHILD_MODULE = "mtad_edge.runtime.backends.guard"
LOADED = "loaded"  # the fact kept for a file a child loaded cleanly
CHILD_CTX = 64  # the child's context, in cells: one token is decoded
# A child reads the whole file once (the one-token decode touches every weight): a minute, plus
# what a slow disk (50 MB/s) needs for the file. Past it the child is killed and the load goes on here.
BASE_TIMEOUT_S = 60.0
DISK_BYTES_PER_S = 50e6
# ggml's abort message: "path/file.cpp:123: GGML_ASSERT(x) failed" (ggml_abort's "%s:%d: " prefix)
_ABORT_LINE = re.compile(r"^\S+:\d+: .+$", re.MULTILINE)
_STDERR_TAIL = 64 * 1024  # bytes of the child's stderr kept: its last words are at the end


class ModelFacts(Protocol):
    """Facts about a model file kept across processes by the caller (its cache), by the file's
    identity and the build that read it: here, that a child loaded it cleanly."""

    def get(self, kind: str, path: Path, fact: str) -> Optional[Any]: ...

    def put(self, kind: str, path: Path, fact: str, value: Any) -> None: ...


def check_loads(kind: str, path: Path, records: Optional[ModelFacts]) -> None:
    """Load ``path`` (``kind``: "gguf" or "onnx") in a child first, unless ``records`` say this
    build loaded it before; ModelLoadError where the child was killed by a signal (an abort, a
    crash). No child where Python cannot start one (a frozen app): the load is then unguarded."""
    if records is not None and records.get(kind, path, LOADED) is True:
        return
    if not can_spawn_python():
        return
    rc, err = _run_child(kind, path)
    if rc == 0:
        if records is not None:
            records.put(kind, path, LOADED, True)
        return
    if rc is not None and rc < 0:
        engine = "llama.cpp" if kind == "gguf" else "onnxruntime"
        raise ModelLoadError(f"{engine} {_death(-rc)} while loading {path}: {_last_words(err)}")


def model_files(kind: str, path: Path) -> list[Path]:
    """The files a load reads, on which a kept load depends (their paths, sizes and times): the
    GGUF itself, or every file of an ONNX model's folder (external weights, tokenizer)."""
    if kind != "onnx":
        return [path]
    folder = path if path.is_dir() else path.parent
    try:
        return sorted(f for f in folder.iterdir() if f.is_file())
    except OSError:
        return [path]


def _timeout(kind: str, path: Path) -> float:
    try:
        size = sum(f.stat().st_size for f in model_files(kind, path))
    except OSError:
        size = 0
    return BASE_TIMEOUT_S + size / DISK_BYTES_PER_S


def _run_child(kind: str, path: Path) -> tuple[Optional[int], bytes]:
    """The child's exit status (negative: the signal that ended it; None: it did not finish in
    time or did not start) and the tail of its stderr."""
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}  # no gdb attached to print a backtrace
    cmd = [sys.executable, "-m", CHILD_MODULE, kind, str(path)]
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            timeout=_timeout(kind, path), env=env,
        )  # fmt: skip
    except (subprocess.TimeoutExpired, OSError):
        return None, b""
    return proc.returncode, proc.stderr[-_STDERR_TAIL:]


def _death(sig: int) -> str:
    if sig == signal.SIGABRT:
        return "aborted"
    name = signal.Signals(sig).name if sig in signal.valid_signals() else f"signal {sig}"
    return f"crashed ({name})"


def _last_words(err: bytes) -> str:
    """The abort message in the child's stderr (ggml's "file:line: message", without the folders
    of the file), else its last line; one line, cut to a readable length."""
    text = err.decode("utf-8", errors="replace")
    found = _ABORT_LINE.findall(text)
    line = found[-1] if found else next((ln for ln in reversed(text.splitlines()) if ln.strip()), "")
    line = re.sub(r"^\S*/", "", line.strip())  # the build's source folders say nothing to a user
    line = line.encode("ascii", "backslashreplace").decode()
    return (line[:300] + "...") if len(line) > 300 else line or "no message"


# -- the child ------------------------------------------------------------------------------------
def _gguf_child(path: str) -> int:
    """Load the GGUF on the CPU, make a small context, decode one token (0: it ran)."""
    import ctypes

    import llama_cpp

    quiet = llama_cpp.llama_log_callback(lambda level, text, user: None)
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))  # only an abort's message reaches stderr
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        return 3
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = CHILD_CTX
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        return 4
    vocab = llama_cpp.llama_model_get_vocab(model)
    bos = llama_cpp.llama_vocab_bos(vocab)
    token = bos if 0 <= bos < llama_cpp.llama_vocab_n_tokens(vocab) else 0
    tokens = (llama_cpp.llama_token * 1)(token)
    first = ctypes.cast(tokens, ctypes.POINTER(llama_cpp.llama_token))
    return 0 if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(first, 1)) == 0 else 5


def _onnx_child(path: str) -> int:
    """Open the ONNX model and its tokenizer on the CPU (0: they opened)."""
    import onnxruntime
    import tokenizers

    model = Path(path)
    model = model / "model.onnx" if model.is_dir() else model
    try:
        onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        tokenizer = model.parent / "tokenizer.json"
        if tokenizer.is_file():
            tokenizers.Tokenizer.from_file(str(tokenizer))
    except Exception:  # a clean refusal: the load in the parent reports it
        return 3
    return 0


def _child(kind: str, path: str) -> int:
    no_core_dump()  # a crash here is the answer: no core file or crash report for it
    return _gguf_child(path) if kind == "gguf" else _onnx_child(path)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
