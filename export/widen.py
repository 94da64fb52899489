"""Big-target stand-ins: a Llama GGUF widened k times that still computes what the original computes.

Every hidden vector becomes k copies of itself. Inside a block every matrix is tiled k x k and
divided by k (its output tiled, its input split over the k copies); norm weights and biases are
tiled; heads and KV heads are k times as many with the head dimension unchanged. q, k and v tile
as whole heads, so under GQA each q head still meets its own KV head, and the per-head row
permutation llama.cpp's GGUF applies for RoPE is kept. RMSNorm of a tiled vector is the tiled
RMSNorm, so the residual stream stays tiled through every layer. The embedding is tiled along the
hidden dimension and the output matrix (a tied model's embedding, untied) is tiled and divided by
k, so the logits are the original's up to float rounding: the small model's text at a big model's
cost in memory traffic and arithmetic. See docs/standins.md.

``widen`` writes the file tensor by tensor (GGUFWriter's header, KV data, tensor infos, then one
tensor's data at a time) from a memory-mapped source, so a 14.5 GB result never sits in memory.
``export_standin`` (``mtad-edge export widen``) makes a pair folder: the widened target, the aux
beside it and a manifest, published manifest-last.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from mtad_edge.pairs import CONTEXT_SIZE_MAX, quantize
from mtad_edge.runtime.backends.gguf_header import BLOCK_MATRICES, int_range, read_header
from mtad_edge.runtime.errors import MtadEdgeError, quoted
from mtad_edge.store import drop, finish, make_folder, sha256_file, tmp_name

from .staging import Progress, publish, staging

OUTTYPES = ("f16", "q8_0")
# Tensors of the plain Llama layout: how each one widens (anything else is refused).
_BLOCK_VECTORS = ("attn_norm", "ffn_norm")
_WIDENABLE = {"F16", "F32", "BF16"}
_FACTOR_KEY, _SOURCE_KEY = "mtad_edge.widen.factor", "mtad_edge.widen.source"
# The widths that grow k times (head and RoPE dimensions do not); all but head_count_kv are required.
_SCALED = ("llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count")
_SCALED_KV = "llama.attention.head_count_kv"


@dataclass(frozen=True)
class Widened:
    path: Path
    factor: int  # times wider than the file given (the GGUF's mtad_edge.widen.factor: than the original)
    parameters: int  # weights in the widened file (an untied output matrix included)
    source_parameters: int
    sha256: str


@dataclass(frozen=True)
class _Plan:
    """One output tensor: its name, numpy shape and dtype, and how its data is made."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def check_factor(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise MtadEdgeError(f"the widening factor must be an integer of at least 2 (got {k!r})")


def _read(src: Path) -> Any:
    """A GGUFReader over ``src`` (memory-mapped) once it is known to be a Llama GGUF, or one line
    saying why not."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        msg = f"widen needs the gguf package: pip install 'mtad-edge[export]' ({e.name} missing)"
        raise MtadEdgeError(msg) from None
    if not src.is_file():
        raise MtadEdgeError(f"{src}: no such file")
    try:
        with src.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise MtadEdgeError(f"{src} is not a GGUF file (it starts with {magic!r}, expected b'GGUF')")
        header = read_header(src)  # the architecture alone: GGUFReader parses every token text first (~10 s for Gemma)
        arch = header.architecture or "unknown"
        if arch != "llama":
            raise MtadEdgeError(f"{src.name} is a {arch!r} model: widen supports the llama architecture only")
        return GGUFReader(src)
    except (ValueError, IndexError, KeyError, OSError, struct.error) as e:
        raise MtadEdgeError(f"cannot read the GGUF file {src}: {e!r}") from None


def _value(field: Any) -> Any:
    """A KV field's value as GGUFWriter takes it (strings as raw bytes: token texts need not be UTF-8)."""
    from gguf import GGUFValueType

    main = field.types[0]
    if main == GGUFValueType.STRING:
        return bytes(field.parts[-1])
    if main == GGUFValueType.ARRAY:
        if len(field.types) > 2:
            raise MtadEdgeError(f"cannot copy the nested array {field.name}")
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data]
    return field.contents()


