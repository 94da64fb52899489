"""The server's connection limits, the defaults of `mtad-edge serve`'s options (docs/reliability.md
lists every limit). Kept apart from connections.py, which needs uvicorn, so the CLI can build its
options without the [serve] extra."""

from __future__ import annotations

HEADER_TIMEOUT_S = 10.0  # a client sends its request head in well under a second, even on slow links
# A whole body (--max-body, 1 MiB by default) arrives in well under a second on a LAN and in seconds
# on a slow link; a body trickled a byte at a time (each pause under the header timeout) held its
# connection for ever.
BODY_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 5  # uvicorn's keep-alive default: an idle connection costs a file descriptor
# One request runs at a time and --queue-size wait: 128 connections is far more than can be served
# at once, and far below the usual 1024-descriptor limit.
MAX_CONNECTIONS = 128
MAX_HEADER_BYTES = 16 * 1024  # a request head's bytes at most (h11's default): 400 or 431 above
