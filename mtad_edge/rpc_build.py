"""llama.cpp's RPC backend and its ggml-rpc-server, built once per llama.cpp build into the cache.

llama-cpp-python's wheel is built without GGML_RPC, but it ships ggml's backend registry
(libggml) and base (libggml-base) as shared libraries of their own. So ggml's RPC backend
(ggml/src/ggml-rpc) compiles alone from the very llama.cpp sources the wheel was built from, as a
backend that ``ggml_backend_load()`` registers at run time (GGML_BACKEND_DL), linked against the
wheel's libggml-base; ggml-rpc-server (tools/rpc) links against the wheel's two libraries and
finds the backend beside itself. No fork, no rebuild of llama-cpp-python: two compiler calls,
about a minute on 2 cores. (A llama-cpp-python built with CMAKE_ARGS="-DGGML_RPC=ON" has the
backend built in: the client then needs nothing from here.)

Kept in ``store.home()/rpc/<key>/``, the key hashing llama-cpp-python's version, the bytes of the
two libraries this process mapped and their folder (another build is another folder, and so is
another environment with the same build: the binaries find the libraries by that path). The sources come from
``--source`` (a llama-cpp-python sdist folder or a llama.cpp checkout), else from the sdist of
the installed version, fetched with pip from its registry once and kept (the few files needed).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Optional

import mtad_edge.store as store
from mtad_edge.runtime.backends import rpc
from mtad_edge.runtime.backends.amx import mapped_libraries
from mtad_edge.runtime.errors import RpcError

LIBRARY = "libggml-rpc.so"  # ggml_backend_load_all() in the server looks for libggml-<name>.so beside it
SERVER = "ggml-rpc-server"
# What the two builds read of llama.cpp's tree (the sdist's vendor/llama.cpp), kept after a fetch
NEEDED = ("ggml/include/", "ggml/src/ggml-rpc/", "tools/rpc/")
NEEDED_FILES = re.compile(r"^ggml/src/[^/]+\.h$")  # ggml-impl.h, ggml-backend-impl.h, ...
COMPILE_TIMEOUT_S = 1200
BUILD_HINT = "run `mtad-edge rpc build` (about a minute; needs a C++ compiler, and pip's registry or --source)"


def _version() -> str:
    return metadata.version("llama-cpp-python")


def _libraries() -> tuple[Path, Path]:
    """The libggml-base and libggml that llama.cpp runs on in this process."""
    base = mapped_libraries(("libggml-base.so",))
    ggml = mapped_libraries(("libggml.so",))
    if sys.platform != "linux" or not base or not ggml:
        raise RpcError(
            "llama.cpp's RPC backend is built here on Linux only; elsewhere install llama-cpp-python with "
            'CMAKE_ARGS="-DGGML_RPC=ON" (docs/rpc.md)'
        )
    return Path(base[0]), Path(ggml[0])


def folder() -> Path:
    """Where this llama.cpp build's RPC backend and server live (built or not)."""
    base, ggml = _libraries()
    # the folder too: the builds link to the libraries by their path (an rpath), so one made for
    # another virtual environment fails to start once that environment is gone
    where = [str(p.parent.resolve()) for p in (base, ggml)]
    return store.home() / "rpc" / store.key([_version(), store.sha256_file(base), store.sha256_file(ggml), where])


def built() -> Optional[Path]:
    """The folder, where both files are built."""
    where = folder()
    return where if (where / LIBRARY).is_file() and (where / SERVER).is_file() else None


def library() -> Optional[str]:
    """The RPC backend for a --rpc load: None where llama.cpp has one built in; a one-line
    RpcError naming the build command where it is not built."""
    if rpc.built_in():
        return None
    where = built()
    if where is None:
        raise RpcError(f"--rpc needs llama.cpp's RPC backend, built once for this llama.cpp: {BUILD_HINT}")
    return str(where / LIBRARY)


def server() -> Path:
    """The built ggml-rpc-server, or a one-line RpcError naming the build command."""
    where = built()
    if where is None:
        raise RpcError(f"ggml-rpc-server is not built for this llama.cpp: {BUILD_HINT}")
    return where / SERVER


