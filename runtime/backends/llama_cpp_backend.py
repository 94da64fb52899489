"""Backend on llama-cpp-python's low-level ctypes API (llama.h), not ``Llama.generate``.

Layers: ``llama_cpp`` (raw ctypes) -> ``_Log``, ``_BatchBuffer`` (thin owners) ->
``LlamaCppBackend`` (the Backend protocol). llama_cpp is imported lazily so the pure decoding
logic and the CLI's help work without it.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..backend import Batch, Segments, VocabInfo, check_model_file, check_trained_context
from ..errors import ModelLoadError, MtadEdgeError
from ..text.special import Special, SpecialTokens, tokenize
from .amx import VerdictStore, amx_works
from .gguf_header import read_block_count, read_header
from .guard import ModelFacts, check_loads
from .repack import REPACK_BUFFER, Overrides, amx_kinds, placements
from .rpc import Placement, gpu_offload

_VOCAB_KINDS = {0: "none", 1: "spm", 2: "bpe", 3: "wpm", 4: "ugm", 5: "rwkv", 6: "plamo2"}
# llama_token_attr bits (llama.h): the tokens llama.cpp cuts out of text before tokenising it
ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_LSTRIP, ATTR_RSTRIP = 1, 8, 16, 128, 256
SPECIAL_FACT = "special_tokens"  # the special tokens, as kept in the model facts
# Weights repacked for Intel AMX crash llama.cpp's first matrix product of more than one row in
# builds whose compiler drops the AMX tile configuration (llama.cpp #20824 / #26954; here: GCC
# 12's build of llama-cpp-python on a Sapphire-Rapids-class VM), so where the build uses AMX,
# models load without extra buffer types: the repacked kernels are asked for tensor by tensor,
# and the AMX ones only where a child process ran them (runtime/backends/repack.py, runtime/backends/amx.py).
AMX_FLAG = "AMX_INT8 = 1"
# llama.cpp's "auto" turns flash attention on wherever its op runs (llama.cpp #26559). On the CPU
# its kernel pays per cached position and head, which narrow heads do not earn back: measured on
# the 2-core AVX-512 VM (docs/backends.md#flash-attention), with 64-wide heads (SmolLM2, its
# stand-ins) a one-row step cost 2-40 % and a 6-row verify 17-130 % more with it (200-1000 cached
# tokens), with 256-wide heads (Gemma 3) 2-4 % less. Below ~80 cached tokens it is the cheaper one,
# which chats and documents leave early. So on the CPU alone it is off for heads up to:
CPU_FLASH_ATTN_OFF_HEAD = 64


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class LlamaCppConfig:
    n_ctx: int = 2048
    n_batch: int = 512
    n_seq_max: int = 1
    n_threads: Optional[int] = None  # None: all cores we may use
    n_threads_batch: Optional[int] = None  # None: same as n_threads
    n_gpu_layers: int = 0  # -1 offloads every layer (needs a CUDA/Metal build)
    flash_attn: Optional[bool] = None  # None: flash_attention() decides
    positions: Optional[int] = None  # the tokens a run commits (n_ctx less draft cells), for the trained bound
    amx_store: Optional[VerdictStore] = None  # AMX children that crashed in earlier processes (runtime/backends/amx.py)
    # Called mostly a row at a time (the aux): where this build's AMX tiles crash but its one-row
    # kernel runs, quantized matrices go to AMX and every call is made one row at a time.
    one_row: bool = False
    model_facts: Optional[ModelFacts] = None  # what earlier processes derived about the file (backends/guard.py)
    # rpc servers' devices for the layers (runtime/backends/rpc.py); the loader owns it and closes it after the model
    rpc: Optional[Placement] = None


# What a KV cache may take of the machine's memory: beyond it, a context that llama.cpp would
# allocate until the kernel kills the process (a manifest's context_size of 1e20) is refused first.
KV_MEMORY_SHARE = 0.9


class _Log:
    """Routes llama.cpp's log into a ring buffer (so a load failure can quote its reason);
    echoes it to stderr when MTAD_EDGE_VERBOSE is set."""

    recent: collections.deque[str] = collections.deque(maxlen=20)
    _callback = None

    @classmethod
    def install(cls) -> None:
        import llama_cpp

        if cls._callback is not None:
            return
        verbose = bool(os.environ.get("MTAD_EDGE_VERBOSE"))

        def on_log(level: int, text: bytes, _user: Any) -> None:
            msg = text.decode("utf-8", errors="replace")
            if verbose:
                os.write(2, text)
            important = level == 4 or "error" in msg.lower() or "failed" in msg.lower()  # 4: GGML_LOG_LEVEL_ERROR
            if important and msg.strip():
                cls.recent.append(msg.strip())

        cls._callback = llama_cpp.llama_log_callback(on_log)
        llama_cpp.llama_log_set(cls._callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()

    @classmethod
    def reason(cls) -> str:
        """The first error logged since the last ``clear``, without function-name prefixes:
        llama.cpp logs the specific cause first and generic 'failed to load' lines after it."""
        if not cls.recent:
            return "no reason given by llama.cpp"
        return re.sub(r"^(\w+: )+(error loading model: )?(\w+: )*", "", cls.recent[0])


def quiet_llama_logs() -> None:
    """Keep llama.cpp's own log off the terminal (MTAD_EDGE_VERBOSE=1 shows it)."""
    _Log.install()


