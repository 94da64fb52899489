"""Our backend's one-token decode against a context made as llama-bench makes it, on one loaded
model in one process: 8-token bursts alternate, so the machine's drift cancels (docs/benchmarking.md
"Plain decoding against llama-server").

    python scripts/decode_ab.py MODEL.gguf on|off [BURSTS]     # on|off: flash attention, both
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time

import llama_cpp as lib

from mtad_edge.runtime.backend import Batch
from mtad_edge.runtime.backends.llama_cpp_backend import LlamaCppBackend, LlamaCppConfig

DEPTH, BURST, LAST = 23, 8, 1500  # a short prompt's cells first; stop before the context fills


def main(path: str, fa: bool, bursts: int) -> None:
    with LlamaCppBackend(path, LlamaCppConfig(n_ctx=2048, n_threads=2, flash_attn=fa)) as ours:
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 2048, 2048, 512
        cp.n_threads = cp.n_threads_batch = 2
        cp.flash_attn_type = int(fa)
        ctx = lib.llama_init_from_model(ours._model, cp)  # llama-bench's: the same weights, its defaults
        prompt = (lib.llama_token * DEPTH)(*range(100, 100 + DEPTH))
        lib.llama_decode(ctx, lib.llama_batch_get_one(ctypes.cast(prompt, ctypes.POINTER(lib.llama_token)), DEPTH))
        ours.decode(Batch.run(list(range(100, 100 + DEPTH)), 0, logits="last"))
        one = ctypes.cast((lib.llama_token * 1)(200), ctypes.POINTER(lib.llama_token))
        t_ours, t_bench, pos = [], [], DEPTH
        for _ in range(bursts):
            if pos + BURST > LAST:
                break
            t0 = time.perf_counter()
            for i in range(BURST):
                ours.decode(Batch.run([200], pos + i, logits="last"))
            t1 = time.perf_counter()
            for _ in range(BURST):
                lib.llama_decode(ctx, lib.llama_batch_get_one(one, 1))
            t2 = time.perf_counter()
            t_ours.append((t1 - t0) / BURST)
            t_bench.append((t2 - t1) / BURST)
            pos += BURST
        lib.llama_free(ctx)
    so, sb = statistics.median(t_ours), statistics.median(t_bench)
    print(
        f"flash attention {'on' if fa else 'off'}: ours {so * 1e3:.3f} ms a token, llama-bench's context "
        f"{sb * 1e3:.3f}; ratio {sb / so:.3f} (of the sums {sum(t_bench) / sum(t_ours):.3f}), cached {DEPTH}..{pos}"
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "on", int(sys.argv[3]) if len(sys.argv) > 3 else 40)
