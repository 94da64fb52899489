"""llama.cpp's RPC backend: the target's layers on ggml-rpc-server hosts, each behind a guard.

Layers: ctypes on the libggml llama.cpp uses (``_Registry``: load the RPC backend, add a server,
list devices) -> ``Guard`` (one per server: a relay on 127.0.0.1 that llama.cpp talks to instead)
-> ``Placement`` (the checked servers and the devices the target's llama_model_params get).

Why a guard (read in ggml/src/ggml-rpc/ggml-rpc.cpp of the llama.cpp that llama-cpp-python 0.3.36
vendors, RPC protocol 7.0.0): its client aborts the whole process (GGML_ABORT) where a connect or
the hello fails and where any send or receive fails mid-call (RPC_STATUS_ASSERT, on its
dispatcher thread), and it waits for a reply without a bound (no socket timeouts, a blocking
connect). So each server is checked first (a connect and the hello, with short timeouts:
``check_server``), and llama.cpp only ever connects to the server's guard, which forwards every
call and, once the server is lost (closed, reset, a malformed reply, silent for REPLY_TIMEOUT_S),
answers each later call itself with a well-formed reply so that llama.cpp's call returns; the
backend then raises RpcError (``Placement.check``). The guard also counts the traffic per command.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import itertools
import socket
import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import RpcError, quoted
from .amx import mapped_libraries

PROTOCOL = (7, 0)  # RPC_PROTO_MAJOR/MINOR_VERSION (ggml-rpc.h) this module parses and llama.cpp speaks
MAX_SERVERS = 16  # GGML_RPC_MAX_SERVERS
CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE: transport upgrades (RDMA) offered in the hello; sent as zeros: TCP only
CONNECT_TIMEOUT_S = 5.0  # a connect to a server (llama.cpp's own would wait for the kernel's ~2 minutes)
HELLO_TIMEOUT_S = 5.0  # its hello reply; a server busy with another client accepts but does not answer
# A call's reply (or a send's progress) may take this long: a server computes a whole ubatch before
# it answers, minutes for a big model on a slow host; a dead host is found sooner by TCP keepalive.
REPLY_TIMEOUT_S = 120.0
KEEPALIVE = (10, 5, 3)  # idle s, interval s, probes: a silent dead host found within ~25 s
CHUNK = 1 << 20  # bytes relayed at a time (weights go out in tensors of up to hundreds of MB)
FAKE_BUFFER = 0x1_0000_0000  # the handles of buffers a lost server never allocated (non-zero: valid)
FAKE_BASE = 1 << 44  # their base address: non-zero and aligned, as ggml asserts


class Cmd(enum.IntEnum):
    """rpc_cmd (ggml-rpc.cpp)."""

    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16
    MEMSET_TENSOR = 17


# The bytes of each command's reply; a command not listed gets none. GET_TENSOR's reply is the
# size its request asks for (the request's last 8 bytes).
REPLY: dict[int, int] = {
    Cmd.HELLO: 4 + CONN_CAPS,
    Cmd.DEVICE_COUNT: 4,
    Cmd.ALLOC_BUFFER: 16,
    Cmd.GET_ALLOC_SIZE: 8,
    Cmd.GET_ALIGNMENT: 8,
    Cmd.GET_MAX_SIZE: 8,
    Cmd.BUFFER_GET_BASE: 8,
    Cmd.SET_TENSOR_HASH: 1,
    Cmd.GET_TENSOR: 0,
    Cmd.COPY_TENSOR: 1,
    Cmd.GET_DEVICE_MEMORY: 16,
}
# Replies that depend only on the request and the server: kept from the server's own answers and
# given again once it is lost (a zero alignment or device count would trip ggml's own asserts).
KEPT = (Cmd.HELLO, Cmd.DEVICE_COUNT, Cmd.GET_ALIGNMENT, Cmd.GET_MAX_SIZE, Cmd.GET_DEVICE_MEMORY)
# Where no reply was kept: a buffer for every allocation, "the server holds these weights" for a
# hash (so no bytes go to nobody), zeros for the rest (GET_TENSOR's data, COPY_TENSOR's "not done",
# GET_ALLOC_SIZE's "the tensor's own size").
FALLBACK: dict[int, bytes] = {Cmd.BUFFER_GET_BASE: struct.pack("<Q", FAKE_BASE), Cmd.SET_TENSOR_HASH: b"\x01"}


# -- endpoints ---------------------------------------------------------------------------------
def parse_endpoints(value: Any, what: str = "rpc") -> tuple[str, ...]:
    """``HOST:PORT[,HOST:PORT...]`` (or a list of them) as a tuple of endpoints, checked: a port in
    1..65535, at most MAX_SERVERS, none twice. An IPv6 host is written in brackets: [::1]:50052."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise RpcError(f"{what} must be HOST:PORT[,HOST:PORT...] or a list of HOST:PORT, got {quoted(value)}")
    out = tuple(i.strip() for i in items)
    for endpoint in out:
        host, _, port = endpoint.rpartition(":")
        ok = host.strip("[]") and host.isprintable() and not any(c.isspace() for c in host)
        if not ok or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise RpcError(f"{what}: {quoted(endpoint)} is not HOST:PORT (a port in 1..65535)")
    if not out:
        raise RpcError(f"{what} names no server")
    if len(out) > MAX_SERVERS:
        raise RpcError(f"{what} names {len(out)} servers; llama.cpp takes at most {MAX_SERVERS}")
    twice = next((e for i, e in enumerate(out) if e in out[:i]), None)
    if twice is not None:
        raise RpcError(f"{what} names {twice} twice")
    return out


