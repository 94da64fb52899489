"""Backend on ONNX Runtime over an optimum-exported decoder folder (model.onnx + tokenizer files).

Inputs ``input_ids``, ``attention_mask``, ``position_ids`` (when the export has it; Gemma 3 has
not) and ``past_key_values.N.key/value``; outputs ``logits`` and ``present.N.*``. Each sequence
keeps its own KV tensors (1, kv_heads, T, head_dim), on the host or on the device (ort_kv.py);
onnxruntime returns fresh tensors every run, so rolling back is a cut and copying a sequence
shares references. Sequences that get the same number of new tokens on the same past length
(draft beams) run together as batch rows.
"""

from __future__ import annotations

import importlib
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..backend import Batch, Segments, VocabInfo, check_model_file, check_trained_context
from ..errors import ModelLoadError, MtadEdgeError, first_line, json_int, json_problem, quoted
from ..text.chat import render
from ..text.special import Special, SpecialTokens, tokenize
from ..text.vocab import piece_bytes
from .guard import ModelFacts, check_loads
from .ort_kv import DeviceKV, HostKV


@dataclass(frozen=True)
class OrtConfig:
    n_ctx: int = 2048
    n_seq_max: int = 1
    n_threads: Optional[int] = None
    provider: str = "auto"  # auto | cpu | cuda
    io_binding: Optional[bool] = None  # keep KV caches on the device; None = when the provider is CUDA
    # Idle worker threads spin-wait for the next run: faster for a model alone, but in a pair the
    # spinning steals the cores the other model needs (docs/backends.md). The loader spins only
    # when it loads a target alone.
    spin: bool = True
    positions: Optional[int] = None  # the tokens a run commits (n_ctx less draft cells), for the trained bound
    model_facts: Optional[ModelFacts] = None  # what earlier processes derived about the model (backends/guard.py)


