"""Random-weight Llama GGUFs at real models' shapes, for checks and cost tables on a machine the
real weights cannot travel to (a lent GPU: see scripts/gpu-check.sh and docs/gpu.md).

A file's cost depends on its shape and tensor types, not on its values, so random weights time
like the real model. Two kinds of weights:

- ``normal``: Gaussian weights from a seed per tensor, stored F16 or quantized from the same
  floats (so a Q4_0 aux is the F16 target's own quantization, and drafts are mostly accepted).
  The blocks are weak beside the embedding and the output matrix is the embedding with its rows
  permuted (so the file is untied), so the logits are peaked: the permutation's successor of the
  last token leads by ~10, with context moving the rest. Greedy decoding has no near-ties, and
  sampling at T=1 still spreads.
- ``bytes``: quantized blocks filled with random bytes and fixed block scales, written without
  any float pass (an 8B model in seconds); for timing only.

The tokenizer comes from a vocabulary GGUF (``vocab`` writes one from any GGUF: only its
``tokenizer.*`` keys); a shape with more tokens than it has is padded with control tokens.
"""

from __future__ import annotations

import argparse
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from mtad_edge.runtime.errors import MtadEdgeError


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    tied: bool  # no output matrix: the embedding is read back as it
    rope_base: float
    n_ctx_train: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


SHAPES = {
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, 49152, True, 100000.0, 8192),
    "llama-3.2-1b": Shape(2048, 16, 32, 8, 8192, 128256, True, 500000.0, 131072),
    "llama-3.1-8b": Shape(4096, 32, 32, 8, 14336, 128256, False, 500000.0, 131072),
    "llama-3.1-70b": Shape(8192, 80, 64, 8, 28672, 128256, False, 500000.0, 131072),
    # Qwen2.5's sizes in Llama's layout (its q/k/v biases left out: a vector add a layer, no weight traffic)
    "qwen2.5-32b": Shape(5120, 64, 40, 8, 27648, 152064, False, 1000000.0, 32768),
    "qwen2.5-0.5b": Shape(896, 24, 14, 2, 4864, 151936, True, 1000000.0, 32768),
}
FILE_TYPES = {"f16": 1, "q4_0": 2, "q4_k_m": 15}  # llama.cpp's llama_ftype for general.file_type
WEIGHT_STD = 0.02  # the usual initialisation's spread: embeddings, and the bytes kind's blocks
BLOCK_STD = 0.002  # normal weights' block matrices: each layer moves the residual a few % of the embedding
RMS_EPS = 1e-5
BYTES_POOL_BLOCKS = 4096  # random blocks generated per tensor, then repeated to its size
CONTROL = 3  # llama.cpp's token type for the padding tokens