def kv_entry(field: Any) -> tuple[Any, Any, Any]:
    """A KV field as GGUFWriter.add_key_value takes it: (value, value type, an array's element type)."""
    from gguf import GGUFValueType

    vtype = field.types[0]
    return _value(field), vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml's ne0-first order -> numpy's


def _loader(t: Any) -> Callable[[], np.ndarray]:
    """A source tensor's data as native float32 (the reader keeps BF16 as raw bytes)."""
    from gguf import GGMLQuantizationType

    def load() -> np.ndarray:
        if t.tensor_type == GGMLQuantizationType.BF16:
            bits = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(_shape(t))
        return np.asarray(t.data, dtype=np.float32)

    return load


def _matrix(load: Callable[[], np.ndarray], k: int, reps: tuple[int, int]) -> Callable[[], np.ndarray]:
    """W / k as F16 (divided before tiling: temporaries stay the source's size), tiled ``reps``."""
    return lambda: np.tile((load() / k).astype(np.float16), reps)


def _widen_tensor(name: str, shape: tuple[int, ...], load: Callable[[], np.ndarray], k: int) -> _Plan:
    """How one tensor widens. Matrices are (out, in) in numpy order."""
    m = re.fullmatch(r"blk\.\d+\.(\w+)\.(weight|bias)", name)
    part, kind = (m.group(1), m.group(2)) if m else (name, "")
    if part in BLOCK_MATRICES and kind == "weight" and len(shape) == 2:  # outputs tiled, inputs split
        return _Plan(name, (shape[0] * k, shape[1] * k), np.float16, _matrix(load, k, (k, k)))
    vector = (part in _BLOCK_VECTORS and kind == "weight") or (part in BLOCK_MATRICES and kind == "bias")
    if len(shape) == 1 and (vector or name == "output_norm.weight"):  # norm weights, biases: tiled
        return _Plan(name, (shape[0] * k,), np.float32, lambda: np.tile(load(), k))
    if name == "token_embd.weight" and len(shape) == 2:  # each token's vector tiled along the hidden dim
        return _Plan(name, (shape[0], shape[1] * k), np.float16, lambda: np.tile(load().astype(np.float16), (1, k)))
    if name == "output.weight" and len(shape) == 2:  # sum over the k copies of W h / k = W h
        return _Plan(name, (shape[0], shape[1] * k), np.float16, _matrix(load, k, (1, k)))
    if name == "rope_freqs.weight":  # per head dimension: unchanged
        return _Plan(name, shape, np.float32, load)
    raise MtadEdgeError(f"cannot widen the tensor {name} {list(shape)}: not part of the plain Llama layout")


def _plan(reader: Any, src: Path, k: int) -> list[_Plan]:
    """Every output tensor, in the source's order (a tied model's new output matrix after the
    embedding), after checking the source is a Llama model with float weights."""
    arch_field = reader.fields.get("general.architecture")
    arch = _value(arch_field).decode(errors="replace") if arch_field else "unknown"
    if arch != "llama":
        raise MtadEdgeError(f"{src.name} is a {arch!r} model: widen supports the llama architecture only")
    odd = sorted({t.tensor_type.name for t in reader.tensors} - _WIDENABLE)
    if odd:
        raise MtadEdgeError(
            f"{src.name} has {', '.join(odd)} tensors: widen needs F16, F32 or BF16 weights (quantized ones cannot "
            "be widened exactly); widen the F16 model and quantize the result (--outtype q8_0)"
        )
    _check_metadata(reader, src, k)
    _check_shapes(reader, src)
    plans = []
    for t in reader.tensors:
        plans.append(_widen_tensor(t.name, _shape(t), _loader(t), k))
        if t.name == "token_embd.weight" and not any(u.name == "output.weight" for u in reader.tensors):
            plans.append(_widen_tensor("output.weight", _shape(t), _loader(t), k))  # untied: tile(E / k)
    if not any(p.name == "token_embd.weight" for p in plans):
        raise MtadEdgeError(f"{src.name} has no token_embd.weight")
    return plans