def _address(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


# -- one server: the check before use ---------------------------------------------------------
@dataclass(frozen=True)
class ServerInfo:
    """A server as its check found it: protocol version, devices' (free, total) memory, and the
    replies a guard gives again once it is lost (``kept``: (command, request) -> reply)."""

    endpoint: str
    version: tuple[int, int, int]
    memory: tuple[tuple[int, int], ...]
    kept: dict[tuple[int, bytes], bytes] = field(repr=False)

    def describe(self) -> str:
        free = sum(f for f, _ in self.memory)
        n = len(self.memory)
        return f"{self.endpoint} ({n} device{'s' if n != 1 else ''}, {free / 2**30:.1f} GiB free)"


def check_server(endpoint: str) -> ServerInfo:
    """Connect to ``endpoint`` and ask what llama.cpp will ask first (hello, devices, their
    alignment, sizes and memory), with short timeouts; an unreachable server, a refused connection,
    a busy or silent one and another protocol version are each a one-line RpcError."""
    host, port = _address(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    except socket.gaierror as e:
        raise RpcError(f"rpc server {endpoint}: cannot resolve {host!r} ({e.strerror})") from None
    except ConnectionRefusedError:
        raise RpcError(
            f"rpc server {endpoint} refused the connection: is ggml-rpc-server running there (`mtad-edge rpc server`)?"
        ) from None
    except TimeoutError:
        raise RpcError(f"rpc server {endpoint} did not accept a connection within {CONNECT_TIMEOUT_S:g} s") from None
    except OSError as e:
        raise RpcError(f"rpc server {endpoint}: cannot connect ({e.strerror or e})") from None
    with sock:
        sock.settimeout(HELLO_TIMEOUT_S)
        kept: dict[tuple[int, bytes], bytes] = {}

        def ask(cmd: Cmd, request: bytes = b"") -> bytes:
            reply = _call(sock, endpoint, cmd, request)
            kept[(int(cmd), request)] = reply
            return reply

        hello = ask(Cmd.HELLO, bytes(CONN_CAPS))
        version = (hello[0], hello[1], hello[2])
        if version[0] != PROTOCOL[0] or version[1] > PROTOCOL[1]:
            raise RpcError(
                f"rpc server {endpoint} speaks RPC protocol {'.'.join(map(str, version))}, this llama.cpp "
                f"{PROTOCOL[0]}.{PROTOCOL[1]}: run the rpc-server of the same llama.cpp (`mtad-edge rpc server`)"
            )
        kept[(int(Cmd.HELLO), bytes(CONN_CAPS))] = hello[:4] + bytes(CONN_CAPS)
        (count,) = struct.unpack("<I", ask(Cmd.DEVICE_COUNT))
        if not count:
            raise RpcError(f"rpc server {endpoint} offers no devices")
        memory = []
        for device in range(count):
            request = struct.pack("<I", device)
            ask(Cmd.GET_ALIGNMENT, request)
            ask(Cmd.GET_MAX_SIZE, request)
            memory.append(struct.unpack("<QQ", ask(Cmd.GET_DEVICE_MEMORY, request)))
    return ServerInfo(endpoint, version, tuple((int(f), int(t)) for f, t in memory), kept)


def _call(sock: socket.socket, endpoint: str, cmd: Cmd, request: bytes) -> bytes:
    """One call of the check, its failures in words."""
    try:
        sock.sendall(bytes([cmd]) + struct.pack("<Q", len(request)) + request)
        head = _read(sock, 8)
        size = None if head is None else struct.unpack("<Q", head)[0]
        reply = _read(sock, REPLY[cmd]) if size == REPLY[cmd] else None
    except ConnectionError:  # reset: it closed without reading all we sent
        reply = None
    except TimeoutError:
        busy = " (it serves one client at a time: is another using it?)" if cmd == Cmd.HELLO else ""
        raise RpcError(
            f"rpc server {endpoint} accepted the connection but did not answer {cmd.name} within "
            f"{HELLO_TIMEOUT_S:g} s{busy}"
        ) from None
    except OSError as e:
        raise RpcError(f"rpc server {endpoint} failed at {cmd.name}: {e.strerror or e}") from None
    if reply is None:
        raise RpcError(
            f"rpc server {endpoint} closed the connection or answered malformed at {cmd.name}: not a "
            f"ggml-rpc-server of RPC protocol {PROTOCOL[0]}.x (another llama.cpp version?)"
        )
    return reply


def _read(sock: socket.socket, n: int) -> Optional[bytes]:
    """Exactly ``n`` bytes, or None where the peer closed first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, CHUNK))
        if not k:
            return None
        got += k
    return bytes(buf)


# -- the guard: llama.cpp's side of each server ------------------------------------------------
class Guard:
    """A relay on 127.0.0.1 for one checked server: llama.cpp connects here, each of its
    connections gets one to the server, and every call goes through (counted in ``traffic``:
    command -> [calls, bytes sent, bytes received]). Once the server is lost, ``lost`` says how
    and every later call is answered here (see the module's docstring)."""

    def __init__(self, server: ServerInfo):
        self.server = server
        self.reply_timeout = REPLY_TIMEOUT_S
        self.lost: Optional[str] = None
        self.traffic: dict[str, list[int]] = {}
        self._kept = dict(server.kept)
        self._buffers = itertools.count(FAKE_BUFFER)
        self._closed = False
        self._upstreams: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=8)
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name=f"rpc guard {server.endpoint}", daemon=True).start()

    def close(self) -> None:
        """Stop accepting and drop the server's connections. A connection llama.cpp still holds
        keeps being answered here until llama.cpp lets it go: never a failed call, never an abort."""
        self._closed = True
        _stop_listening(self._listener)
        with self._lock:
            ups, self._upstreams = list(self._upstreams), set()
        for up in ups:
            up.close()

    def _lose(self, reason: str) -> None:
        with self._lock:
            if self.lost is None and not self._closed:
                self.lost = reason

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._relay, args=(client,), name=self.endpoint, daemon=True).start()

    def _connect(self) -> Optional[socket.socket]:
        if self.lost is not None or self._closed:
            return None
        try:
            up = socket.create_connection(_address(self.server.endpoint), timeout=CONNECT_TIMEOUT_S)
        except OSError as e:
            self._lose(f"refused a new connection ({e.strerror or e})")
            return None
        up.settimeout(self.reply_timeout)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _keepalive(up)
        with self._lock:
            self._upstreams.add(up)
        return up

    def _drop(self, up: socket.socket, reason: str) -> None:
        """The server lost, on ``up``."""
        self._lose(reason)
        self._forget(up)

    def _forget(self, up: socket.socket) -> None:
        with self._lock:
            self._upstreams.discard(up)
        up.close()

    def _count(self, cmd: int, sent: int, received: int, call: int = 0) -> None:
        name = Cmd(cmd).name if cmd in Cmd._value2member_map_ else str(cmd)
        row = self.traffic.setdefault(name, [0, 0, 0])
        row[0] += call
        row[1] += sent
        row[2] += received

    def _send(self, up: Optional[socket.socket], cmd: int, data: bytes) -> Optional[socket.socket]:
        """``data`` to the server; the server's connection, or None once it is lost."""
        if up is None:
            return None
        try:
            up.sendall(data)
        except TimeoutError:
            self._drop(up, f"took no data for {self.reply_timeout:g} s")
            return None
        except OSError as e:
            self._drop(up, f"dropped the connection ({e.strerror or e})")
            return None
        self._count(cmd, len(data), 0)
        return up

    def _relay(self, client: socket.socket) -> None:
        """One connection of llama.cpp's, call by call: | cmd (1) | size (8) | request | and, for
        commands in REPLY, | size (8) | reply |."""
        up = self._connect()
        try:
            while True:
                head = _read(client, 9)
                if head is None:
                    return  # llama.cpp let the connection go
                cmd, size = head[0], struct.unpack("<Q", head[1:])[0]
                want = REPLY.get(cmd)
                self._count(cmd, 0, 0, call=1)
                if want is None and size > CHUNK:  # a tensor's data: relayed as it comes
                    up = self._send(up, cmd, head)
                    for lo in range(0, size, CHUNK):
                        part = _read(client, min(CHUNK, size - lo))
                        if part is None:
                            return
                        up = self._send(up, cmd, part)
                    continue
                request = _read(client, size)
                if request is None:
                    return
                if cmd == Cmd.HELLO and size == CONN_CAPS:
                    request = bytes(CONN_CAPS)  # TCP only: an upgraded transport would bypass the guard
                up = self._send(up, cmd, head + request)
                if want is not None:
                    if cmd == Cmd.GET_TENSOR:
                        want = struct.unpack("<Q", request[-8:])[0]
                    reply, up = self._reply(up, cmd, request, want)
                    client.sendall(struct.pack("<Q", len(reply)) + reply)
        except OSError:
            return  # llama.cpp's side closed mid-call: it lets the connection go
        finally:
            client.close()
            if up is not None:
                self._forget(up)

    def _reply(
        self, up: Optional[socket.socket], cmd: int, request: bytes, want: int
    ) -> tuple[bytes, Optional[socket.socket]]:
        """The server's reply of ``want`` bytes, else (the server lost) one given here."""
        name = Cmd(cmd).name
        if up is not None:
            try:
                head = _read(up, 8)
                size = None if head is None else struct.unpack("<Q", head)[0]
                reply = _read(up, want) if size == want else None
            except TimeoutError:
                self._drop(up, f"gave no reply to {name} within {self.reply_timeout:g} s")
                up = None
            except OSError as e:
                self._drop(up, f"dropped the connection ({e.strerror or e})")
                up = None
            else:
                if reply is not None:
                    self._count(cmd, 0, 8 + want)
                    if cmd == Cmd.HELLO:
                        reply = reply[:4] + bytes(CONN_CAPS)
                    if cmd in KEPT:
                        self._kept[(cmd, request)] = reply
                    return reply, up
                what = "closed the connection" if size is None or size == want else f"answered {name} malformed"
                self._drop(up, what)
                up = None
        return self._given(cmd, request, want), up

    def _given(self, cmd: int, request: bytes, want: int) -> bytes:
        """The reply of a lost server (see KEPT and FALLBACK)."""
        kept = self._kept.get((cmd, request))
        if kept is not None:
            return kept
        if cmd == Cmd.ALLOC_BUFFER:
            return struct.pack("<QQ", next(self._buffers), struct.unpack("<IQ", request)[1])
        return FALLBACK.get(cmd, bytes(want))


