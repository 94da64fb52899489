"""A ggml-rpc-server of protocol 7 in Python, enough of it for the RPC checks and the guard
(runtime/backends/rpc.py) without llama.cpp, and a client that speaks as llama.cpp's does."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from typing import Optional

from mtad_edge.runtime.backends.rpc import CONN_CAPS, REPLY, Cmd

GGML_TYPE_Q4_0 = 2
RPC_TENSOR = 296  # sizeof(rpc_tensor), protocol 7


def tensor_request(kind: int) -> bytes:
    """An rpc_tensor of ggml type ``kind`` (its id first, then its type), the rest zeros."""
    return struct.pack("<QI", 0, kind) + bytes(RPC_TENSOR - 12)


class FakeServer:
    """Serves one client at a time, as ggml-rpc-server does. ``version``: its hello; ``devices``:
    its device count; ``after``: calls served before it acts as ``then`` says: "close" (the process
    died), "silent" (stopped: reads, never answers), "malformed" (a reply of the wrong size);
    ``mode`` "silent" / "close" from the first byte (a busy or foreign server); ``trickle``: seconds
    between the bytes of each reply; ``bad``: replies given instead of the right ones once the
    first ``bad_after`` calls (a check's, for one device) were answered well."""

    def __init__(
        self,
        version=(7, 0, 0),
        devices=1,
        after: Optional[int] = None,
        then="close",
        mode="serve",
        trickle: float = 0.0,
        bad: Optional[dict] = None,
        bad_after: int = 5,
    ):
        self.version, self.devices, self.after, self.then, self.mode = version, devices, after, then, mode
        self.trickle, self.bad, self.bad_after = trickle, bad or {}, bad_after
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
            if reply is not None and cmd in self.bad and len(self.calls) > self.bad_after:
                reply = self.bad[cmd]
            if reply is not None:
                data = struct.pack("<Q", len(reply)) + reply
                if not self.trickle:
                    conn.sendall(data)
                for i in range(len(data) if self.trickle else 0):
                    if self._stop.is_set():
                        return
                    conn.sendall(data[i : i + 1])
                    time.sleep(self.trickle)

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

    def get_tensor(self, size: int, kind: int = GGML_TYPE_Q4_0) -> Optional[bytes]:
        """GET_TENSOR of ``size`` bytes of a tensor of ggml type ``kind`` (a float type's are
        checked for non-finite numbers by the guard)."""
        return self.call(Cmd.GET_TENSOR, tensor_request(kind) + struct.pack("<QQ", 0, size))

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


class PeerProxy:
    """A peer in front of ``upstream`` (a real ggml-rpc-server) that reads each call and its reply
    whole and hands the reply to ``rewrite(cmd, request, reply, n)`` (``n``: the replies of that
    command so far, over every connection) before passing it on: what it returns goes back, None
    holds the reply for ever (a server stalled mid-call). ``trickle``: seconds between the bytes of
    each reply."""

    def __init__(self, upstream: str, rewrite=None, trickle: float = 0.0):
        host, port = upstream.rsplit(":", 1)
        self.upstream, self.rewrite, self.trickle = (host, int(port)), rewrite, trickle
        self.seen: dict[int, int] = {}
        self.held = threading.Event()  # set once a reply is held
        self._stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(client,), daemon=True).start()

    def _client(self, client: socket.socket) -> None:
        server = socket.create_connection(self.upstream)
        self._conns += [client, server]
        try:
            while True:
                head = _recv(client, 9)
                if head is None:
                    return
                cmd, size = head[0], struct.unpack("<Q", head[1:])[0]
                body = _recv(client, size) if size else b""
                server.sendall(head + (body or b""))
                if cmd not in REPLY:
                    continue
                rhead = _recv(server, 8)
                if rhead is None:
                    return
                reply = _recv(server, struct.unpack("<Q", rhead)[0]) or b""
                n = self.seen[cmd] = self.seen.get(cmd, 0) + 1
                if self.rewrite is not None:
                    reply = self.rewrite(cmd, body or b"", reply, n)
                if reply is None:
                    self.held.set()
                    self._stop.wait()
                    return
                data = struct.pack("<Q", len(reply)) + reply
                if not self.trickle:
                    client.sendall(data)
                for i in range(len(data) if self.trickle else 0):
                    client.sendall(data[i : i + 1])
                    time.sleep(self.trickle)
        except OSError:
            return
        finally:
            for s in (client, server):
                s.close()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for s in self._conns:
            with contextlib.suppress(OSError):
                s.close()
