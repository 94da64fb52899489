"""A GGUF file's header as untrusted input: its architecture and each tensor's type and shape.

Read before llama.cpp loads a model, to decide per tensor where llama.cpp would abort on a choice
of ours (runtime/repack.py). Every count and length is checked against the file's size and
against fixed bounds; a header this reader cannot take whole is a ``HeaderError`` naming what
broke (a one-line load error), never None, an unbounded loop or another exception: a check that
silently skipped an unreadable header let llama.cpp abort on it.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TypeVar

from ..errors import ModelLoadError

# Bounds on what a header may declare, far above any real model's (a 262k-token vocabulary is
# one array; the largest models have a few thousand tensors).
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 20
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 63  # bytes in a tensor name (GGML_MAX_NAME less its NUL; llama.cpp refuses longer ones)
MAX_KEY = 1 << 16  # bytes in a key; the one value read as text (the architecture) is cut at MAX_NAME
_VERSIONS = (2, 3)  # version 1 used 32-bit counts; llama.cpp no longer reads it
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_STRING, _ARRAY = 8, 9
INT_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}  # integer value type -> format
_ARCH_KEY = "general.architecture"
# A Llama-layout block's projection matrices: blk.N.<name>.weight
BLOCK_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
T = TypeVar("T")


@dataclass(frozen=True)
class Tensor:
    type: int  # ggml_type
    shape: tuple[int, ...]  # ne[0], ne[1], ... (ne[0] is the row length)


@dataclass(frozen=True)
class Header:
    architecture: str
    tensors: dict[str, Tensor]


class HeaderError(ModelLoadError):
    """A GGUF header this reader cannot take whole: it breaks the format or a bound."""


class _Bad(Exception):
    """The header breaks a bound or runs past the end of the file (``str``: what broke)."""


class _Reader:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.off = buf, 0

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.off + size > len(self.buf):
            raise _Bad(f"it ends at byte {len(self.buf)}, inside the header")
        (value,) = struct.unpack_from(fmt, self.buf, self.off)
        self.off += size
        return int(value)

    def skip(self, n: int) -> None:
        if n < 0 or self.off + n > len(self.buf):
            raise _Bad(f"a value at byte {self.off} claims {n} bytes, past the end of the file")
        self.off += n

    def span(self) -> tuple[int, int]:
        """Skip a string; where its bytes lie."""
        n = self.take("<Q")
        start = self.off
        self.skip(n)
        return start, self.off

    def text(self, start: int, end: int) -> str:
        return bytes(self.buf[start:end]).decode("utf-8", errors="replace")

    def string(self, limit: int) -> str:
        """A string of at most ``limit`` bytes (longer: the header is not taken)."""
        start, end = self.span()
        if end - start > limit:
            raise _Bad(f"a name at byte {start} is {end - start} bytes long (at most {limit})")
        return self.text(start, end)

    def value(self, vtype: int, text: bool = False) -> Optional[str]:
        """Skip one value; with ``text``, a short string's text is returned (never a copy of a
        long one: any value may be as large as the file)."""
        if vtype in _SCALARS:
            self.skip(_SCALARS[vtype])
            return None
        if vtype == _STRING:
            start, end = self.span()
            return self.text(start, end) if text and end - start <= MAX_NAME else None
        if vtype != _ARRAY:
            raise _Bad(f"a value at byte {self.off} has type {vtype}, which GGUF does not define")
        etype, count = self.take("<I"), self.take("<Q")
        if etype in _SCALARS:
            self.skip(_SCALARS[etype] * count)
        elif etype == _STRING:
            if count * 8 > len(self.buf) - self.off:
                raise _Bad(f"an array at byte {self.off} claims {count} strings, more than the file holds")
            for _ in range(count):
                self.span()
        else:  # arrays of arrays, unknown types: in no model llama.cpp reads
            raise _Bad(f"an array at byte {self.off} holds values of type {etype}, which no model uses")
        return None


def int_range(vtype: int) -> Optional[tuple[int, int]]:
    """The values an integer value type holds (lowest, highest); None for a type that is no integer."""
    fmt = INT_FORMATS.get(vtype)
    if fmt is None:
        return None
    bits = 8 * struct.calcsize(fmt)
    return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if fmt[1].islower() else (0, 2**bits - 1)


def read_header(path: Path) -> Header:
    """The architecture and tensor table of the GGUF at ``path``; HeaderError where the header is
    not one this reader takes whole (another version, a bound broken, the file too short)."""
    return _read(path, _parse)


def read_block_count(path: Path) -> Optional[int]:
    """The ``<architecture>.block_count`` the GGUF at ``path`` declares, when it is an integer; None
    where it declares none. The KV pairs are read only up to it (the token arrays after it are never
    walked), but all of them where it is missing; HeaderError where they cannot be read."""
    return _read(path, _block_count)


def _read(path: Path, parse: Callable[[_Reader], T]) -> T:
    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise _Bad("it does not start with the GGUF magic")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return parse(_Reader(buf))
    except _Bad as e:
        raise HeaderError(f"{path}: cannot read its GGUF header: {e}") from None
    except (OSError, ValueError, struct.error) as e:  # unreadable, empty (mmap refuses 0 bytes), ...
        raise HeaderError(f"{path}: cannot read its GGUF header: {e}") from None


def _block_count(r: _Reader) -> Optional[int]:
    counts: dict[str, int] = {}
    arch = None
    for _ in range(_counts(r)[1]):
        key, vtype = r.string(MAX_KEY), r.take("<I")
        if key.endswith(".block_count") and vtype in INT_FORMATS:
            counts[key] = r.take(INT_FORMATS[vtype])
        elif key == _ARCH_KEY:
            arch = r.value(vtype, text=True)
        else:
            r.value(vtype)
        if arch is not None and f"{arch}.block_count" in counts:
            break
    return counts.get(f"{arch}.block_count")


def _counts(r: _Reader) -> tuple[int, int]:
    """The header's tensor and KV counts, past the magic and version; _Bad where either is not taken."""
    if bytes(r.buf[:4]) != b"GGUF":
        raise _Bad("it does not start with the GGUF magic")
    r.skip(4)
    version = r.take("<I")
    if version not in _VERSIONS:
        raise _Bad(f"GGUF version {version} (this reader takes {' and '.join(map(str, _VERSIONS))})")
    n_tensors, n_kv = r.take("<Q"), r.take("<Q")
    if n_tensors > MAX_TENSORS:
        raise _Bad(f"it declares {n_tensors} tensors (at most {MAX_TENSORS})")
    if n_kv > MAX_KV:
        raise _Bad(f"it declares {n_kv} metadata keys (at most {MAX_KV})")
    return n_tensors, n_kv


def _parse(r: _Reader) -> Header:
    n_tensors, n_kv = _counts(r)
    arch = ""
    for _ in range(n_kv):
        key = r.string(MAX_KEY)
        text = r.value(r.take("<I"), text=key == _ARCH_KEY)
        if text is not None:
            arch = text
    tensors: dict[str, Tensor] = {}
    for _ in range(n_tensors):
        name = r.string(MAX_NAME)
        if "\0" in name:  # C would read a shorter name
            raise _Bad(f"tensor name {name!r} holds a NUL byte")
        if name in tensors:  # llama.cpp refuses duplicates
            raise _Bad(f"tensor {name!r} is named twice")
        n_dims = r.take("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _Bad(f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS})")
        shape = tuple(r.take("<Q") for _ in range(n_dims))
        tensors[name] = Tensor(r.take("<I"), shape)
        r.skip(8)  # the data offset
    return Header(arch, tensors)