def _stop_listening(listener: socket.socket) -> None:
    """Close a listening socket and wake the thread blocked in its accept() (a close alone does
    not, on Linux)."""
    with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)
    listener.close()


def _keepalive(sock: socket.socket) -> None:
    """TCP keepalive probes: a host that vanished (power, network) fails the wait for its reply
    within seconds rather than at REPLY_TIMEOUT_S."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


# -- ctypes: ggml's backend registry ------------------------------------------------------------
GGML_DEVICE_GPU, GGML_DEVICE_IGPU = 1, 2  # enum ggml_backend_dev_type


class _Registry:
    """The libggml llama.cpp loaded, for its backend registry: found among the files this process
    mapped, since llama-cpp-python's wheel ships libggml.so and libggml.so.0 as two copies, and
    opening the other by name makes a second registry llama.cpp never reads."""

    def __init__(self) -> None:
        found = mapped_libraries(("libggml.so",))
        if not found:
            raise RpcError("cannot find the libggml llama.cpp loaded (RPC needs Linux's /proc/self/maps)")
        lib = ctypes.CDLL(found[0])
        p, s = ctypes.c_void_p, ctypes.c_size_t
        for name, args, res in (
            ("ggml_backend_load", [ctypes.c_char_p], p),
            ("ggml_backend_reg_by_name", [ctypes.c_char_p], p),
            ("ggml_backend_reg_get_proc_address", [p, ctypes.c_char_p], p),
            ("ggml_backend_reg_dev_count", [p], s),
            ("ggml_backend_reg_dev_get", [p, s], p),
            ("ggml_backend_dev_count", [], s),
            ("ggml_backend_dev_get", [s], p),
            ("ggml_backend_dev_type", [p], ctypes.c_int),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self._lib = lib
        self._add: Any = None

    def rpc(self) -> Optional[int]:
        """llama.cpp's RPC backend where it is registered (built in, or loaded before)."""
        return self._lib.ggml_backend_reg_by_name(b"RPC")  # type: ignore[no-any-return]

    def load(self, library: Optional[str]) -> None:
        """Register the RPC backend (built in, or ``library``) and find its add_server."""
        if self._add is not None:
            return
        reg = self.rpc()
        if not reg:
            if library is None or not self._lib.ggml_backend_load(str(library).encode()):
                raise RpcError(
                    f"llama.cpp could not load its RPC backend {library}: build it again (`mtad-edge rpc build`)"
                )
            reg = self.rpc()
        address = self._lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
        if not address:
            raise RpcError("llama.cpp's RPC backend has no ggml_backend_rpc_add_server")
        self._add = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(address)

    def add_server(self, endpoint: str) -> list[int]:
        """The devices of the server at ``endpoint``, as llama.cpp's --rpc adds them (without
        registering them: only the model whose params list them uses them)."""
        reg = self._add(endpoint.encode())
        if not reg:
            raise RpcError(f"llama.cpp found no devices at {endpoint}")
        return [self._lib.ggml_backend_reg_dev_get(reg, i) for i in range(self._lib.ggml_backend_reg_dev_count(reg))]

    def local_gpus(self) -> list[int]:
        """This machine's GPUs (else its integrated ones), which llama.cpp's --rpc lists after the servers."""
        devices = [self._lib.ggml_backend_dev_get(i) for i in range(self._lib.ggml_backend_dev_count())]
        for kind in (GGML_DEVICE_GPU, GGML_DEVICE_IGPU):
            found = [d for d in devices if self._lib.ggml_backend_dev_type(d) == kind]
            if found:
                return found
        return []