def _check_metadata(reader: Any, src: Path, k: int) -> None:
    """The KV fields widen reads, checked before anything is written: a width that is not an integer
    (a string, a string array), or that k times over no longer fits its type, was a traceback midway."""
    from gguf import GGUFValueType

    for key in (*_SCALED, _SCALED_KV):
        if key in reader.fields:
            _integers(reader.fields[key], src, k, per_layer=True)
        elif key != _SCALED_KV:
            raise MtadEdgeError(f"{src.name} has no {key} in its metadata")
    _check_heads(reader, src)
    if _FACTOR_KEY in reader.fields:  # a stand-in widened again: the factor is written as a UINT32
        _integers(reader.fields[_FACTOR_KEY], src, k, fits=2**32 - 1)
        source = reader.fields.get(_SOURCE_KEY)
        if source is None or source.types != [GGUFValueType.STRING]:
            raise MtadEdgeError(f"{src.name}: {_FACTOR_KEY} needs {_SOURCE_KEY}, a string, beside it")


def _check_heads(reader: Any, src: Path) -> None:
    """At least one head and one KV head in each layer, the KV heads dividing the heads (grouped
    attention): llama.cpp refuses any other file at load, after widen had written all of it."""
    heads, kv = _heads(reader.fields)
    if len(heads) == 1 or len(kv) == 1:
        heads, kv = heads * len(kv), kv * len(heads)
    if len(heads) != len(kv) or not all(h >= 1 and n >= 1 and h % n == 0 for h, n in zip(heads, kv)):
        raise MtadEdgeError(
            f"{src.name}: head_count {quoted(heads)} and head_count_kv {quoted(kv)} must be at least 1, "
            "and the KV heads must divide the heads, in every layer"
        )


def _heads(fields: Any) -> tuple[list[int], list[int]]:
    """Heads and KV heads as the metadata gives them (one count, or one per layer); no
    head_count_kv means as many KV heads as heads."""
    heads = _per_layer(fields[_SCALED[2]].contents())
    return heads, _per_layer(fields[_SCALED_KV].contents()) if _SCALED_KV in fields else heads


