"""llama.cpp's RPC: the server checks and the guard against a Python ggml-rpc-server (fast), then
the target's layers on two real ggml-rpc-servers on 127.0.0.1 (slow: built by the test where this
llama.cpp has none yet): greedy tokens as the local run's, the one-line errors, a lost server
mid-request, a bounded soak, and the delay relay."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest
from click.testing import CliRunner

from mtad_edge.bench.relay import DelayRelay
from mtad_edge.cli import cli
from mtad_edge.loader import ModelOptions
from mtad_edge.runtime import rpc
from mtad_edge.runtime.errors import MtadEdgeError, RpcError
from mtad_edge.runtime.rpc import CONN_CAPS, Cmd, Guard, Placement, check_server, parse_endpoints
from rpcfake import Client, FakeServer


# -- endpoints ----------------------------------------------------------------------------------
def test_endpoints_are_parsed_and_checked_the_same_everywhere():
    assert parse_endpoints("10.0.0.2:50052, host.lan:1") == ("10.0.0.2:50052", "host.lan:1")
    assert parse_endpoints(["[::1]:50052"]) == ("[::1]:50052",)
    assert ModelOptions(rpc="127.0.0.1:5,127.0.0.1:6").rpc == ("127.0.0.1:5", "127.0.0.1:6")
    for bad, needle in [
        ("host", "not HOST:PORT"),
        ("host:0", "not HOST:PORT"),
        (":50052", "not HOST:PORT"),
        ("a b:1", "not HOST:PORT"),
        ("a:1,a:1", "twice"),
        (",".join(f"h:{p}" for p in range(1, 18)), "at most 16"),
        ([], "no server"),
        (5, "HOST:PORT"),
    ]:
        with pytest.raises(RpcError, match=needle):
            ModelOptions(rpc=bad)


def test_the_rpc_option_is_a_one_line_error_on_the_command_line():
    res = CliRunner().invoke(cli, ["generate", "--rpc", "nohost", "hi"])
    assert res.exit_code == 2 and "--rpc" in res.output and "not HOST:PORT" in res.output
    assert "Traceback" not in res.output


def test_a_manifest_names_its_rpc_servers_and_a_bad_one_is_refused(tmp_path):
    from mtad_edge.pairs import load_manifest

    data = {"schema": 1, "name": "p", "target": {"file": "t.gguf"}, "aux": {"file": "a.gguf"}}
    (tmp_path / "manifest.json").write_text(json.dumps({**data, "rpc": "h:1,h:2"}))
    assert load_manifest(tmp_path).rpc == ("h:1", "h:2")
    (tmp_path / "manifest.json").write_text(json.dumps({**data, "rpc": "h"}))
    with pytest.raises(MtadEdgeError, match="manifest.json: rpc: 'h' is not HOST:PORT"):
        load_manifest(tmp_path)


# -- the check before use -----------------------------------------------------------------------
def _closed_port() -> str:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_check_server_reads_what_llama_cpp_asks_first():
    server = FakeServer(devices=2)
    info = check_server(server.endpoint)
    assert info.version == (7, 0, 0) and info.memory == ((3 << 30, 4 << 30),) * 2
    assert info.describe() == f"{server.endpoint} (2 devices, 6.0 GiB free)"
    assert server.caps_seen == [bytes(CONN_CAPS)]
    server.close()


@pytest.mark.parametrize(
    "server,needle",
    [
        (dict(version=(6, 0, 0)), "speaks RPC protocol 6.0.0, this llama.cpp 7.0"),
        (dict(version=(7, 1, 0)), "speaks RPC protocol 7.1.0"),
        (dict(version=(8, 0, 0)), "speaks RPC protocol 8.0.0"),
        (dict(devices=0), "offers no devices"),
        (dict(mode="close"), "closed the connection or answered malformed at HELLO"),
        (dict(mode="silent"), "did not answer HELLO within 0.5 s \\(it serves one client at a time"),
    ],
)
def test_a_server_that_cannot_serve_is_one_line_before_llama_cpp_touches_it(server, needle, monkeypatch):
    monkeypatch.setattr(rpc, "HELLO_TIMEOUT_S", 0.5)
    fake = FakeServer(**server)
    t0 = time.monotonic()
    with pytest.raises(RpcError, match=needle) as e:
        check_server(fake.endpoint)
    assert time.monotonic() - t0 < 3 and "\n" not in str(e.value)
    fake.close()


def test_a_refused_or_unresolvable_server_is_one_line():
    endpoint = _closed_port()
    with pytest.raises(RpcError, match=f"rpc server {endpoint} refused the connection"):
        check_server(endpoint)
    with pytest.raises(RpcError, match="cannot resolve"):
        check_server("no-such-host.invalid:50052")


# -- the guard ----------------------------------------------------------------------------------
def _guarded(**server):
    fake = FakeServer(**server)
    guard = Guard(check_server(fake.endpoint))
    return fake, guard, Client(guard.endpoint)


def test_the_guard_relays_calls_and_counts_them():
    fake, guard, client = _guarded()
    hello = client.call(Cmd.HELLO, b"\x01" * CONN_CAPS)
    assert hello == bytes([7, 0, 0, 0]) + bytes(CONN_CAPS)  # the server's caps are not passed on
    assert fake.caps_seen[-1] == bytes(CONN_CAPS)  # nor the client's: TCP only, through the guard
    assert client.call(Cmd.ALLOC_BUFFER, struct.pack("<IQ", 0, 4096)) == struct.pack("<QQ", 0x1234, 4096)
    client.call(Cmd.SET_TENSOR, b"w" * (3 << 20))  # over CHUNK: relayed as it comes
    assert client.get_tensor(512) == bytes(range(256)) * 2
    time.sleep(0.2)
    assert fake.data[0] == b"w" * (3 << 20)
    t = guard.traffic
    assert t["SET_TENSOR"] == [1, 9 + (3 << 20), 0] and t["GET_TENSOR"][0] == 1 and t["GET_TENSOR"][2] == 8 + 512
    assert guard.lost is None
    client.close()
    guard.close()
    fake.close()


@pytest.mark.parametrize(
    "then,lost",
    [("close", "closed the connection"), ("malformed", "answered GET_TENSOR malformed"), ("silent", "gave no reply")],
)
def test_a_lost_server_is_answered_for_so_that_llama_cpp_never_aborts_or_hangs(then, lost, monkeypatch):
    monkeypatch.setattr(rpc, "REPLY_TIMEOUT_S", 1.0)
    fake, guard, client = _guarded(after=7, then=then)  # the check made 5 calls; HELLO and one more go through
    client.call(Cmd.HELLO, bytes(CONN_CAPS))
    client.call(Cmd.ALLOC_BUFFER, struct.pack("<IQ", 0, 64))
    t0 = time.monotonic()
    assert client.get_tensor(1024) == bytes(1024)  # well-formed: zeros of the size asked
    assert time.monotonic() - t0 < 3
    assert lost in guard.lost
    # every later call, on this connection or a new one, gets a reply llama.cpp's asserts take
    assert client.call(Cmd.GET_ALIGNMENT, struct.pack("<I", 0)) == struct.pack("<Q", 32)  # kept from the check
    assert client.call(Cmd.DEVICE_COUNT) == struct.pack("<I", 1)
    alloc = client.call(Cmd.ALLOC_BUFFER, struct.pack("<IQ", 0, 100))
    assert alloc is not None and struct.unpack("<QQ", alloc)[0] != 0 and struct.unpack("<QQ", alloc)[1] == 100
    base = client.call(Cmd.BUFFER_GET_BASE, struct.pack("<Q", 1))
    assert base is not None and struct.unpack("<Q", base)[0] % 4096 == 0 and base != bytes(8)
    client.call(Cmd.SET_TENSOR, b"x" * (2 << 20))
    again = Client(guard.endpoint)
    assert again.call(Cmd.HELLO, bytes(CONN_CAPS))[:3] == bytes([7, 0, 0])  # type: ignore[index]
    placement = Placement([guard], [])
    with pytest.raises(RpcError, match=f"rpc server {fake.endpoint} .*{lost}.* during a call: the target"):
        placement.check("during a call")
    placement.close()
    assert again.call(Cmd.GET_MAX_SIZE, struct.pack("<I", 0)) == struct.pack("<Q", 1 << 40)  # closed: still answered
    for c in (client, again):
        c.close()
    fake.close()


def test_the_delay_relay_adds_its_delay_each_way():
    echo = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = echo.accept()
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    with DelayRelay(f"127.0.0.1:{echo.getsockname()[1]}", 5) as relay:
        host, port = relay.endpoint.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as c:
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                c.sendall(b"ping")
                assert c.recv(4) == b"ping"
                times.append(time.perf_counter() - t0)
        assert min(times) >= 0.010  # 5 ms each way
        assert relay.achieved_ms() is not None and 5 <= relay.achieved_ms() < 50  # type: ignore[operator]
    echo.close()
