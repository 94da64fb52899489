"""llama.cpp's faster CPU weight layouts where its AMX weights crash (llama_cpp_backend.AMX_FLAG).

On those machines models load without llama.cpp's extra buffer types, which also drops the
repacked (8-row interleaved) Q4_0 / Q4_K kernels it uses on every other x86 CPU, the faster
ones for a Q4_0 aux's calls (docs/standins.md#amx). They are asked for tensor by tensor.
llama.cpp takes such an override without checking it (a tensor it cannot repack aborts the
process), so only tensors the file's header shows it can take are named: a block's projection
weights (used in matrix products alone) of a known architecture, of a repackable type, 2-D,
with a multiple of 8 rows; a kind is named only where every layer's tensor qualifies.

Where the build's AMX kernels do run (runtime/amx.py asks a child process first), a model with
weights AMX multiplies loads with the extra buffer types on, as llama.cpp would load it, less
one choice: float matrices stay in the plain CPU buffer (AMX's path for them is slower beyond
one row).
"""

from __future__ import annotations

import ctypes
import re
from collections import Counter
from typing import Any, Optional

from .gguf_header import BLOCK_MATRICES, Header, Tensor

REPACK_ARCHITECTURES = ("llama", "gemma3")  # whose block projections feed matrix products alone
REPACK_KINDS = BLOCK_MATRICES  # used in matrix products alone
REPACK_TYPES = {2: "Q4_0", 12: "Q4_K"}  # ggml types repacked into 8-row blocks on AVX2 CPUs
REPACK_ROWS = 8  # the rows interleaved per block: ne[1] (and ne[0]) must be multiples of it
REPACK_BUFFER = b"CPU_REPACK"
AMX_BUFFER = b"AMX"
CPU_BUFFER = b"CPU"  # the CPU device's plain buffer type
# ggml types llama.cpp's AMX buffer multiplies, each with the multiple of it a row's length must
# be: Q4_0, Q4_1, Q8_0 (a block) and Q4_K, Q5_K, Q6_K, IQ4_XS (a super-block)
AMX_TYPES = {2: 32, 3: 32, 8: 32, 12: 256, 13: 256, 14: 256, 23: 256}
AMX_ROWS = 32  # output rows per AMX block (TILE_N x 2): a weight's rows must be a multiple
# AMX takes F16 (and llama.cpp would send it there), but multiplies it slower beyond one row: a
# 5-row verify of the x4 stand-in cost 1.9x a step there against 1.2x (docs/backends.md#amx)
FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16
# the output matrix: untied, or llama.cpp's copy of a tied one, which carries the embedding's name
TIED_OUTPUT = "token_embd.weight"
OUTPUT_MATRICES = ("output.weight", TIED_OUTPUT)
AVX2_FLAG = "AVX2 = 1"
_CPU_DEVICE = 0  # GGML_BACKEND_DEVICE_TYPE_CPU


def placements(header: Optional[Header], amx: bool) -> list[tuple[str, bytes]]:
    """(llama.cpp tensor-name pattern, an ECMAScript regex; buffer type name) for the tensors
    of ``header``; none where the header or architecture is unknown. Without ``amx``: the block
    kinds CPU_REPACK takes. With it (extra buffer types on: llama.cpp places the rest): the
    float matrices, kept in the CPU buffer."""
    if header is None or header.architecture not in REPACK_ARCHITECTURES:
        return []
    out = []
    for pattern, found in _matrices(header):
        if amx and all(t.type in FLOAT_TYPES for t in found):
            out.append((pattern, CPU_BUFFER))
        elif not amx and pattern.startswith(r"^blk") and all(_repackable(t.type, t.shape) for t in found):
            out.append((pattern, REPACK_BUFFER))
    return out


def amx_kinds(header: Optional[Header]) -> list[str]:
    """Patterns of the matrix kinds of ``header`` whose every tensor llama.cpp's AMX buffer
    multiplies (what it sends there with the extra buffer types on)."""
    return [pattern for pattern, _ in amx_matrices(header)]


