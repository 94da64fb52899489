"""Python children that run only this package's code, wherever the parent was started.

A child started as ``python -m mtad_edge.runtime.x`` puts the current folder first on its path:
run from a source checkout (whose ``mtad_edge/`` has no ``runtime``) it failed to import, and a
folder holding ``llama_cpp.py`` had that file run in it. So a child here runs isolated
(``python -I``: no current folder, no user site, no ``PYTHON*`` variables), loads this package
(and the engine's package, where the parent has it) from the folders the parent runs it from,
and calls the module's ``main(argv, prove)``. Its answer counts only where it says it with
``prove``: a line carrying a nonce the parent sent on stdin, so no exit status alone (a stray
``exit(0)``) is ever taken for a proof.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Run by ``python -I -c``: argv is [PACKAGE=FOLDER ..., "--", MODULE, ARG ...]; the first line of
# stdin is the nonce. Each package is loaded from its folder before MODULE is imported.
BOOT = """
import importlib, importlib.util, os, sys
nonce = sys.stdin.readline().strip()
split = sys.argv.index("--")
for item in sys.argv[1:split]:
    name, folder = item.split("=", 1)
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
module, args = sys.argv[split + 1], sys.argv[split + 2 :]
prove = lambda word: os.write(1, (nonce + " " + word + "\\n").encode())
sys.exit(importlib.import_module(module).main(args, prove))
"""
_STDERR_TAIL = 64 * 1024  # bytes of a child's stderr kept: its last words are at the end
PR_SET_DUMPABLE, PR_GET_DUMPABLE = 4, 3  # prctl options (linux/prctl.h)


@dataclass(frozen=True)
class Outcome:
    """How a child ended: ``rc`` its exit status (negative: the signal that ended it; None: it did
    not finish in time or could not start), ``said`` the words it proved (``prove``), in order,
    and the tail of its stderr."""

    rc: Optional[int]
    said: tuple[str, ...] = ()
    stderr: bytes = b""


def can_spawn_python() -> bool:
    """Whether ``sys.executable`` starts a Python child: not in a frozen app (PyInstaller and the
    like), where it would start the app itself, nor in an embedding that names no interpreter."""
    return bool(sys.executable) and not getattr(sys, "frozen", False)


def command(module: str, args: Sequence[str], packages: Sequence[str] = ()) -> list[str]:
    """The command line of a child running ``module``'s ``main(args, prove)``; ``packages``:
    third-party packages loaded from where this process has them (where it has imported them)."""
    ours = (__package__ or "mtad_edge.runtime.backends").rsplit(".", 1)[0]  # the runtime, a room above this
    top = ours.split(".")[0]
    folders = [(top, _folder(top)), (ours, str(Path(__file__).resolve().parent.parent))]
    folders += [(name, _folder(name)) for name in packages]
    loads = [f"{name}={folder}" for name, folder in folders if folder is not None]
    return [sys.executable, "-I", "-c", BOOT, *loads, "--", module, *args]


def _folder(package: str) -> Optional[str]:
    """The folder of an imported package (None: not imported, or not a folder with __init__.py)."""
    where = getattr(sys.modules.get(package), "__file__", None)
    if not where or Path(where).name != "__init__.py":
        return None
    return str(Path(where).resolve().parent)


def run(
    module: str,
    args: Sequence[str],
    timeout: float,
    packages: Sequence[str] = (),
    env: Optional[dict[str, str]] = None,
) -> Outcome:
    """Run a child (see ``command``) and wait for it at most ``timeout`` seconds."""
    nonce = secrets.token_hex(16)
    try:
        proc = subprocess.run(
            command(module, args, packages), input=f"{nonce}\n".encode(), capture_output=True,
            timeout=timeout, env={**os.environ, **(env or {})},
        )  # fmt: skip
    except (subprocess.TimeoutExpired, OSError):
        return Outcome(None)
    said = tuple(
        line[len(nonce) + 1 :].decode("ascii", "replace")
        for line in proc.stdout.splitlines()
        if line.startswith(nonce.encode() + b" ")
    )
    return Outcome(proc.returncode, said, proc.stderr[-_STDERR_TAIL:])


def no_core_dump() -> None:
    """A child whose crash is its answer leaves no core file or crash report (apport,
    systemd-coredump) for it."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
