"""A ggml-rpc-server of protocol 7 in Python, enough of it for the RPC checks and the guard
(runtime/rpc.py) without llama.cpp, and a client that speaks as llama.cpp's does."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from typing import Optional

from mtad_edge.runtime.backends.rpc import CONN_CAPS, REPLY, Cmd


class FakeServer:
    """Serves one client at a time, as ggml-rpc-server does. ``version``: its hello; ``devices``:
    its device count; ``after``: calls served before it acts as ``then`` says: "close" (the process
    died), "silent" (stopped: reads, never answers), "malformed" (a reply of the wrong size);
    ``mode`` "silent" / "close" from the first byte (a busy or foreign server)."""

    def __init__(self, version=(7, 0, 0), devices=1, after: Optional[int] = None, then="close", mode="serve"):
        self.version, self.devices, self.after, self.then, self.mode = version, devices, after, then, mode
        self.calls: list[int] = []
        self.caps_seen: list[bytes] = []
        self.data: dict[int, bytes] = {}
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                self._client(conn)

    def _client(self, conn: socket.socket) -> None:
        if self.mode == "close":
            return
        while True:
            head = _recv(conn, 9)
            if head is None:
                return
            if self.mode == "silent":
                self._stop.wait()
                return
            cmd, size = head[0], struct.unpack("<Q", head[1:])[0]
            body = _recv(conn, size) or b""
            if self.after is not None and len(self.calls) >= self.after:
                if self.then == "silent":
                    self._stop.wait()
                if self.then != "malformed" or cmd not in REPLY:
                    return
                conn.sendall(struct.pack("<Q", 3) + b"bad")
                continue
            self.calls.append(cmd)
            reply = self._reply(cmd, body)
            if reply is not None:
                conn.sendall(struct.pack("<Q", len(reply)) + reply)

    def _reply(self, cmd: int, body: bytes) -> Optional[bytes]:
        if cmd == Cmd.HELLO:
            self.caps_seen.append(body)
            return bytes(self.version) + b"\0" + b"\x5a" * CONN_CAPS  # caps the guard must not pass on
        if cmd == Cmd.DEVICE_COUNT:
            return struct.pack("<I", self.devices)
        if cmd == Cmd.GET_ALIGNMENT:
            return struct.pack("<Q", 32)
        if cmd == Cmd.GET_MAX_SIZE:
            return struct.pack("<Q", 1 << 40)
        if cmd == Cmd.GET_DEVICE_MEMORY:
            return struct.pack("<QQ", 3 << 30, 4 << 30)
        if cmd == Cmd.ALLOC_BUFFER:
            return struct.pack("<QQ", 0x1234, struct.unpack("<IQ", body)[1])
        if cmd == Cmd.SET_TENSOR:
            self.data[0] = body
            return None
        if cmd == Cmd.GET_TENSOR:
            return bytes(range(256)) * (struct.unpack("<Q", body[-8:])[0] // 256)
        return bytes(REPLY[cmd]) if cmd in REPLY else None


class Client:
    """Calls as llama.cpp's RPC client makes them: | cmd | size | request |, then the reply."""

    def __init__(self, endpoint: str):
        host, port = endpoint.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)

    def call(self, cmd: int, request: bytes = b"") -> Optional[bytes]:
        self.sock.sendall(bytes([cmd]) + struct.pack("<Q", len(request)) + request)
        if cmd not in REPLY:
            return None
        size = struct.unpack("<Q", _recv(self.sock, 8) or b"")[0]
        return _recv(self.sock, size)

    def get_tensor(self, size: int) -> Optional[bytes]:
        return self.call(Cmd.GET_TENSOR, bytes(8 * 30) + struct.pack("<QQ", 0, size))

    def close(self) -> None:
        self.sock.close()


def _recv(sock: socket.socket, n: int) -> Optional[bytes]:
    buf = b""
    while len(buf) < n:
        try:
            part = sock.recv(n - len(buf))
        except OSError:
            return None
        if not part:
            return None
        buf += part
    return buf


class CutProxy:
    """Relays to ``upstream`` and cuts the connection (both sides, as a dying host would) once
    ``limit`` bytes went towards it (a server lost at a set point of a model's upload), or once
    ``back_limit`` bytes came back from it (lost in the middle of a reply)."""

    def __init__(self, upstream: str, limit: int, back_limit: int = 1 << 62):
        host, port = upstream.rsplit(":", 1)
        self.upstream, self.limit, self.sent = (host, int(port)), limit, 0
        self.back_limit, self.received = back_limit, 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if not counted and self.received + len(data) >= self.back_limit:
                    dst.sendall(data[: max(0, self.back_limit - self.received)])
                    self.received = self.back_limit
                    break
                dst.sendall(data)
                self.sent += len(data) if counted else 0
                self.received += 0 if counted else len(data)
                if self.sent >= self.limit:
                    break
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