def amx_matrices(header: Optional[Header]) -> list[tuple[str, list[Tensor]]]:
    """(pattern, tensors) of those kinds."""
    if header is None or header.architecture not in REPACK_ARCHITECTURES:
        return []
    return [(p, found) for p, found in _matrices(header) if all(_amx_takes(t.type, t.shape) for t in found)]


def exact(name: str) -> str:
    """The pattern naming one tensor."""
    return "^" + re.escape(name) + "$"


def _matrices(header: Header) -> list[tuple[str, list[Tensor]]]:
    """(pattern, tensors) of each block projection kind and output matrix ``header`` holds."""
    out = []
    for kind in REPACK_KINDS:
        # ASCII digits as the C++ pattern's [0-9]: what it names is exactly what is checked here
        name = re.compile(rf"blk\.[0-9]+\.{kind}\.weight", re.ASCII)
        found = [t for n, t in header.tensors.items() if name.fullmatch(n)]
        if found:
            out.append((rf"^blk\.[0-9]+\.{kind}\.weight$", found))
    for matrix in OUTPUT_MATRICES:
        if matrix in header.tensors:
            out.append((exact(matrix), [header.tensors[matrix]]))
    return out


def _amx_takes(ggml_type: int, shape: tuple[int, ...]) -> bool:
    return (
        ggml_type in AMX_TYPES
        and len(shape) == 2
        and shape[0] > 0
        and shape[0] % AMX_TYPES[ggml_type] == 0
        and shape[1] > 0
        and shape[1] % AMX_ROWS == 0
    )


def _repackable(ggml_type: int, shape: tuple[int, ...]) -> bool:
    return ggml_type in REPACK_TYPES and len(shape) == 2 and all(n > 0 and n % REPACK_ROWS == 0 for n in shape)


class Overrides:
    """A NULL-terminated llama_model_tensor_buft_override array sending each pattern to its
    buffer type of the ggml that ``lib`` (llama_cpp) is linked with; it must outlive the model
    load. A pattern whose buffer type is not found is left out; ``pointer`` is None where none
    is left. ``named``: the patterns named, by buffer type name."""

    def __init__(self, lib: Any, placed: list[tuple[str, bytes]]) -> None:
        self.pointer = None
        bufts = _buffer_types(lib) if placed else {}
        kept = [(p, b) for p, b in placed if b in bufts]
        self.named: dict[bytes, int] = dict(Counter(b for _, b in kept))
        if not kept:
            return

        class Override(ctypes.Structure):
            _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

        self._patterns = [p.encode() for p, _ in kept]
        self._array = (Override * (len(kept) + 1))(*[Override(p, bufts[b]) for p, (_, b) in zip(self._patterns, kept)])
        self.pointer = ctypes.cast(self._array, ctypes.c_void_p)


def _buffer_types(lib: Any) -> dict[bytes, int]:
    """The CPU device's buffer types by name (its own, CPU, and the extra CPU_REPACK, AMX), found
    as llama.cpp finds them (through the backend registry of the ggml libllama uses); none
    without AVX2."""
    if AVX2_FLAG not in lib.llama_print_system_info().decode(errors="replace"):
        return {}
    dll: Any = getattr(getattr(lib, "llama_cpp", None), "_lib", None)  # libllama: its lookups reach its ggml
    try:
        by_type, reg_of, proc, name, plain = (
            dll.ggml_backend_dev_by_type,
            dll.ggml_backend_dev_backend_reg,
            dll.ggml_backend_reg_get_proc_address,
            dll.ggml_backend_buft_name,
            dll.ggml_backend_dev_buffer_type,
        )
    except AttributeError:
        return {}
    by_type.restype, by_type.argtypes = ctypes.c_void_p, [ctypes.c_int]
    reg_of.restype, reg_of.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    proc.restype, proc.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    plain.restype, plain.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    dev = by_type(_CPU_DEVICE)
    reg = reg_of(dev) if dev else None
    fn = proc(reg, b"ggml_backend_dev_get_extra_bufts") if reg else None
    if not fn:
        return {}
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(dev)
    found: dict[bytes, int] = {name(plain(dev)): int(plain(dev))}
    for i in range(16):  # a NULL-terminated list of a few
        if not bufts or not bufts[i]:
            break
        found[name(bufts[i])] = int(bufts[i])
    return found