@functools.cache
def uses_amx() -> bool:
    """Whether this llama.cpp build runs AMX kernels on this CPU (see AMX_FLAG)."""
    import llama_cpp

    return AMX_FLAG in llama_cpp.llama_print_system_info().decode(errors="replace")


def _check_gguf_file(path: Path) -> None:
    check_model_file(path)
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{path} cannot be read as a model file: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it starts with {magic!r}, expected b'GGUF')")


LLAMA_MAX_LAYERS = 512  # llama.cpp's bound on a model's layers


def _check_layers(path: Path) -> None:
    """A block_count llama.cpp takes: on 0 or over LLAMA_MAX_LAYERS it aborts the whole process
    (GGML_ASSERT) while loading, so the GGUF's own count is read first."""
    n = read_block_count(path)
    if n is not None and not 1 <= n <= LLAMA_MAX_LAYERS:
        raise ModelLoadError(
            f"{path} is not a usable model: it declares {n} layers (block_count; 1..{LLAMA_MAX_LAYERS})"
        )


def _physical_memory() -> int:
    """Bytes of physical memory, 0 when the platform does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 0


def flash_attention(asked: Optional[bool], cpu_alone: bool, head: int) -> Optional[bool]:
    """Whether a context gets flash attention: as asked; else off on the CPU alone for heads up
    to CPU_FLASH_ATTN_OFF_HEAD wide; else None (llama.cpp decides)."""
    if asked is not None or not cpu_alone:
        return asked
    return False if 0 < head <= CPU_FLASH_ATTN_OFF_HEAD else None


def _head_sizes(lib: Any, model: Any) -> tuple[int, int]:
    """The widths of a K and a V head as the GGUF gives them (Gemma's 256 is not n_embd / n_head)."""

    def meta_int(key: str) -> int:
        buf = ctypes.create_string_buffer(64)
        arch = buf.value.decode() if lib.llama_model_meta_val_str(model, b"general.architecture", buf, 64) > 0 else ""
        if not arch or lib.llama_model_meta_val_str(model, f"{arch}.{key}".encode(), buf, 64) <= 0:
            return 0
        with contextlib.suppress(ValueError):
            return int(buf.value)
        return 0

    head = lib.llama_model_n_embd(model) // max(1, lib.llama_model_n_head(model))
    return meta_int("attention.key_length") or head, meta_int("attention.value_length") or head


def _kv_bytes_per_cell(lib: Any, model: Any) -> int:
    """An estimate of one KV cell: every layer's K and V rows in F16 (llama.cpp's default cache
    type)."""
    n_head_kv = lib.llama_model_n_head_kv(model) or max(1, lib.llama_model_n_head(model))
    k, v = _head_sizes(lib, model)
    return int(lib.llama_model_n_layer(model) * n_head_kv * (k + v) * 2)


class _BatchBuffer:
    """Owns one llama_batch sized for n_batch tokens with up to n_seq_max seq ids each."""

    def __init__(self, llama_cpp: Any, n_tokens: int, n_seq_max: int):
        self._lib = llama_cpp
        self.capacity = n_tokens
        self.batch = llama_cpp.llama_batch_init(n_tokens, 0, n_seq_max)

    def fill(self, b: Batch, lo: int, hi: int) -> None:
        raw = self.batch
        raw.n_tokens = hi - lo
        for i in range(lo, hi):
            j = i - lo
            raw.token[j] = b.tokens[i]
            raw.pos[j] = b.pos[i]
            seqs = b.seq_ids[i]
            raw.n_seq_id[j] = len(seqs)
            for k, s in enumerate(seqs):
                raw.seq_id[j][k] = s
            raw.logits[j] = b.logits[i]

    def close(self) -> None:
        batch, self.batch = self.batch, None  # forgotten first: never freed twice
        if batch is not None:
            self._lib.llama_batch_free(batch)


def cuda_graphs(llama_cpp: Any) -> bool:
    """Whether this llama.cpp build replays CUDA graphs (its CUDA backend's USE_GRAPHS feature, not
    turned off by GGML_CUDA_DISABLE_GRAPHS): a graph is captured after two calls of one shape."""
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return "USE_GRAPHS = 1" in info and os.environ.get("GGML_CUDA_DISABLE_GRAPHS") is None


class LlamaCppBackend:
    """One GGUF model, one llama_context with ``n_seq_max`` sequences in a unified KV cache."""

    def __init__(self, path: str | os.PathLike[str], config: LlamaCppConfig = LlamaCppConfig()):
        import llama_cpp  # lazy: heavy, and optional for pure-logic users

        self._lib = llama_cpp
        self.path = Path(path)
        self.config = config
        self._model = self._ctx = None
        self._batch: Optional[_BatchBuffer] = None
        self._specials: Optional[SpecialTokens] = None
        self._rpc = config.rpc
        # llama.cpp's calls on a model on rpc servers run with SIGINT/SIGTERM blocked: a signal in
        # one of its receives aborts the process (runtime/backends/signal_shield.py); the guards hear it instead
        self._shield = self._rpc.shielded if self._rpc is not None else contextlib.nullcontext
        _check_gguf_file(self.path)
        _check_layers(self.path)
        check_loads("gguf", self.path, config.model_facts)  # where llama.cpp aborts, a child dies, not us
        quiet_llama_logs()

        _Log.recent.clear()
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = config.n_gpu_layers if config.n_gpu_layers >= 0 else 2**31 - 1
        if self._rpc is not None:
            mparams.devices = self._rpc.devices  # the servers' devices (then local GPUs) for the layers
        self.repacked = 0  # block kinds sent by us to llama.cpp's repacked CPU kernels
        self.amx = 0  # matrix kinds llama.cpp multiplies with AMX, where this build's AMX runs
        amx = uses_amx()
        cpu_alone = config.n_gpu_layers == 0 or not (self._rpc is not None or gpu_offload())
        # its calls replay CUDA graphs where a layer is offloaded by a build with them (aux_shape 'auto')
        self.graphs = not cpu_alone and cuda_graphs(llama_cpp)
        tiles = False
        self.one_row = False  # every call made one row at a time (AMX's one-row kernel, not its tiles)
        if amx and cpu_alone:
            # on the CPU alone: an override would also keep offloaded layers' weights off the GPU
            header = read_header(self.path)
            tiles = amx_works(self.path, header, config.amx_store)
            # A row at a time AMX's VNNI kernel runs even where the tiles crash, at about half the
            # repacked kernels' time per row (several rows a call cost that many calls).
            self.one_row = not tiles and config.one_row and amx_works(self.path, header, None, 1)
            self._overrides = Overrides(llama_cpp, placements(header, amx=tiles or self.one_row))
            if self._overrides.pointer is not None:
                mparams.tensor_buft_overrides = self._overrides.pointer
                self.repacked = self._overrides.named.get(REPACK_BUFFER, 0)
            self.amx = len(amx_kinds(header)) if tiles or self.one_row else 0
        if amx and not (tiles or self.one_row):  # (with them off, AMX-named weights ran no faster than plain)
            mparams.use_extra_bufts = False
        with self._shield():
            self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            self._check_rpc("while the model loaded")  # a lost server explains the failure best
            raise ModelLoadError(f"llama.cpp could not load {self.path}: {_Log.reason()}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        try:
            self._check_rpc("while the model loaded")
            self._check_context(config, cpu_alone)
        except BaseException:
            self.close()
            raise

        threads = config.n_threads or default_threads()
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = config.n_ctx
        cparams.n_batch = cparams.n_ubatch = min(config.n_batch, config.n_ctx)
        cparams.n_seq_max = config.n_seq_max
        cparams.kv_unified = True  # beams share prefix cells; seq_cp is then metadata only
        cparams.n_threads = threads
        cparams.n_threads_batch = config.n_threads_batch or threads
        # what the context runs with: True / False, or None where llama.cpp decided ("auto")
        self.flash_attn = flash_attention(config.flash_attn, cpu_alone, _head_sizes(llama_cpp, self._model)[0])
        if self.flash_attn is not None:
            cparams.flash_attn_type = int(self.flash_attn)
        with self._shield():
            self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            self.close()
            raise ModelLoadError(f"llama.cpp could not create a context for {self.path}: {_Log.reason()}")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self.n_ctx = llama_cpp.llama_n_ctx(self._ctx)
        self.n_positions = min(config.positions or self.n_ctx, self.n_ctx)
        self.n_batch = cparams.n_batch
        self.n_seq_max = config.n_seq_max
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.n_params = int(llama_cpp.llama_model_n_params(self._model))  # the model's size, for reports
        self._batch = _BatchBuffer(llama_cpp, self.n_batch, self.n_seq_max)
        self._views: dict[tuple[int, int], np.ndarray] = {}  # logits views by (address, rows)
        self._last: Optional[np.ndarray] = None  # the last logits returned (last_logits_finite)
        self._history: dict[int, list[int]] = {}  # seq -> tokens by position, for the re-prefill fallback
        self.rollback_fallbacks = 0
        try:
            self.special_tokens()  # at load, not in the first request (read once per file, then kept)
            self._probe()
        except BaseException:
            self.close()
            raise

    def _probe(self) -> None:
        """One token through the model before anyone drafts with it: a GGUF whose header is right
        but whose weights are random bytes loads, then gives NaN logits (and the next decodes
        crash), so non-finite logits are a load error here. The cache is cleared after."""
        bos = self._lib.llama_vocab_bos(self._vocab)
        logits = self.decode(Batch.run([bos if 0 <= bos < self.n_vocab else 0], 0))
        finite = bool(np.isfinite(logits).all())
        self.clear()
        if not finite:
            raise ModelLoadError(
                f"{self.path} is not a usable model: its weights give non-finite logits (corrupt or not "
                "model data); prepare or download it again"
            )

    def _check_rpc(self, when: str) -> None:
        """RpcError where an rpc server of this model's was lost (llama.cpp's call returned on the
        guard's replies, runtime/backends/rpc.py)."""
        if self._rpc is not None:
            self._rpc.check(when)

    def _check_context(self, config: LlamaCppConfig, on_host: bool) -> None:
        """Before llama.cpp allocates the KV cache: the context fits what the model was trained for
        and, when the cache lives in host memory, the machine (n_ctx is 32-bit in llama.cpp: 2^32
        tokens wrapped to a context of 198; 1e20 allocated until the kernel killed the process)."""
        lib, model = self._lib, self._model
        check_trained_context(self.path, config.positions or config.n_ctx, lib.llama_model_n_ctx_train(model))
        memory = _physical_memory()
        if not on_host or not memory:
            return
        need = config.n_ctx * _kv_bytes_per_cell(lib, model)
        if need > KV_MEMORY_SHARE * memory:
            fits = int(KV_MEMORY_SHARE * memory / (need / config.n_ctx))
            raise ModelLoadError(
                f"a context of {config.n_ctx} cells on {self.path.name} needs about {need / 2**30:.1f} GiB of KV "
                f"cache, more than this machine's {memory / 2**30:.1f} GiB of memory allows: give a smaller "
                f"--ctx-size (about {fits} fits)"
            )

    # -- vocabulary ---------------------------------------------------------------------------
    def meta(self, key: str) -> Optional[str]:
        """The GGUF metadata value of ``key`` as llama.cpp prints it (at most 255 bytes), or None."""
        buf = ctypes.create_string_buffer(256)
        if self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf)) <= 0:
            return None
        return buf.value.decode("utf-8", errors="replace")

    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        return tokenize(self, [(text, special)], add_special)

    def tokenize_segments(self, segments: Segments, add_special: bool = True, limit: Optional[int] = None) -> list[int]:
        return tokenize(self, segments, add_special, limit)

    def tokenize_raw(self, text: str) -> list[int]:
        """Text that holds no special token, as llama.cpp tokenises it (runtime/text/special.py cut
        them out: llama.cpp's own cutting is quadratic in their number)."""
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (self._lib.llama_token * cap)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, cap, False, False)
        if n < 0:
            cap = -n
            buf = (self._lib.llama_token * cap)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, cap, False, False)
        return list(buf[:n])

    def special_tokens(self) -> SpecialTokens:
        if self._specials is None:
            self._specials = self._read_specials()
        return self._specials

    def _read_specials(self) -> SpecialTokens:
        """The tokens llama.cpp cuts out of text (control, unknown and user-defined ones) and the
        longest token's text, read once per file and build: asked of llama.cpp token by token,
        Gemma's 262k take about a second."""
        facts = self.config.model_facts
        kept = facts.get("gguf", self.path, SPECIAL_FACT) if facts is not None else None
        if isinstance(kept, dict):
            with contextlib.suppress(TypeError, ValueError, KeyError):
                specials = [
                    Special(int(i), str(t), bool(c), bool(ls), bool(rs)) for i, t, c, ls, rs in kept["specials"]
                ]
                return SpecialTokens(specials, int(kept["max_token_bytes"]))
        lib, vocab, found, longest = self._lib, self._vocab, [], 0
        for i in range(self.n_vocab):
            raw = lib.llama_vocab_get_text(vocab, i) or b""
            longest = max(longest, len(raw))  # its stored text: at least the bytes of text it stands for
            attr = lib.llama_vocab_get_attr(vocab, i)
            if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
                control = bool(attr & (ATTR_UNKNOWN | ATTR_CONTROL))  # else user-defined: cut out everywhere
                text = raw.decode("utf-8", errors="replace")
                found.append(Special(i, text, control, bool(attr & ATTR_LSTRIP), bool(attr & ATTR_RSTRIP)))
        if facts is not None:
            rows = [[s.id, s.text, s.control, s.lstrip, s.rstrip] for s in found]
            facts.put("gguf", self.path, SPECIAL_FACT, {"specials": rows, "max_token_bytes": longest})
        return SpecialTokens(found, longest)

    def token_bytes(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    @property
    def vocab_handle(self) -> Any:
        """llama.cpp's vocabulary of the model (a llama_vocab pointer), for a library that reads it
        through llama.cpp itself (llguidance's tokenizer: runtime/text/constraint.py)."""
        return self._vocab

    def vocab_info(self) -> VocabInfo:
        lib, vocab = self._lib, self._vocab
        return VocabInfo(
            kind=_VOCAB_KINDS.get(lib.llama_vocab_type(vocab), "unknown"),
            n_tokens=self.n_vocab,
            bos=lib.llama_vocab_bos(vocab),
            eos=lib.llama_vocab_eos(vocab),
            add_bos=bool(lib.llama_vocab_get_add_bos(vocab)),
            text=lambda i: lib.llama_vocab_get_text(vocab, i) or b"",
            add_eos=bool(lib.llama_vocab_get_add_eos(vocab)),
        )

    def chat_template_text(self) -> Optional[str]:
        """The GGUF's own chat template (jinja text), or None where it has none."""
        raw = self._lib.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8", "replace") if raw else None

    def apply_chat_template(
        self, messages: list[dict[str, str]], template: Optional[str] = None, add_assistant: bool = True
    ) -> str:
        """Render messages with llama.cpp's template engine: the GGUF's own template, or
        ``template`` (a name llama.cpp knows, e.g. "chatml", "gemma", or a template text)."""
        tmpl = template.encode() if template else self._lib.llama_model_chat_template(self._model, None)
        if not tmpl:
            raise ModelLoadError(
                f"{self.path.name} has no chat template in its GGUF metadata "
                f'(a manifest can name one: "chat_template": {{"source": "builtin", "name": ...}})'
            )
        keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
        arr = (self._lib.llama_chat_message * len(keep))()
        for i, (role, content) in enumerate(keep):
            arr[i].role, arr[i].content = role, content
        size = sum(len(r) + len(c) for r, c in keep) * 2 + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = self._lib.llama_chat_apply_template(tmpl, arr, len(keep), add_assistant, buf, size)
            if n < 0:
                raise ModelLoadError(f"llama.cpp does not support the chat template of {self.path.name}")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n
        raise ModelLoadError("chat template rendering did not converge")

    # -- evaluation ---------------------------------------------------------------------------
    def decode(self, batch: Batch) -> np.ndarray:
        n_out = sum(batch.logits)
        buf = self._batch
        if buf is None:
            raise MtadEdgeError(f"{self.path.name} was closed")
        if self.one_row and len(batch) > 1:
            return self._decode_rows(batch, n_out)
        for lo in range(0, len(batch), self.n_batch):
            hi = min(lo + self.n_batch, len(batch))
            if n_out and lo + self.n_batch < len(batch) and any(batch.logits[lo:hi]):
                raise ValueError("logits may only be requested in the last n_batch rows of a batch")
            buf.fill(batch, lo, hi)
            with self._shield():
                rc = self._lib.llama_decode(self._ctx, buf.batch)
            call = f"during a call of {hi - lo} row{'s' if hi - lo > 1 else ''}"
            self._check_rpc(call)
            if rc != 0:
                raise MtadEdgeError(
                    f"llama_decode failed with code {rc} on {self.path.name} "
                    f"({'no free KV cache slot' if rc == 1 else 'aborted or internal error'})"
                )
            for i in range(lo, hi):
                for s in batch.seq_ids[i]:
                    hist = self._history.setdefault(s, [])
                    del hist[batch.pos[i] :]
                    hist.append(batch.tokens[i])
        if not n_out:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        with self._shield():
            ptr = self._lib.llama_get_logits(self._ctx)
        # llama_decode returns before its outputs are fetched; llama_get_logits waits for them: a
        # server lost then left the guard's zeros here (token 0 is SmolLM2's end of text: a clean stop)
        self._check_rpc(call)
        key = (ctypes.cast(ptr, ctypes.c_void_p).value or 0, n_out)
        view = self._views.get(key)
        if view is None:  # a row count not seen on this buffer yet, or a new buffer (llama.cpp grew it)
            if any(address != key[0] for address, _ in self._views):
                self._views.clear()
            view = np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))
            view.flags.writeable = False  # llama.cpp's buffer: valid until the next decode
            self._views[key] = view
        self._last = view
        return view

    def _decode_rows(self, batch: Batch, n_out: int) -> np.ndarray:
        """``decode`` one row per call (``one_row``), each output row copied as it comes: the
        same logits as one call, since a row attends only to rows before it."""
        out = np.empty((n_out, self.n_vocab), dtype=np.float32)
        j = 0
        for i in range(len(batch)):
            row = Batch()
            row.add(batch.tokens[i], batch.pos[i], tuple(batch.seq_ids[i]), batch.logits[i])
            logits = self.decode(row)
            if batch.logits[i]:
                out[j] = logits[0]
                j += 1
        self._last = out
        return out

    def last_logits_finite(self) -> bool:
        """Whether the logits of the last call held no NaN or inf (asked where a run met some, to
        name the model that gave them)."""
        return self._last is None or bool(np.isfinite(self._last).all())

    def logits_origin(self) -> str:
        """Where this model's logits are computed, for an error about them."""
        if self._rpc is not None:
            return f"the rpc servers {', '.join(self._rpc.servers)}"
        return "llama.cpp on this machine (a damaged model file, or a broken kernel of this build)"

    def held(self, seq: int) -> list[int]:
        return self._history.get(seq, [])

    def copy_seq(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        with self._shield():
            self._lib.llama_memory_seq_cp(self._mem, src, dst, p0, p1)
        s, d = self._history.get(src, []), self._history.setdefault(dst, [])
        lo, hi = max(p0, 0), (len(s) if p1 < 0 else p1)
        d[lo:hi] = s[lo:hi]

    def rollback(self, seq: int, n_keep: int) -> None:
        hist = self._history.setdefault(seq, [])
        if n_keep >= len(hist):
            return
        with self._shield():
            kept = self._lib.llama_memory_seq_rm(self._mem, seq, n_keep, -1)  # bool: may refuse
        if kept:
            del hist[n_keep:]
            return
        # Partial removal refused (e.g. recurrent state): clear the sequence, re-prefill the kept part.
        self.rollback_fallbacks += 1
        keep = hist[:n_keep]
        with self._shield():
            self._lib.llama_memory_seq_rm(self._mem, seq, -1, -1)
        hist.clear()
        self.decode(Batch.run(keep, 0, seq, logits="none"))

    def clear(self) -> None:
        with self._shield():
            self._lib.llama_memory_clear(self._mem, True)
        self._history.clear()

    def close(self) -> None:
        """Free the batch, then the context, then the model (the context uses the model). Each
        handle is forgotten *before* it is freed: a KeyboardInterrupt raised as a free returns
        must not leave a freed handle behind for ``__del__`` to free again (a double free)."""
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.close()
        ctx, self._ctx = self._ctx, None
        if ctx:
            with self._shield():
                self._lib.llama_free(ctx)
        model, self._model = self._model, None
        if model:
            with self._shield():
                self._lib.llama_model_free(model)

    def __enter__(self) -> LlamaCppBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # At interpreter exit llama_cpp's module state may already be torn down: leave the
        # memory to the OS then rather than call into a half-finalized binding.
        if sys.is_finalizing():
            return
        with contextlib.suppress(Exception):
            self.close()
