"""A loopback TCP relay with a set one-way delay, in front of a ggml-rpc-server: what a network's
latency costs each method (``mtad-edge bench --rpc ... --relay-delay MS``, and the tests).

Each direction of each connection has a reader that stamps every chunk as it arrives and a writer
that sends it once ``delay`` has passed since, so the delay adds to every message's trip without
capping the throughput: a link's latency, not a slow link. Python's sleep overshoots by tens of
microseconds, so the delay the chunks really got is measured (``achieved_ms``, over the chunks
that found their writer idle: one queued behind a bulk transfer, the weights', waited for that).

    python -m mtad_edge.bench.relay --to 127.0.0.1:50052 --delay-ms 1 [--port 60052]
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import socket
import threading
import time
from typing import Optional

CHUNK = 1 << 16
RELAY_DELAY_MAX_MS = 10_000.0  # one way: past any link's latency (1e9 ms failed as a bad port, NaN was taken)


class DelayRelay:
    """Listens on ``host``:``port`` (0: any free port; ``endpoint`` says which) and relays each
    connection to ``upstream`` (HOST:PORT) with ``delay_ms`` added each way."""

    def __init__(self, upstream: str, delay_ms: float, host: str = "127.0.0.1", port: int = 0):
        if not 0 <= delay_ms <= RELAY_DELAY_MAX_MS:  # NaN too
            raise ValueError(f"the relay's delay must be 0..{RELAY_DELAY_MAX_MS:g} ms, got {delay_ms!r}")
        up_host, _, up_port = upstream.rpartition(":")
        self.upstream = (up_host.strip("[]"), int(up_port))
        self.delay = delay_ms / 1000
        self._listener = socket.create_server((host, port), backlog=8)
        self.endpoint = f"{host}:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.chunks = 0  # chunks that found their writer idle
        self._late = 0.0  # the seconds those waited in all (arrival to send)
        threading.Thread(target=self._accept, name=f"relay {self.endpoint}", daemon=True).start()

    def achieved_ms(self) -> Optional[float]:
        """The mean one-way delay the chunks that found their writer idle got so far (ms)."""
        return self._late / self.chunks * 1000 if self.chunks else None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not, on Linux)
        self._listener.close()
        with self._lock:
            socks, self._sockets = self._sockets, []
        for s in socks:
            s.close()

    def __enter__(self) -> DelayRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()  # as a refused connection would be
                continue
            server.settimeout(None)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                pipe: queue.SimpleQueue[Optional[tuple[float, bytes]]] = queue.SimpleQueue()
                threading.Thread(target=self._read, args=(src, pipe), daemon=True).start()
                threading.Thread(target=self._write, args=(dst, pipe), daemon=True).start()

    def _read(self, src: socket.socket, pipe: queue.SimpleQueue[Optional[tuple[float, bytes]]]) -> None:
        try:
            while data := src.recv(CHUNK):
                pipe.put((time.perf_counter(), data))
        except OSError:
            pass
        pipe.put(None)

    def _write(self, dst: socket.socket, pipe: queue.SimpleQueue[Optional[tuple[float, bytes]]]) -> None:
        free_at = 0.0  # when this writer's last send returned
        while (item := pipe.get()) is not None:
            stamp, data = item
            wait = stamp + self.delay - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            if stamp >= free_at:  # it found the writer idle: it waited for the delay alone
                with self._lock:
                    self._late += time.perf_counter() - stamp
                    self.chunks += 1
            try:
                dst.sendall(data)
            except OSError:
                break
            free_at = time.perf_counter()
        with contextlib.suppress(OSError):  # the other side closed: passed on, as a link would
            dst.shutdown(socket.SHUT_WR)


def _delay(text: str) -> float:
    value = float(text)
    if not 0 <= value <= RELAY_DELAY_MAX_MS:
        raise argparse.ArgumentTypeError(f"{text!r}: give 0..{RELAY_DELAY_MAX_MS:g} ms")
    return value


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description="A TCP relay with a one-way delay (for RPC latency experiments).")
    ap.add_argument("--to", required=True, metavar="HOST:PORT", help="the server relayed to")
    ap.add_argument("--delay-ms", type=_delay, default=0.0, help="one-way delay added each way")
    ap.add_argument("--port", type=int, default=0, help="port to listen on, on 127.0.0.1 (0: any)")
    args = ap.parse_args(argv)
    relay = DelayRelay(args.to, args.delay_ms, port=args.port)
    print(f"relay {relay.endpoint} -> {args.to}, {args.delay_ms:g} ms each way", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        relay.close()


if __name__ == "__main__":
    main()