_REGISTRY: Optional[_Registry] = None


def _registry() -> _Registry:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _Registry()
    return _REGISTRY


def built_in() -> bool:
    """Whether llama.cpp's RPC backend is registered already (a build with GGML_RPC=ON, or one
    this process loaded): no library needs to be found then."""
    import llama_cpp

    return bool(llama_cpp.llama_supports_rpc())


def gpu_offload() -> bool:
    """Whether llama.cpp can offload to a device of this machine: llama_supports_gpu_offload(),
    which says yes for any registered RPC backend too, so then the device list is asked."""
    import llama_cpp

    if not llama_cpp.llama_supports_gpu_offload():
        return False
    return not llama_cpp.llama_supports_rpc() or bool(_registry().local_gpus())


# -- the placement: what the target's model params get ----------------------------------------
class Placement:
    """The target's servers, checked, each behind its guard, and the devices llama.cpp places the
    target's layers on (``devices``: a NULL-terminated ggml_backend_dev_t array, the servers' then
    local GPUs, as llama.cpp's --rpc). Close it after the model that uses it."""

    def __init__(self, guards: Sequence[Guard], devices: Sequence[int]):
        self.guards = tuple(guards)
        self._told: set[Guard] = set()  # lost servers a check has named
        self._array = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
        self.devices = ctypes.addressof(self._array)
        self.n_devices = len(devices)

    @classmethod
    def open(cls, servers: Iterable[str], library: Optional[str]) -> Placement:
        """Check every server (one-line RpcError for the first that cannot serve), then put a
        guard in front of each and add it to llama.cpp (``library``: the RPC backend to load where
        llama.cpp has none built in)."""
        registry = _registry()
        registry.load(library)
        infos = [check_server(s) for s in servers]
        guards: list[Guard] = []
        try:
            devices: list[int] = []
            for info in infos:
                guards.append(Guard(info))
                devices += registry.add_server(guards[-1].endpoint)
            placement = cls(guards, devices + registry.local_gpus())
            placement.check("as llama.cpp asked for its devices")
            return placement
        except BaseException:
            for g in guards:
                g.close()
            raise

    @property
    def servers(self) -> tuple[str, ...]:
        return tuple(g.server.endpoint for g in self.guards)

    def describe(self) -> str:
        return ", ".join(g.server.describe() for g in self.guards)

    def check(self, when: str) -> None:
        """RpcError where a server was lost (``when``, the first time it is told; after that, as
        lost before): the target's state lived there."""
        for g in self.guards:
            if g.lost is not None:
                told = g in self._told
                self._told.add(g)
                what = f"was lost before ({g.lost})" if told else f"{g.lost} {when}"
                raise RpcError(
                    f"rpc server {g.server.endpoint} {what}: the target's layers were there; "
                    "load the model again once the server runs"
                )

    def traffic(self) -> dict[str, dict[str, int]]:
        """Per command, over every server: calls, bytes sent to the servers and received from them."""
        out: dict[str, dict[str, int]] = {}
        for g in self.guards:
            for name, (calls, sent, received) in list(g.traffic.items()):
                row = out.setdefault(name, {"calls": 0, "sent": 0, "received": 0})
                row["calls"] += calls
                row["sent"] += sent
                row["received"] += received
        return out

    def close(self) -> None:
        for g in self.guards:
            g.close()
