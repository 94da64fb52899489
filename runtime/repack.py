"""llama.cpp's repacked CPU weights where its AMX weights crash (llama_cpp_backend.AMX_FLAG).

On those machines models load without llama.cpp's extra buffer types, which also drops the
repacked (8-row interleaved) Q4_0 / Q4_K kernels it uses on every other x86 CPU, the faster
ones for a Q4_0 aux's calls (docs/standins.md#amx). They are asked for tensor by tensor.
llama.cpp takes such an override without checking it (a tensor it cannot repack aborts the
process), so only tensors the file's header shows it can take are named: a block's projection
weights (used in matrix products alone) of a known architecture, of a repackable type, 2-D,
with a multiple of 8 rows; a kind is named only where every layer's tensor qualifies.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any, Optional

from .gguf_header import BLOCK_MATRICES, Header

REPACK_ARCHITECTURES = ("llama", "gemma3")  # whose block projections feed matrix products alone
REPACK_KINDS = BLOCK_MATRICES  # used in matrix products alone
REPACK_TYPES = {2: "Q4_0", 12: "Q4_K"}  # ggml types repacked into 8-row blocks on AVX2 CPUs
REPACK_ROWS = 8  # the rows interleaved per block: ne[1] (and ne[0]) must be multiples of it
REPACK_BUFFER = b"CPU_REPACK"
AVX2_FLAG = "AVX2 = 1"
_CPU_DEVICE = 0  # GGML_BACKEND_DEVICE_TYPE_CPU


def repack_patterns(header: Optional[Header]) -> list[str]:
    """llama.cpp tensor-name patterns (ECMAScript regexes) for the tensors of ``header`` that
    its CPU_REPACK buffer takes; none where the header or architecture is unknown."""
    if header is None or header.architecture not in REPACK_ARCHITECTURES:
        return []
    out = []
    for kind in REPACK_KINDS:
        # ASCII digits as the C++ pattern's [0-9]: what it names is exactly what is checked here
        name = re.compile(rf"blk\.[0-9]+\.{kind}\.weight", re.ASCII)
        found = [t for n, t in header.tensors.items() if name.fullmatch(n)]
        if found and all(_repackable(t.type, t.shape) for t in found):
            out.append(rf"^blk\.[0-9]+\.{kind}\.weight$")
    return out


def _repackable(ggml_type: int, shape: tuple[int, ...]) -> bool:
    return ggml_type in REPACK_TYPES and len(shape) == 2 and all(n > 0 and n % REPACK_ROWS == 0 for n in shape)


class Overrides:
    """A NULL-terminated llama_model_tensor_buft_override array sending ``patterns`` to the
    CPU_REPACK buffer type of the ggml that ``lib`` (llama_cpp) is linked with; it must outlive
    the model load. ``pointer`` is None where that buffer type is not found."""

    def __init__(self, lib: Any, patterns: list[str]) -> None:
        self.count, self.pointer = 0, None
        buft = _repack_buffer_type(lib) if patterns else None
        if buft is None:
            return

        class Override(ctypes.Structure):
            _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

        self._patterns = [p.encode() for p in patterns]
        self._array = (Override * (len(patterns) + 1))(*[Override(p, buft) for p in self._patterns])
        self.count, self.pointer = len(patterns), ctypes.cast(self._array, ctypes.c_void_p)


def _repack_buffer_type(lib: Any) -> Optional[int]:
    """The CPU backend's CPU_REPACK buffer type, found as llama.cpp finds its extra buffer types
    (through the backend registry of the ggml libllama uses), or None."""
    if AVX2_FLAG not in lib.llama_print_system_info().decode(errors="replace"):
        return None
    dll: Any = getattr(getattr(lib, "llama_cpp", None), "_lib", None)  # libllama: its lookups reach its ggml
    try:
        by_type, reg_of, proc, name = (
            dll.ggml_backend_dev_by_type,
            dll.ggml_backend_dev_backend_reg,
            dll.ggml_backend_reg_get_proc_address,
            dll.ggml_backend_buft_name,
        )
    except AttributeError:
        return None
    by_type.restype, by_type.argtypes = ctypes.c_void_p, [ctypes.c_int]
    reg_of.restype, reg_of.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    proc.restype, proc.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    dev = by_type(_CPU_DEVICE)
    reg = reg_of(dev) if dev else None
    fn = proc(reg, b"ggml_backend_dev_get_extra_bufts") if reg else None
    if not fn:
        return None
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(dev)
    for i in range(16):  # a NULL-terminated list of a few
        if not bufts or not bufts[i]:
            break
        if name(bufts[i]) == REPACK_BUFFER:
            return int(bufts[i])
    return None