def _check_shapes(reader: Any, src: Path) -> None:
    """Every tensor has the shape the metadata gives it (so its widened copy has the widened
    metadata's): llama.cpp refused a wrong one only at load, after widen had written all of it."""
    fields = reader.fields
    embd = _per_layer(fields[_SCALED[0]].contents())[0]
    ffs, (heads, kvs) = _per_layer(fields[_SCALED[1]].contents()), _heads(fields)
    vocab = next((_shape(t)[0] for t in reader.tensors if t.name == "token_embd.weight"), None)
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
        if m:
            layer = int(m.group(1))
            ff, h, kv = (v[layer] if len(v) > 1 and layer < len(v) else v[-1] for v in (ffs, heads, kvs))
            key_dim, value_dim = (
                _length(fields, f"llama.attention.{x}_length", embd // h, src) for x in ("key", "value")
            )
            out_in = {
                "attn_q": (h * key_dim, embd),
                "attn_k": (kv * key_dim, embd),
                "attn_v": (kv * value_dim, embd),
                "attn_output": (embd, h * value_dim),
                "ffn_gate": (ff, embd),
                "ffn_up": (ff, embd),
                "ffn_down": (embd, ff),
            }.get(m.group(2))
            if out_in is not None:
                want = out_in if m.group(3) == "weight" else (out_in[0],)
            elif m.group(2) in _BLOCK_VECTORS and m.group(3) == "weight":
                want = (embd,)
            else:
                continue  # _widen_tensor refuses it
        elif t.name in ("token_embd.weight", "output.weight"):
            want = (_shape(t)[0] if vocab is None else vocab, embd)
        elif t.name == "output_norm.weight":
            want = (embd,)
        else:
            continue  # rope_freqs and the tensors _widen_tensor refuses
        if _shape(t) != want:
            raise MtadEdgeError(
                f"{src.name}: {t.name} is {list(_shape(t))}, the metadata makes it {list(want)} "
                "(numpy order: outputs, inputs)"
            )


def _length(fields: Any, key: str, default: int, src: Path) -> int:
    """A head dimension the metadata may give (it does not grow with k)."""
    if key not in fields:
        return default
    _integers(fields[key], src, 1)
    return int(fields[key].contents())


def _per_layer(value: Any) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _integers(field: Any, src: Path, k: int, per_layer: bool = False, fits: int = 2**64) -> None:
    """``field`` is a non-negative integer (``per_layer``: or an array of them) that k times over
    still fits its type and ``fits``; else one line naming it."""
    from gguf import GGUFValueType

    types = [int(t) for t in field.types]
    if per_layer and len(types) == 2 and types[0] == GGUFValueType.ARRAY:
        types = types[1:]
    bounds = int_range(types[0]) if len(types) == 1 else None
    values = field.contents() if bounds else None
    values = values if isinstance(values, list) else [values]
    if bounds is None or not all(0 <= v * k <= min(bounds[1], fits) for v in values):
        what = "a non-negative integer" + (" (or one per layer)" if per_layer else "")
        raise MtadEdgeError(
            f"{src.name}: {field.name} must be {what} that fits its type {k} times over, got {quoted(field.contents())}"
        )


def _scaled(value: Any, k: int) -> Any:
    return [int(v) * k for v in value] if isinstance(value, list) else int(value) * k


def _label(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _metadata(reader: Any, writer: Any, k: int, src: Path, parameters: int) -> None:
    """Every KV pair of the source, with the widths that grow scaled by k (head and RoPE dimensions
    are unchanged), the file type F16 and the widening recorded."""
    from gguf import GGUFValueType

    scaled = {*_SCALED, _SCALED_KV}
    factor, source = k, src.name
    if _FACTOR_KEY in reader.fields:  # a stand-in widened again: the factor from the original
        factor *= int(reader.fields[_FACTOR_KEY].contents())
        source = _value(reader.fields[_SOURCE_KEY]).decode(errors="replace")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", _FACTOR_KEY, _SOURCE_KEY):
            continue  # the writer writes the header and the architecture itself
        value, vtype, sub_type = kv_entry(field)
        if key in scaled:
            value = _scaled(value, k)
        elif key == "general.file_type":  # written with its own type, whatever type the source gave it
            value, vtype = 1, GGUFValueType.UINT32  # LLAMA_FTYPE_MOSTLY_F16: every matrix is F16, vectors F32
        elif key == "general.size_label":
            value, vtype = _label(parameters).encode(), GGUFValueType.STRING
        elif key == "general.alignment":
            writer.data_alignment = int(value)
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    writer.add_key_value(_FACTOR_KEY, factor, GGUFValueType.UINT32)
    writer.add_key_value(_SOURCE_KEY, source.encode(), GGUFValueType.STRING)


def _check_space(folder: Path, nbytes: int) -> None:
    make_folder(folder, "the output folder")
    free = shutil.disk_usage(folder).free
    if free < nbytes:
        raise MtadEdgeError(f"{folder} has {free / 1e9:.1f} GB free; the stand-in needs {nbytes / 1e9:.1f} GB")


def widen(src: Path, k: int, dest: Path, say: Progress = lambda s: None, *, overwrite: bool = False) -> Widened:
    """Write ``src`` (a Llama GGUF with F16/F32/BF16 weights) widened ``k`` times to ``dest`` as F16
    (vectors F32), one tensor at a time, under a temporary name renamed when complete (with the
    project's ``.sha256`` stamp beside it). Bad input is a one-line ``MtadEdgeError``."""
    src, dest = Path(src), Path(dest)
    check_factor(k)
    if dest.exists() and not overwrite:
        raise MtadEdgeError(f"{dest} exists; pass --overwrite to replace it")
    reader = _read(src)
    return _write(reader, _plan(reader, src, k), src, k, dest, say)


def _write(
    reader: Any, plans: list[_Plan], src: Path, k: int, dest: Path, say: Progress, stamp: bool = True
) -> Widened:
    """The widened file, written at ``dest`` once complete; ``stamp``: with its sha256 and the
    project's stamp (an intermediate F16 file about to be quantized needs neither)."""
    from gguf import GGUFWriter

    parameters = sum(int(np.prod(p.shape)) for p in plans)
    source_parameters = sum(int(t.n_elements) for t in reader.tensors)
    total = sum(p.nbytes for p in plans)
    _check_space(dest.parent, total)
    sizes = f"{_label(source_parameters)} -> {_label(parameters)} parameters, {total / 1e9:.2f} GB"
    say(f"widening {src.name} {k}x: {sizes}")
    tmp = tmp_name(dest)
    writer = GGUFWriter(tmp, "llama")
    try:
        _metadata(reader, writer, k, src, parameters)
        for p in plans:
            writer.add_tensor_info(p.name, p.shape, np.dtype(p.dtype), p.nbytes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done, shown = 0, 0
        for p in plans:
            data = p.make()
            if data.shape != p.shape or data.dtype != np.dtype(p.dtype):  # a planning bug, never a bad file
                raise AssertionError(f"{p.name}: made {data.dtype}{data.shape}, planned {p.dtype}{p.shape}")
            writer.write_tensor_data(data)
            done += p.nbytes
            if done * 10 // total > shown:
                shown = done * 10 // total
                say(f"widened {done / 1e9:.2f} of {total / 1e9:.2f} GB")
        writer.close()
        if stamp:
            say(f"checksumming {dest.name}")
            digest = finish(tmp, dest)
        else:
            os.replace(tmp, dest)
            digest = ""
    finally:
        writer.close()
        drop(tmp)
    return Widened(dest, k, parameters, source_parameters, digest)


# -- a stand-in pair ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StandinExport:
    target: Path  # the GGUF to widen
    factor: int
    out: Path
    aux: Optional[Path] = None  # the draft model, hard-linked (else copied) beside the stand-in
    outtype: str = "f16"  # f16, or q8_0: the F16 result quantized by llama.cpp
    name: Optional[str] = None  # default: the out folder's name
    overwrite: bool = False
    context_size: int = 2048
    chat_template: Optional[dict[str, Any]] = None  # default: the GGUF's own


def standin_job(
    target: str,
    factor: int,
    out: Path,
    aux: Optional[str] = None,
    say: Progress = lambda s: None,
    **options: Any,
) -> StandinExport:
    """The job for --target as a GGUF path (or ``hf:`` reference), else as a pair name or manifest
    whose target is widened and whose aux goes beside it (``aux`` replaces it; the pair's context
    size and chat template are kept). ``options``: the other StandinExport fields."""
    from mtad_edge.pairs import resolve

    check_factor(factor)  # before a pair is prepared
    p = Path(target)
    if target.startswith("hf:") or p.suffix.lower() == ".gguf" or (p.is_file() and p.suffix.lower() != ".json"):
        pair = resolve(target=target, aux=aux, say=say)
        assert pair.target is not None
        return StandinExport(pair.target, factor, Path(out), pair.aux, **options)
    pair = resolve(pair=target, say=say)
    assert pair.target is not None and pair.manifest is not None
    m = pair.manifest
    options = {"context_size": m.context_size, "chat_template": m.data.get("chat_template"), **options}
    return StandinExport(pair.target, factor, Path(out), resolve(aux=aux).aux if aux else pair.aux, **options)


def _vocab_size(reader: Any) -> Optional[int]:
    """The manifest's vocab_size: llama.vocab_size where it is an integer the schema takes (a string
    there was a traceback), else the number of token texts; None when neither is."""
    vocab = reader.fields.get("llama.vocab_size")
    value = vocab.contents() if vocab is not None and len(vocab.types) == 1 and int_range(vocab.types[0]) else None
    if isinstance(value, int) and 1 <= value <= CONTEXT_SIZE_MAX:
        return value
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return (len(tokens.data) or None) if tokens is not None else None


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dest)


def export_standin(job: StandinExport, say: Progress = lambda s: None) -> Path:
    """Widen the target into ``job.out`` with the aux beside it and a manifest written last.
    Every input is checked before anything is written. Returns the manifest path."""
    check_factor(job.factor)
    if job.outtype not in OUTTYPES:
        raise MtadEdgeError(f"--outtype {job.outtype!r}: not one of {', '.join(OUTTYPES)}")
    src = Path(job.target)
    reader = _read(src)
    plans = _plan(reader, src, job.factor)  # the source's checks, before the aux and the output's
    source_name = src.name
    vocab_size = _vocab_size(reader)
    if job.aux is None:
        raise MtadEdgeError("a stand-in pair needs an aux: give a pair as --target, or --aux PATH")
    aux = Path(job.aux)
    if not aux.is_file():
        raise MtadEdgeError(f"aux {aux}: no such file")
    manifest_path = job.out / "manifest.json"
    if manifest_path.exists() and not job.overwrite:
        raise MtadEdgeError(f"{manifest_path} exists; pass --overwrite to replace the stand-in")
    nbytes = sum(p.nbytes for p in plans)
    _check_space(job.out, nbytes + (nbytes * 17 // 32 if job.outtype == "q8_0" else 0))  # q8_0: F16, then 34/64 of it
    name = job.name or job.out.resolve().name
    ftype = job.outtype.upper()
    target_file = f"{name}-target-{ftype}.gguf"
    aux_file = aux.name if aux.name != target_file else f"aux-{aux.name}"
    with staging(job.out) as stage:
        f16 = stage / f"{name}-target-F16.gguf"
        widened = _write(reader, plans, src, job.factor, f16, say, stamp=job.outtype == "f16")
        digest, tool = widened.sha256, "mtad_edge.export.widen"
        if job.outtype == "q8_0":
            say(f"quantizing {widened.path.name} to Q8_0")
            digest, tool = (
                quantize(widened.path, stage / target_file, "Q8_0"),
                tool + " + llama_cpp.llama_model_quantize",
            )
            widened.path.unlink()
        _link_or_copy(aux, stage / aux_file)
        label = _label(widened.parameters)
        manifest = {
            "schema": 1,
            "name": name,
            "description": (
                f"stand-in: the text of {source_name}{' quantized to ' + ftype if ftype != 'F16' else ''}, "
                f"at the cost of a ~{label}-parameter {ftype} model (widened {job.factor}x); not a {label} model"
            ),
            "architecture": "llama",
            **({"vocab_size": vocab_size} if vocab_size else {}),
            "context_size": job.context_size,
            "chat_template": job.chat_template or {"source": "gguf", "key": "tokenizer.chat_template"},
            "standin": {"factor": job.factor, "of": source_name, "parameters": widened.parameters},
            "source": {"kind": "local", "file": target_file, "widened_from": str(src.resolve())},
            "target": {
                "file": target_file,
                "sha256": digest,
                "derive": {"tool": tool, "factor": job.factor, "of": source_name, "ftype": ftype},
            },
            "aux": {"file": aux_file, "sha256": sha256_file(stage / aux_file), "copied_from": str(aux.resolve())},
        }
        say(f"publishing {target_file} and {aux_file} in {job.out}")
        return publish(stage, job.out, [target_file, aux_file], manifest)
