"""What the RPC guard costs a call: the median round trip of a GET_TENSOR of one row of logits
(SmolLM2's 49152 floats, 196 KB) from a minimal in-process server, direct and through the guard
(runtime/backends/rpc.py: the relay, the whole-reply deadline, the reply's checks). Runs on any checkout
that has runtime/backends/rpc.py's Guard and check_server, so a branch can be put beside main:

    python scripts/guard_rtt.py [--calls 2000] [--floats 49152]

Timings mean something only on an idle machine."""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import threading
import time

import numpy as np

from mtad_edge.runtime.backends.rpc import CONN_CAPS, REPLY, Cmd, Guard, check_server

TENSOR = 296  # sizeof(rpc_tensor), protocol 7


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError
        buf += part
    return buf


def serve(listener: socket.socket, logits: bytes) -> None:
    """A protocol-7 server that answers the check's calls and every GET_TENSOR with ``logits``."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                cmd, size = struct.unpack("<BQ", _recv(conn, 9))
                body = _recv(conn, size) if size else b""
                reply = {
                    Cmd.HELLO: bytes([7, 0, 0, 0]) + bytes(CONN_CAPS),
                    Cmd.DEVICE_COUNT: struct.pack("<I", 1),
                    Cmd.GET_ALIGNMENT: struct.pack("<Q", 32),
                    Cmd.GET_MAX_SIZE: struct.pack("<Q", 1 << 40),
                    Cmd.GET_DEVICE_MEMORY: struct.pack("<QQ", 1 << 30, 1 << 31),
                }.get(cmd, logits[: struct.unpack("<Q", body[-8:])[0]] if cmd == Cmd.GET_TENSOR else None)
                if cmd in REPLY and reply is not None:
                    conn.sendall(struct.pack("<Q", len(reply)) + reply)
        except (ConnectionError, OSError):
            conn.close()


def median_us(endpoint: str, calls: int, size: int) -> float:
    host, port = endpoint.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = struct.pack("<QI", 0, 0) + bytes(TENSOR - 12) + struct.pack("<QQ", 0, size)  # an F32 tensor
    head = bytes([Cmd.GET_TENSOR]) + struct.pack("<Q", len(request))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        sock.sendall(head + request)
        got = struct.unpack("<Q", _recv(sock, 8))[0]
        _recv(sock, got)
        times.append(time.perf_counter() - t0)
    sock.close()
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--floats", type=int, default=49152, help="floats a reply carries (one row of logits)")
    args = ap.parse_args()
    logits = np.random.default_rng(0).normal(size=args.floats).astype(np.float32).tobytes()
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=serve, args=(listener, logits), daemon=True).start()
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
    direct = median_us(endpoint, args.calls, len(logits))
    guard = Guard(check_server(endpoint))
    through = median_us(guard.endpoint, args.calls, len(logits))
    lost = f" (the guard lost the server: {guard.lost})" if guard.lost else ""
    print(f"GET_TENSOR of {len(logits)} bytes, median of {args.calls}: direct {direct:.0f} us, "
          f"through the guard {through:.0f} us{lost}")  # fmt: skip
    guard.close()
    listener.close()


if __name__ == "__main__":
    main()