def _require(*names: str) -> list[Any]:
    """Import the named packages of the ONNX Runtime backend, or say which extra installs them."""
    try:
        return [importlib.import_module(n) for n in names]
    except ImportError as e:
        raise ModelLoadError(
            f"the ONNX Runtime backend needs {e.name or names[0]}: "
            "pip install 'mtad-edge[onnx]' (or 'mtad-edge[onnx-gpu]' for CUDA)"
        ) from None


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a model folder, or a one-line ModelLoadError (a model folder is untrusted)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ModelLoadError(f"cannot read {path}: {json_problem(e) if not isinstance(e, OSError) else e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _kv_shape(cfg: dict[str, Any], path: Path) -> tuple[int, int]:
    """(KV heads, head dimension) from a Hugging Face config, checked: a model folder is untrusted."""

    def positive(key: str, default: Any = None) -> int:
        value = cfg.get(key, default)
        if not json_int(value, 1):
            raise ModelLoadError(f"{path}: {key} must be a positive integer, not {quoted(value)}")
        return value

    heads = positive("num_attention_heads")
    kv_heads = positive("num_key_value_heads", heads)
    head_dim = positive("head_dim") if cfg.get("head_dim") else positive("hidden_size") // heads
    if head_dim < 1:
        raise ModelLoadError(f"{path}: hidden_size is smaller than num_attention_heads")
    return kv_heads, head_dim


def _token_text(tcfg: dict[str, Any], key: str, folder: Path) -> Optional[str]:
    """A special token named in tokenizer_config.json: a string, an AddedToken's content, or none."""
    value = tcfg.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ModelLoadError(f"{folder / 'tokenizer_config.json'}: {key} must be a token's text, not {quoted(value)}")
    return value or None


def _added_tokens(tokenizer: dict[str, Any], folder: Path) -> list[Special]:
    """tokenizer.json's added tokens as special tokens: a "special" one is a control token, the
    others are cut out of any text (as Hugging Face's tokenizers cut every added token out)."""
    out = []
    for t in tokenizer.get("added_tokens") or []:
        if not isinstance(t, dict) or not json_int(t.get("id"), 0) or not isinstance(t.get("content"), str):
            raise ModelLoadError(f"{folder / 'tokenizer.json'}: an added token needs an integer id and text content")
        out.append(Special(t["id"], t["content"], bool(t.get("special")), bool(t.get("lstrip")), bool(t.get("rstrip"))))
    return out


class OrtBackend:
    def __init__(self, model_dir: str | os.PathLike[str], config: OrtConfig = OrtConfig()):
        ort, tokenizers, _ = _require("onnxruntime", "tokenizers", "jinja2")  # jinja2: chat templates

        d = Path(model_dir)
        self.path = d / "model.onnx" if d.is_dir() else d
        d = self.path.parent
        if not self.path.exists() and not self.path.is_symlink():
            raise ModelLoadError(f"no ONNX model at {self.path}")
        check_model_file(self.path)
        check_loads("onnx", self.path, config.model_facts)  # where onnxruntime crashes, a child dies, not us
        opts = ort.SessionOptions()
        if config.n_threads:
            opts.intra_op_num_threads = config.n_threads
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if config.spin else "0")
        providers = ["CPUExecutionProvider"]
        if config.provider in ("auto", "cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        elif config.provider == "cuda":
            raise ModelLoadError(
                "--provider cuda: this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)"
            )
        try:
            self._sess = ort.InferenceSession(str(self.path), opts, providers=providers)
            self._tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:
            raise ModelLoadError(f"onnxruntime could not load {self.path}: {first_line(e)}") from None
        providers = self._sess.get_providers()  # what the session got: CUDA falls back to CPU without a GPU
        if config.provider == "cuda" and providers[0] != "CUDAExecutionProvider":
            raise ModelLoadError(
                "--provider cuda: onnxruntime could not start CUDA (no GPU, or its CUDA/cuDNN libraries are missing)"
            )
        cfg = _read_json(d / "config.json")
        tcfg = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
        trained = cfg.get("max_position_embeddings")
        check_trained_context(d, config.positions or config.n_ctx, trained if isinstance(trained, int) else 0)
        self._tcfg = tcfg
        inputs = self._sess.get_inputs()
        self._inputs = {i.name for i in inputs}
        past = [i for i in inputs if i.name.startswith("past_key_values.")]
        shape = _kv_shape(cfg, d / "config.json")
        dtype = np.float16 if past and past[0].type == "tensor(float16)" else np.float32
        on_device = config.io_binding if config.io_binding is not None else providers[0] != "CPUExecutionProvider"
        self._store: HostKV | DeviceKV
        if on_device:
            _require("onnx")  # builds DeviceKV's cache graphs
            device = "cuda" if providers[0] == "CUDAExecutionProvider" else "cpu"
            self._store = DeviceKV(self._sess, [i.name for i in past], shape, dtype, device, providers)
        else:
            self._store = HostKV(self._sess, [i.name for i in past], shape, dtype)
        self.provider, self.io_binding = providers[0], on_device
        self.n_ctx, self.n_seq_max = config.n_ctx, config.n_seq_max
        self.n_positions = min(config.positions or config.n_ctx, config.n_ctx)
        self.n_batch = config.n_ctx  # any number of rows: long inputs are chunked in decode
        self.n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self._chunk = max(8, (32 << 20) // self.n_vocab)  # tokens per run: 32M float logits at most
        specials = {t: _token_text(tcfg, t, d) for t in ("bos_token", "eos_token")}
        self._special = {t: self._tok.token_to_id(v) for t, v in specials.items() if v}
        eos = cfg.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if not all(json_int(t) for t in eos_ids):
            raise ModelLoadError(f"{d / 'config.json'}: eos_token_id must be a token id or a list of them")
        self._eog = set(eos_ids)
        if self._special.get("eos_token") is not None:
            self._eog.add(self._special["eos_token"])
        tj = _read_json(d / "tokenizer.json")
        self._byte_level = (tj.get("decoder") or {}).get("type") == "ByteLevel"
        self._control = {t["id"] for t in tj.get("added_tokens", []) if t.get("special")}
        self._specials = SpecialTokens(_added_tokens(tj, d))
        self._tok.encode_special_tokens = True  # special tokens are cut out by runtime/text/special.py, not here
        self._kv: dict[int, list[np.ndarray]] = {}
        self._hist: dict[int, list[int]] = {}

    # -- vocabulary -------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        return self.tokenize_segments([(text, special)], add_special)

    def tokenize_segments(self, segments: Segments, add_special: bool = True, limit: Optional[int] = None) -> list[int]:
        ids = tokenize(self, segments, add_special=False, limit=limit)
        bos = self._special.get("bos_token")
        if add_special and self._tcfg.get("add_bos_token") and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def tokenize_raw(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def special_tokens(self) -> SpecialTokens:
        return self._specials

    def token_bytes(self, token: int) -> bytes:
        if int(token) in self._control:
            return b""  # special tokens print nothing, as llama.cpp does
        return piece_bytes(self._tok.id_to_token(int(token)) or "", self._byte_level)

    def is_eog(self, token: int) -> bool:
        return int(token) in self._eog

    def vocab_info(self) -> VocabInfo:
        model = json.loads(self._tok.to_str())["model"]
        kind = model["type"].lower()  # SentencePiece models (Unigram, or BPE with byte fallback) are llama.cpp's "spm"
        kind = "spm" if kind == "unigram" or (kind == "bpe" and model.get("byte_fallback")) else kind
        return VocabInfo(
            kind=kind,
            n_tokens=self.n_vocab,
            bos=self._special.get("bos_token", -1),
            eos=self._special.get("eos_token", -1),
            add_bos=bool(self._tcfg.get("add_bos_token")),
            text=lambda i: (self._tok.id_to_token(i) or "").encode("utf-8"),
        )

    def chat_template_text(self) -> Optional[str]:
        """The model folder's chat template (tokenizer_config.json's, or chat_template.jinja)."""
        tmpl = self._tcfg.get("chat_template")
        d = self.path.parent
        if not tmpl and (d / "chat_template.jinja").is_file():
            tmpl = (d / "chat_template.jinja").read_text()
        return tmpl if isinstance(tmpl, str) and tmpl else None

    def apply_chat_template(
        self, messages: list[dict[str, str]], template: Optional[str] = None, add_assistant: bool = True
    ) -> str:
        d = self.path.parent
        tmpl = template or self._tcfg.get("chat_template")
        if not tmpl and (d / "chat_template.jinja").is_file():
            tmpl = (d / "chat_template.jinja").read_text()
        if not tmpl:
            raise ModelLoadError(f"{d} has no chat template")
        tok: dict[str, str] = {
            k: (v if isinstance(v, str) else v.get("content"))
            for k, v in self._tcfg.items()
            if k in ("bos_token", "eos_token") and v
        }
        return render(tmpl, messages, add_assistant, None, **tok)

    # -- evaluation -------------------------------------------------------------------------------
    def decode(self, batch: Batch) -> np.ndarray:
        per_seq: dict[int, list[int]] = defaultdict(list)  # seq -> batch rows, in order
        for i, ids in enumerate(batch.seq_ids):
            for s in ids:
                per_seq[s].append(i)
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)  # (past, new) -> seqs run together
        for s, rows in per_seq.items():
            past = len(self._hist.get(s, []))
            if [batch.pos[i] for i in rows] != list(range(past, past + len(rows))):
                raise MtadEdgeError(f"sequence {s}: tokens must continue at position {past}")
            if past + len(rows) > self.n_ctx:
                raise MtadEdgeError(f"sequence {s}: context of {self.n_ctx} tokens is full")
            groups[(past, len(rows))].append(s)
        logits_of: dict[int, np.ndarray] = {}
        for (past, n), seqs in groups.items():
            # The graph returns logits for every new token: run long inputs in chunks so that a
            # prompt costs at most about 128 MB of logits at a time (Gemma: 262144 per token).
            step = max(1, self._chunk // len(seqs))
            for lo in range(0, n, step):
                rows_of = [per_seq[s][lo : lo + step] for s in seqs]
                out = self._run(seqs, [[batch.tokens[i] for i in rows] for rows in rows_of], past + lo)
                for rows, logits in zip(rows_of, out):
                    for j, i in enumerate(rows):
                        if batch.logits[i] and i not in logits_of:
                            logits_of[i] = logits[j].copy() if n > step else logits[j]
            for s in seqs:
                self._hist.setdefault(s, []).extend(batch.tokens[i] for i in per_seq[s])
        wanted = [i for i, w in enumerate(batch.logits) if w]
        return np.stack([logits_of[i] for i in wanted]) if wanted else np.empty((0, self.n_vocab), np.float32)

    def _run(self, seqs: list[int], tokens: list[list[int]], past: int) -> np.ndarray:
        b, n = len(seqs), len(tokens[0])
        feed = {"input_ids": np.array(tokens, dtype=np.int64), "attention_mask": np.ones((b, past + n), dtype=np.int64)}
        if "position_ids" in self._inputs:
            feed["position_ids"] = np.tile(np.arange(past, past + n, dtype=np.int64), (b, 1))
        caches = [self._kv.get(s) or self._store.empty() for s in seqs]
        logits, presents = self._store.run(feed, caches[0] if b == 1 else self._store.batch(caches))
        for k, s in enumerate(seqs):
            self._kv[s] = presents if b == 1 else self._store.row(presents, k)
        return logits

    def held(self, seq: int) -> list[int]:
        return self._hist.get(seq, [])

    def copy_seq(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        hist, kv = self._hist.get(src, []), self._kv.get(src)
        lo, hi = max(p0, 0), (len(hist) if p1 < 0 else p1)
        mine = self._hist.get(dst, [])
        if lo > len(mine):
            raise MtadEdgeError(f"copy into sequence {dst} would leave a hole at {len(mine)}")
        self._hist[dst] = mine[:lo] + hist[lo:hi]
        if kv is None:
            return
        own = self._kv.get(dst)
        if lo == 0 and hi == len(hist):
            self._kv[dst] = kv  # whole caches are never written in place: share them
        elif lo == 0 or own is None:
            self._kv[dst] = self._store.cut(kv, 0, hi)
        else:
            self._kv[dst] = self._store.join(self._store.cut(own, 0, lo), self._store.cut(kv, lo, hi))

    def rollback(self, seq: int, n_keep: int) -> None:
        hist = self._hist.get(seq, [])
        if n_keep >= len(hist):
            return
        del hist[n_keep:]
        if seq in self._kv:
            self._kv[seq] = self._store.cut(self._kv[seq], 0, n_keep) if n_keep else self._store.empty()

    def clear(self) -> None:
        self._kv.clear()
        self._hist.clear()

    def close(self) -> None:
        self._kv.clear()
        self._sess = None

    def __enter__(self) -> OrtBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
