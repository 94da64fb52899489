"""The one cache: where mtad-edge keeps what it derives, and how it writes and trusts it.

- ``home()``: $MTAD_EDGE_HOME, else the platform's cache folder;
- keyed records (calibrations, tuned floors, vocabulary maps): a key is a hash of what the record
  depends on (``key``; model files enter by ``file_identity``: path, size, mtime), written
  atomically under ``home()/<kind>/<key>.<suffix>`` and read back as None when missing or damaged;
- sha256 stamps: a file hashed once is trusted while its size and mtime stay as they were
  (``stamp`` / ``stamped``), so a multi-GB model is not hashed at every start; one scheme for
  derived pairs and hub downloads alike;
- big derived files (models): written under a temporary name (``tmp_name``), moved into place and
  stamped when complete (``finish``); temporary files of processes that died are swept.

A cache that cannot be written costs only the work of deriving again: readers get None, writers
of keyed records swallow OSError (``remember``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

from mtad_edge.runtime.errors import MtadEdgeError

KEY_CHARS = 20  # hex digits of a record's key: collisions are out of reach at any cache size


def home() -> Path:
    """Where prepared pairs and records live: $MTAD_EDGE_HOME, else the platform's cache folder."""
    if os.environ.get("MTAD_EDGE_HOME"):
        return Path(os.environ["MTAD_EDGE_HOME"]).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "mtad-edge"
    if os.name == "nt":
        return Path(os.environ.get("LOCALAPPDATA", Path.home())) / "mtad-edge" / "Cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtad-edge"


def file_identity(*paths: Any, swaps: bool = False) -> list[list[Any]]:
    """Each model file (or ONNX folder) as [path, size, mtime]: a rebuilt file is another model.
    ``swaps``: also its inode and ctime, which a file put in its place changes whatever size and
    mtime it was given (for the guard's record that a file loads without an abort)."""
    out = []
    for path in paths:
        try:
            st = Path(str(path)).stat() if path is not None else None
        except OSError:
            st = None
        row = [str(path), st.st_size if st else 0, st.st_mtime_ns if st else 0]
        out.append(row + ([st.st_ino if st else 0, st.st_ctime_ns if st else 0] if swaps else []))
    return out


def key(parts: list[Any]) -> str:
    """A record's key: the hash of everything it depends on."""
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:KEY_CHARS]


def path(kind: str, record: str, suffix: str = "json") -> Path:
    return home() / kind / f"{record}.{suffix}"


def tmp_name(dest: Path) -> Path:
    """Where ``dest`` is written before it is complete: hidden, named after the writing process,
    with ``dest``'s suffix (numpy's savez appends one otherwise)."""
    return dest.with_name(f".{dest.name}.partial-{os.getpid()}{dest.suffix}")


@contextlib.contextmanager
def atomic(dest: Path) -> Iterator[Path]:
    """A temporary name beside ``dest`` to write to; renamed onto ``dest`` when the block ends
    without an error, removed otherwise (an interrupted write never leaves a file that loads)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(dest)
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        drop(tmp)


def drop(file: Path) -> None:
    """Remove a file; failing to (a read-only cache) must not hide the error that brought us here."""
    with contextlib.suppress(OSError):
        file.unlink(missing_ok=True)


def read_json(file: Path) -> Optional[Any]:
    """A record, or None when it is missing or damaged (nested too deeply for the parser too)."""
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError, RecursionError):
        return None


def write_json(file: Path, value: Any) -> Path:
    """Write a record atomically; returns its path (OSError when the cache refuses it)."""
    with atomic(file) as tmp:
        tmp.write_text(json.dumps(value, indent=1))
    return file


def remember(write: Callable[[], Any]) -> None:
    """Run a write into the cache; a cache that refuses it only costs deriving again next time."""
    with contextlib.suppress(OSError):
        write()


def sha256_file(file: Path) -> str:
    h = hashlib.sha256()
    with file.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _stamp_path(file: Path) -> Path:
    return path("stamps", key([str(file.resolve())]))


def stamp(file: Path, digest: Optional[str] = None) -> str:
    """Record ``file``'s sha256 (computed unless given) with its size and mtime; returns it
    (OSError when the cache refuses the stamp)."""
    digest = digest or sha256_file(file)
    st = file.stat()
    write_json(_stamp_path(file), [str(file.resolve()), st.st_size, st.st_mtime_ns, digest])
    return digest


def stamped(file: Path) -> Optional[str]:
    """The sha256 a stamp recorded for ``file``, if its size and mtime are still the stamp's."""
    record = read_json(_stamp_path(file))
    try:
        name, size, mtime, digest = record  # type: ignore[misc]
        st = file.stat()
    except (OSError, TypeError, ValueError):
        return None
    if name != str(file.resolve()) or size != st.st_size or mtime != st.st_mtime_ns or not isinstance(digest, str):
        return None
    return digest


def finish(tmp: Path, dest: Path) -> str:
    """Move a completely written temporary file into place and stamp it; returns its sha256. A
    file that cannot be stamped is removed (unstamped, it would be derived again at every run
    while its bytes kept a full disk full)."""
    with tmp.open("rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, dest)
    try:
        return stamp(dest)
    except OSError as e:
        drop(dest)
        raise MtadEdgeError(f"cannot stamp {dest.name} in {dest.parent}: {os_error(e)}; removed it") from None


def make_folder(folder: Path, what: str) -> Path:
    """``folder`` and its parents, made where missing; one that cannot be made is a one-line error
    naming ``what`` (a user's output folder, before any work goes into it)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MtadEdgeError(f"cannot make {what} {folder}: {os_error(e)}") from None
    return folder


def os_error(e: OSError) -> str:
    """An OSError in words, naming a full disk as such."""
    if e.errno == errno.ENOSPC:
        where = f" for {e.filename}" if e.filename else ""
        return f"no space left on the device (ENOSPC){where}: free some space and run the command again"
    return f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)


# A temporary file of a process we cannot ask about (Windows: os.kill would end it) is stale after this.
STALE_PARTIAL_S = 24 * 3600
_PARTIAL = re.compile(r"\.partial-(\d+)")


def sweep_partials(folder: Path) -> None:
    """Remove the temporary files of writers that died (kill -9, a power cut): their process is
    gone. Files of live processes, ours included, are kept."""
    for tmp in folder.glob(".*.partial-*"):
        found = _PARTIAL.search(tmp.name)
        if found is None or int(found.group(1)) == os.getpid() or _alive(int(found.group(1)), tmp):
            continue
        drop(tmp)


def _alive(pid: int, tmp: Path) -> bool:
    if os.name == "nt":
        with contextlib.suppress(OSError):
            return time.time() - tmp.stat().st_mtime < STALE_PARTIAL_S
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, say: alive
        return True
    return True