def build(source: Optional[Path] = None, say: Callable[[str], None] = lambda s: None, force: bool = False) -> Path:
    """Build the backend and the server for this llama.cpp (unless built, or ``force``); returns
    the folder. ``source``: a llama-cpp-python sdist folder or a llama.cpp tree."""
    where = built()
    if where is not None and not force:
        return where
    base, ggml = _libraries()
    root = _tree(source) if source is not None else _fetched(say)
    _check_protocol(root)
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise RpcError("no C++ compiler found (c++, g++ or clang++; or set CXX)")
    dest = folder()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        g, flags = root / "ggml", ["-std=c++17", "-O2", "-DNDEBUG", "-pthread", f"-Wl,-rpath,{base.parent}"]
        backend = [cxx, *flags, "-fPIC", "-shared", "-Wl,--no-undefined"]
        backend += ["-DGGML_BACKEND_DL", "-DGGML_BACKEND_SHARED", "-DGGML_BACKEND_BUILD", "-DGGML_SHARED"]
        backend += [f"-I{g / 'include'}", f"-I{g / 'src'}", str(g / "src/ggml-rpc/ggml-rpc.cpp")]
        backend += [str(g / "src/ggml-rpc/transport.cpp"), str(base), "-o", str(tmp / LIBRARY)]
        server_cmd = [cxx, *flags, "-DGGML_SHARED", f"-I{g / 'include'}", str(root / "tools/rpc/rpc-server.cpp")]
        server_cmd += [str(ggml), str(base), "-o", str(tmp / SERVER)]
        say(f"rpc build: compiling llama.cpp {_version()}'s RPC backend and {SERVER} with {cxx} into {dest}")
        _compile([backend, server_cmd])
        tmp.chmod(0o755)  # mkdtemp's 0700 otherwise
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _compile(commands: list[list[str]]) -> None:
    """The compiler calls side by side; the first failure as one line (its first error)."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands]
    try:
        outputs = [p.communicate(timeout=COMPILE_TIMEOUT_S)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RpcError(f"the RPC build took over {COMPILE_TIMEOUT_S} s") from None
    for p, out, cmd in zip(procs, outputs, commands):
        if p.returncode != 0:
            lines = out.splitlines()
            first = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else "no output")
            raise RpcError(f"compiling {Path(cmd[-1]).name} failed ({Path(cmd[0]).name}): {first.strip()}")


def _tree(source: Path) -> Path:
    """The llama.cpp tree in ``source``: itself, or the vendor/llama.cpp of an sdist folder."""
    for root in (source, source / "vendor" / "llama.cpp"):
        if (root / "ggml/src/ggml-rpc/ggml-rpc.cpp").is_file() and (root / "tools/rpc/rpc-server.cpp").is_file():
            return root
    raise RpcError(f"{source} holds no llama.cpp tree (ggml/src/ggml-rpc, tools/rpc) nor an sdist of one")


def _fetched(say: Callable[[str], None]) -> Path:
    """The needed part of the installed version's llama.cpp tree, from its sdist (kept)."""
    version = _version()
    root = store.home() / "rpc" / f"src-{version}"
    if (root / "tools/rpc/rpc-server.cpp").is_file():
        return root
    with tempfile.TemporaryDirectory(prefix="mtad-edge-rpc-") as tmp:
        say(f"rpc build: fetching the llama-cpp-python {version} sdist with pip (for llama.cpp's sources)")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        done = subprocess.run(
            [*cmd, f"llama-cpp-python=={version}", "-d", tmp], capture_output=True, text=True, check=False
        )
        archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if done.returncode != 0 or not archives:
            why = (done.stderr.strip().splitlines() or ["no sdist"])[-1]
            raise RpcError(f"pip could not fetch the llama-cpp-python {version} sdist ({why}): give --source DIR")
        partial = root.with_name(f".{root.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        _extract(archives[0], partial)
        shutil.rmtree(root, ignore_errors=True)
        os.replace(partial, root)
    return root


def _extract(archive: Path, dest: Path) -> None:
    """The NEEDED files of the sdist's vendor/llama.cpp into ``dest`` (regular files only)."""
    with tarfile.open(archive) as tar:
        for member in tar:
            parts = member.name.split("/", 1)
            inner = parts[1].removeprefix("vendor/llama.cpp/") if len(parts) == 2 else ""
            wanted = inner.startswith(NEEDED) or NEEDED_FILES.match(inner)
            if not member.isfile() or not wanted or inner == parts[1] or ".." in inner.split("/"):
                continue
            target = dest / inner
            target.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(member)
            if data is not None:
                target.write_bytes(data.read())


def _check_protocol(root: Path) -> None:
    """The tree's RPC protocol is the one runtime/rpc.py parses."""
    header = (root / "ggml/include/ggml-rpc.h").read_text(errors="replace")
    found = tuple(
        int(m.group(1)) if (m := re.search(rf"RPC_PROTO_{part}_VERSION\s+(\d+)", header)) else -1
        for part in ("MAJOR", "MINOR")
    )
    if found != rpc.PROTOCOL:
        raise RpcError(
            f"{root} speaks RPC protocol {found[0]}.{found[1]}; this mtad-edge relays "
            f"{rpc.PROTOCOL[0]}.{rpc.PROTOCOL[1]} (the llama.cpp of llama-cpp-python {_version()})"
        )


def server_command(host: str, port: int, threads: Optional[int] = None, cache: bool = False) -> list[str]:
    """The command line of the built ggml-rpc-server on ``host:port``."""
    cmd = [str(server()), "-H", host, "-p", str(port)]
    return cmd + (["-t", str(threads)] if threads else []) + (["-c"] if cache else [])
