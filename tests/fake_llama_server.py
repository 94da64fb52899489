"""A stand-in for llama.cpp's llama-server, for the bench's peer-column tests: ``--help``,
``/health``, ``/slots`` and ``/completion`` with ``timings``, as the real one answers them.

Run as ``python fake_llama_server.py CONFIG.json [llama-server's arguments]``. CONFIG says how it
behaves (``tests/test_peer.py``'s ``fake_server`` writes it and a wrapper named llama-server): every
start and every request is appended to its ``log`` as a JSON line, so a test reads what was asked
and the starts share a count (to fail on the n-th one)."""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

HELP = """----- common params -----

-h,    --help, --usage                  print usage and exit
-t,    --threads N                      number of CPU threads to use during generation (default: -1)
-c,    --ctx-size N                     size of the prompt context (default: 0, 0 = loaded from model)
-fa,   --flash-attn [on|off|auto]       set Flash Attention use ('on', 'off', or 'auto', default: 'auto')
-nr,   --no-repack                      disable weight repacking
-m,    --model FNAME                    model path to load
--spec-draft-threads, -td, --threads-draft N
                                        number of threads to use during generation (default: same as
                                        --threads)
--spec-draft-n-max N                    number of tokens to draft for speculative decoding (default: 3)
--spec-draft-p-min, --draft-p-min P     minimum speculative decoding probability (greedy) (default:
                                        0.00)
--spec-draft-model, -md, --model-draft FNAME
                                        draft model for speculative decoding (default: unused)
--spec-type [none,draft-simple,ngram-simple]
                                        comma-separated list of types of speculative decoding to use
                                        (default: none)

----- example-specific params -----

--host HOST                             ip address to listen on (default: 127.0.0.1)
--port PORT                             port to listen (default: 8080)
-np,   --parallel N                     number of server slots (default: -1, -1 = auto)
"""


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    args = sys.argv[2:]
    log = Path(config["log"])
    if "--help" in args:
        print(config.get("help", HELP))
        return

    def write(entry: dict) -> None:
        with log.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    def count(kind: str) -> int:
        return sum(json.loads(line)["kind"] == kind for line in log.read_text().splitlines()) if log.exists() else 0

    write({"kind": "start", "argv": args, "pid": os.getpid()})
    if config.get("fail_start"):
        print("load_model: loading model 'x'", file=sys.stderr)
        print(config["fail_start"], file=sys.stderr)
        sys.exit(1)
    if count("start") <= config.get("port_taken", 0):  # the first starts find their port taken
        print(f"srv  start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {args[-1]}", file=sys.stderr)
        sys.exit(1)
    drafting = "-md" in args and config.get("speculative", True)
    ready_at = time.monotonic() + config.get("loading_s", 0.05)  # /health answers 503 until then

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def answer(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                loading = time.monotonic() < ready_at
                self.answer(503 if loading else 200, {"status": "loading model" if loading else "ok"})
            elif self.path == "/slots":
                self.answer(200, [{"id": 0, "n_ctx": 512, "speculative": drafting, "is_processing": False}])
            else:
                self.answer(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            write({"kind": "request", "path": self.path, "body": body, "argv": args})
            if count("request") == config.get("die_at"):  # dies while answering
                print("GGML_ASSERT(false) failed", file=sys.stderr)
                os._exit(134)
            n = body["n_predict"]
            ms = config.get("ms_per_token", {}).get("draft" if drafting else "plain", 10.0)
            # as llama-server times it: from the first token, which the prompt's prefill made, so
            # predicted_ms covers n - 1 decodes
            timings = {
                "prompt_n": len(body["prompt"]),
                "prompt_ms": 1.0,
                "predicted_n": n,
                "predicted_ms": (n - 1) * ms,
            }
            if drafting:
                timings |= {"draft_n": 2 * n, "draft_n_accepted": n}
            tokens = config.get("tokens") or list(range(100, 100 + n))
            content = config.get("content", "x" * n)
            self.answer(200, {"content": content, "tokens": tokens, "stop_type": "limit", "timings": timings})

    port = int(args[args.index("--port") + 1])
    HTTPServer((args[args.index("--host") + 1], port), Handler).serve_forever()


if __name__ == "__main__":
    main()