def _tensors(s: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of the plain Llama layout, numpy (out, in) order, in llama.cpp's file order."""
    yield "token_embd.weight", (s.n_vocab, s.n_embd)
    yield "output_norm.weight", (s.n_embd,)
    if not s.tied:
        yield "output.weight", (s.n_vocab, s.n_embd)
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    for i in range(s.n_layer):
        yield f"blk.{i}.attn_norm.weight", (s.n_embd,)
        yield f"blk.{i}.attn_q.weight", (q, s.n_embd)
        yield f"blk.{i}.attn_k.weight", (kv, s.n_embd)
        yield f"blk.{i}.attn_v.weight", (kv, s.n_embd)
        yield f"blk.{i}.attn_output.weight", (s.n_embd, q)
        yield f"blk.{i}.ffn_norm.weight", (s.n_embd,)
        yield f"blk.{i}.ffn_gate.weight", (s.n_ff, s.n_embd)
        yield f"blk.{i}.ffn_up.weight", (s.n_ff, s.n_embd)
        yield f"blk.{i}.ffn_down.weight", (s.n_embd, s.n_ff)


def _more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M keeps at Q6_K for attn_v and ffn_down."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def tensor_type(name: str, ftype: str, n_layer: int, tied: bool, cols: int = 256) -> str:
    """The ggml type of a 2-D tensor of rows ``cols`` long in a file of ``ftype`` (llama-quantize's
    choices for Q4_K_M, with its fallbacks where a row is not whole 256-weight blocks: Qwen2.5-0.5B's 896)."""
    if ftype != "q4_k_m":
        return ftype
    kind = "q4_k"
    if name == "output.weight" or (name == "token_embd.weight" and tied):  # a tied embedding is the output too
        kind = "q6_k"
    parts = name.split(".")
    if len(parts) == 4 and parts[2] in ("attn_v", "ffn_down") and _more_bits(int(parts[1]), n_layer):
        kind = "q6_k"
    return kind if cols % 256 == 0 else {"q4_k": "q5_0", "q6_k": "q8_0"}[kind]


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


# A block of each type filled with random quants and fixed scales that give weights d * (q - centre)
# about WEIGHT_STD wide: (bytes per block, weights per block, fixed fields as (offset, bytes)).
Q4_D = 2**-8  # Q4_0 / Q4_K: d * (q - 8), q in 0..15: a spread of ~0.018
Q6_D = 2**-9  # Q6_K: d * (q - 32), q in 0..63: ~0.036
Q5_D = 2**-9  # Q5_0: d * (q - 16), q in 0..31: ~0.018
Q8_D = 2**-12  # Q8_0: d * q, q in -128..127: ~0.018


def _f16(value: float) -> bytes:
    return np.float16(value).tobytes()


_Q4K_SCALES = bytes([1] * 4 + [8] * 4 + [0x81] * 4)  # every sub-block: scale 1, min 8 (so d * (q - 8))
_BLOCKS: dict[str, tuple[int, int, list[tuple[int, bytes]]]] = {
    "q4_0": (18, 32, [(0, _f16(Q4_D))]),
    "q4_k": (144, 256, [(0, _f16(Q4_D)), (2, _f16(Q4_D)), (4, _Q4K_SCALES)]),
    "q6_k": (210, 256, [(192, bytes([1] * 16)), (208, _f16(Q6_D))]),
    "q5_0": (22, 32, [(0, _f16(Q5_D))]),
    "q8_0": (34, 32, [(0, _f16(Q8_D))]),
}


def _random_blocks(kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    nbytes, per, fixed = _BLOCKS[kind]
    rows, cols = shape
    if cols % per:
        raise MtadEdgeError(f"a row of {cols} weights is not a whole number of {kind} blocks")
    pool = rng.integers(0, 256, size=(BYTES_POOL_BLOCKS, nbytes), dtype=np.uint8)
    for offset, value in fixed:
        pool[:, offset : offset + len(value)] = np.frombuffer(value, dtype=np.uint8)
    blocks = np.resize(pool, (rows * cols // per, nbytes))
    return blocks.reshape(rows, cols // per * nbytes)


def _qtype(kind: str) -> Any:
    from gguf import GGMLQuantizationType

    return getattr(GGMLQuantizationType, kind.upper())


def _vocabulary(vocab: Path) -> dict[str, Any]:
    """The ``tokenizer.*`` fields of a GGUF, as GGUFWriter takes them (with their value types)."""
    from gguf import GGUFReader

    from mtad_edge.export.widen import kv_entry

    if not vocab.is_file():
        raise MtadEdgeError(f"{vocab}: no such file")
    reader = GGUFReader(vocab)
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        out[key] = kv_entry(field)
    if "tokenizer.ggml.tokens" not in out:
        raise MtadEdgeError(f"{vocab} holds no tokenizer (no tokenizer.ggml.tokens)")
    return out


def _padded(fields: dict[str, Any], n_vocab: int) -> dict[str, Any]:
    tokens, main, sub = fields["tokenizer.ggml.tokens"]
    if len(tokens) > n_vocab:
        raise MtadEdgeError(f"the vocabulary has {len(tokens)} tokens, more than the shape's {n_vocab}")
    extra = n_vocab - len(tokens)
    if extra:
        fields = dict(fields)
        fields["tokenizer.ggml.tokens"] = (tokens + [f"<|pad_{i}|>".encode() for i in range(extra)], main, sub)
        types, tmain, tsub = fields["tokenizer.ggml.token_type"]
        fields["tokenizer.ggml.token_type"] = (list(types) + [CONTROL] * extra, tmain, tsub)
        if "tokenizer.ggml.scores" in fields:
            scores, smain, ssub = fields["tokenizer.ggml.scores"]
            fields["tokenizer.ggml.scores"] = (list(scores) + [0.0] * extra, smain, ssub)
    return fields


def write_vocab(src: Path, out: Path) -> Path:
    """A GGUF holding only ``src``'s tokenizer (a few MB): what ``write_model`` needs to travel."""
    from gguf import GGUFWriter

    fields = _vocabulary(src)
    writer = GGUFWriter(str(out), "llama")
    for key, (value, main, sub) in fields.items():
        writer.add_key_value(key, value, main, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_model(shape: str, ftype: str, weights: str, vocab: Path, out: Path, seed: int = 0, n_layer: int = 0) -> Path:
    """A random-weight GGUF of ``shape`` (a SHAPES name; ``n_layer`` > 0 overrides its depth)."""
    from gguf import GGUFWriter, quants

    if shape not in SHAPES:
        raise MtadEdgeError(f"unknown shape {shape!r} (choose from {', '.join(SHAPES)})")
    if ftype not in FILE_TYPES:
        raise MtadEdgeError(f"unknown file type {ftype!r} (choose from {', '.join(FILE_TYPES)})")
    if weights not in ("normal", "bytes"):
        raise MtadEdgeError(f"unknown weights {weights!r} (choose from normal, bytes)")
    if weights == "bytes" and ftype == "f16":
        raise MtadEdgeError("random bytes make quantized blocks only: use --weights normal for f16")
    s = SHAPES[shape]
    if n_layer > 0:
        s = replace(s, n_layer=n_layer)
    writer = GGUFWriter(str(out), "llama")
    writer.add_name(f"random {shape} ({weights} weights, seed {seed})")
    writer.add_context_length(s.n_ctx_train)
    writer.add_embedding_length(s.n_embd)
    writer.add_block_count(s.n_layer)
    writer.add_feed_forward_length(s.n_ff)
    writer.add_head_count(s.n_head)
    writer.add_head_count_kv(s.n_head_kv)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_rope_freq_base(s.rope_base)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_vocab_size(s.n_vocab)
    writer.add_file_type(FILE_TYPES[ftype])
    for key, (value, main, sub) in _padded(_vocabulary(vocab), s.n_vocab).items():
        writer.add_key_value(key, value, main, sub_type=sub)
    if weights == "normal":
        if ftype not in ("f16", "q4_0"):
            raise MtadEdgeError(f"normal weights are written f16 or q4_0, not {ftype}: use --weights bytes")
        s = replace(s, tied=False)
    for name, dims in _tensors(s):
        rng = _rng(seed, name)
        if len(dims) == 1:
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))
            continue
        kind = tensor_type(name, ftype, s.n_layer, s.tied, dims[-1])
        if weights == "bytes":
            writer.add_tensor(name, _random_blocks(kind, dims, rng), raw_dtype=_qtype(kind))
            continue
        if name == "output.weight":  # the embedding, rows permuted: token j's logit is the match of pi(j)
            embd = _rng(seed, "token_embd.weight").standard_normal(dims, dtype=np.float32) * WEIGHT_STD
            w = embd[rng.permutation(dims[0])].astype(np.float16)
        else:
            std = WEIGHT_STD if name == "token_embd.weight" else BLOCK_STD
            w = (rng.standard_normal(dims, dtype=np.float32) * std).astype(np.float16)
        if kind == "f16":
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, quants.quantize(w.astype(np.float32), _qtype(kind)), raw_dtype=_qtype(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m mtad_edge.bench.shapes", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("vocab", help="write a GGUF holding only a model's tokenizer")
    v.add_argument("src", type=Path)
    v.add_argument("out", type=Path)
    m = sub.add_parser("model", help="write a random-weight GGUF of a real model's shape")
    m.add_argument("shape", choices=sorted(SHAPES))
    m.add_argument("ftype", choices=sorted(FILE_TYPES))
    m.add_argument("out", type=Path)
    m.add_argument("--vocab", type=Path, required=True)
    m.add_argument("--weights", choices=("normal", "bytes"), default="normal")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--layers", type=int, default=0)
    a = p.parse_args(argv)
    try:
        if a.command == "vocab":
            print(write_vocab(a.src, a.out))
        else:
            print(write_model(a.shape, a.ftype, a.weights, a.vocab, a.out, a.seed, a.layers))
    except MtadEdgeError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
