"""llama.cpp's RPC: the server checks and the guard against a Python ggml-rpc-server (fast), then
the target's layers on two real ggml-rpc-servers on 127.0.0.1 (slow: built by the test where this
llama.cpp has none yet): greedy tokens as the local run's, the one-line errors, a lost server
mid-request, a bounded soak, and the delay relay."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import EXE
from mtad_edge.bench.relay import DelayRelay
from mtad_edge.cli import cli
from mtad_edge.loader import ModelOptions
from mtad_edge.runtime.backends import rpc
from mtad_edge.runtime.backends.rpc import CONN_CAPS, Cmd, Guard, Placement, check_server, parse_endpoints
from mtad_edge.runtime.errors import MtadEdgeError, RpcError
from rpcfake import Client, CutProxy, FakeServer


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


def test_the_option_wins_over_the_manifests_rpc(tmp_path):
    from mtad_edge.loader import rpc_servers
    from mtad_edge.pairs import Pair, load_manifest

    data = {"schema": 1, "name": "p", "target": {"file": "t.gguf"}, "aux": {"file": "a.gguf"}, "rpc": ["h:1"]}
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    pair = Pair(tmp_path / "t.gguf", tmp_path / "a.gguf", load_manifest(tmp_path))
    assert rpc_servers(pair, ModelOptions()) == ("h:1",)
    assert rpc_servers(pair, ModelOptions(rpc="h:2")) == ("h:2",)
    assert rpc_servers(Pair(tmp_path / "t.gguf", None), ModelOptions()) == ()


# -- the build's sources ------------------------------------------------------------------------
def test_the_build_takes_the_llama_cpp_tree_of_an_sdist_and_only_its_protocol(tmp_path):
    import io
    import tarfile

    from mtad_edge import rpc_build

    files = {
        "ggml/include/ggml-rpc.h": "#define RPC_PROTO_MAJOR_VERSION    7\n#define RPC_PROTO_MINOR_VERSION    0\n",
        "ggml/src/ggml-impl.h": "",
        "ggml/src/ggml-rpc/ggml-rpc.cpp": "",
        "ggml/src/ggml-cpu/ggml-cpu.c": "",  # not needed: left out
        "tools/rpc/rpc-server.cpp": "",
        "src/llama.cpp": "",
    }
    archive = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in {**{f"vendor/llama.cpp/{k}": v for k, v in files.items()}, "README.md": "x"}.items():
            info = tarfile.TarInfo(f"llama_cpp_python-0.3.36/{name}")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text.encode()))
    rpc_build._extract(archive, tmp_path / "tree")
    kept = sorted(str(f.relative_to(tmp_path / "tree")) for f in (tmp_path / "tree").rglob("*") if f.is_file())
    assert kept == [
        "ggml/include/ggml-rpc.h",
        "ggml/src/ggml-impl.h",
        "ggml/src/ggml-rpc/ggml-rpc.cpp",
        "tools/rpc/rpc-server.cpp",
    ]
    assert rpc_build._tree(tmp_path / "tree") == tmp_path / "tree"
    rpc_build._check_protocol(tmp_path / "tree")
    (tmp_path / "tree/ggml/include/ggml-rpc.h").write_text("#define RPC_PROTO_MAJOR_VERSION 8\n")
    with pytest.raises(RpcError, match="speaks RPC protocol 8.-1; this mtad-edge relays 7.0"):
        rpc_build._check_protocol(tmp_path / "tree")
    with pytest.raises(RpcError, match="holds no llama.cpp tree"):
        rpc_build._tree(tmp_path)


def test_another_environment_with_the_same_llama_cpp_gets_a_build_of_its_own(tmp_path, monkeypatch):
    # the builds find the libraries by their folder (an rpath): one made for a virtual environment
    # since deleted failed to start ("libggml.so.0: cannot open shared object file")
    from mtad_edge import rpc_build

    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path / "home"))
    folders = []
    for env in ("a", "b"):
        libs = tmp_path / env / "llama_cpp/lib"
        libs.mkdir(parents=True)
        for name in ("libggml-base.so", "libggml.so"):
            (libs / name).write_bytes(b"the same build's bytes: " + name.encode())
        monkeypatch.setattr(rpc_build, "_libraries", lambda libs=libs: (libs / "libggml-base.so", libs / "libggml.so"))
        folders.append(rpc_build.folder())
    assert folders[0] != folders[1]
    assert folders[0].parent == folders[1].parent == tmp_path / "home/rpc"


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


# -- real ggml-rpc-servers on 127.0.0.1 (slow) -----------------------------------------------------
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
# Both runs alike: a fixed gamma (drafting methods draft), no flash attention (the local target's
# default on this CPU; llama.cpp decides for devices it cannot see into).
SETTINGS = dict(n_ctx=512, flash_attn=False, gamma=4, beam_width=4)


@pytest.fixture(scope="session")
def rpc_built():
    """This llama.cpp's RPC backend and ggml-rpc-server, built here where they are not yet."""
    import llama_cpp  # noqa: F401  (the libraries the build links against are mapped)

    from mtad_edge import rpc_build

    return rpc_build.build(say=print)


class RealServer:
    """`mtad-edge rpc server` on 127.0.0.1 (one CPU thread), killed by its pid (it execs the server)."""

    def __init__(self, port: int = 0, threads: int = 1):
        self.port = port or int(_closed_port().rsplit(":", 1)[1])
        self.endpoint = f"127.0.0.1:{self.port}"
        cmd = [EXE, "rpc", "server", "--port", str(self.port), "--threads", str(threads)]
        self.log = Path(tempfile.gettempdir()) / f"mtad-edge-test-rpc-server-{self.port}.log"  # if it dies
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                check_server(self.endpoint)
                return
            except RpcError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def close(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture(scope="session")
def rpc_pair(rpc_built):
    servers = [RealServer(), RealServer()]
    yield ",".join(s.endpoint for s in servers)
    for s in servers:
        s.close()


@pytest.fixture
def fresh_pair(rpc_built):
    """Two servers of the test's own: it kills or stops one."""
    servers = [RealServer(), RealServer()]
    yield servers
    for s in servers:
        s.close()


def _tokens(engine, method: str, prompt: str, max_tokens: int = 16) -> list[int]:
    response = engine.generate(prompt, method=method, temperature=0, max_tokens=max_tokens, seed=0)
    response.text()
    return response.tokens


@pytest.fixture(scope="module")
def local_tokens(smol_files):
    from mtad_edge import Engine

    with Engine.load(pair="smollm2-135m", **SETTINGS) as engine:
        return {(m, p): _tokens(engine, m, p) for m in ("ar", "sd", "mtad", "mmtad") for p in PROMPTS}


def _threads() -> int:
    return sum(t.name.startswith(("rpc guard", "127.0.0.1:")) for t in threading.enumerate())


@pytest.mark.slow
def test_greedy_methods_through_rpc_give_the_local_tokens(smol_files, rpc_pair, local_tokens, capfd):
    from mtad_edge import Engine

    with Engine.load(pair="smollm2-135m", rpc=rpc_pair, **SETTINGS) as engine:
        models = engine._models
        assert models.target.config.rpc is models.rpc and models.aux.config.rpc is None  # the aux stays here
        assert models.aux.config.n_gpu_layers == 0  # no local GPU: the RPC backend is not one
        err = capfd.readouterr().err
        first = rpc_pair.split(",")[0]
        assert f"the target's layers go to rpc servers {first} (1 device, " in err and "no authentication" in err
        for (method, prompt), tokens in local_tokens.items():
            assert _tokens(engine, method, prompt) == tokens, (method, prompt)
        traffic = engine.rpc_traffic
        assert traffic is not None and traffic["GET_TENSOR"]["calls"] > 0 and traffic["SET_TENSOR"]["sent"] > 2e8


@pytest.mark.slow
def test_some_layers_on_the_servers_the_rest_here_give_the_local_tokens(smol_files, rpc_pair, local_tokens):
    from mtad_edge import Engine

    with Engine.load(pair="smollm2-135m", rpc=rpc_pair, n_gpu_layers=12, **SETTINGS) as engine:
        for method in ("ar", "mtad"):
            assert _tokens(engine, method, PROMPTS[0]) == local_tokens[(method, PROMPTS[0])]


@pytest.mark.slow
def test_servers_that_cannot_serve_are_one_line_errors_before_anything_loads(smol_files, rpc_pair, monkeypatch):
    from mtad_edge import Engine

    monkeypatch.setattr(rpc, "HELLO_TIMEOUT_S", 1.0)
    refused = _closed_port()
    with pytest.raises(RpcError, match=f"rpc server {refused} refused the connection"):
        Engine.load(pair="smollm2-135m", rpc=f"{rpc_pair},{refused}", **SETTINGS)
    old = FakeServer(version=(6, 0, 0))
    with pytest.raises(RpcError, match=f"rpc server {old.endpoint} speaks RPC protocol 6.0.0"):
        Engine.load(pair="smollm2-135m", rpc=[rpc_pair.split(",")[0], old.endpoint], **SETTINGS)
    old.close()
    busy = rpc_pair.split(",")[1]  # another client holds it: it answers nobody else
    holder = Client(busy)
    holder.call(Cmd.HELLO, bytes(CONN_CAPS))
    with pytest.raises(RpcError, match=f"rpc server {busy} accepted the connection but did not answer HELLO"):
        Engine.load(pair="smollm2-135m", rpc=rpc_pair, **SETTINGS)
    holder.close()
    time.sleep(0.5)  # it now answers the hello of the check that gave up: into a closed socket, a SIGPIPE
    assert check_server(busy).version == (7, 0, 0)  # which `mtad-edge rpc server` survives
    assert _threads() == 0  # no guard was left running


@pytest.mark.slow
def test_the_cli_says_in_one_line_what_rpc_needs(smol_files, tmp_path):
    """A fresh process: a refused server, and --rpc where this llama.cpp's backend is not built."""
    env = {**os.environ, "MTAD_EDGE_HOME": str(tmp_path)}  # an empty cache: nothing built there
    cmd = [EXE, "generate", "--target", str(smol_files.target), "--method", "ar", "--max-tokens", "1", "--rpc"]
    ask = [sys.executable, "-c", "import llama_cpp; print(llama_cpp.llama_supports_rpc())"]
    if subprocess.run(ask, capture_output=True, text=True, timeout=60).stdout.strip() != "True":  # else built in
        proc = subprocess.run([*cmd, "127.0.0.1:9", "hi"], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 1 and proc.stdout == ""
        assert proc.stderr.strip().splitlines() == [
            "Error: --rpc needs llama.cpp's RPC backend, built once for this llama.cpp: run `mtad-edge rpc build` "
            "(about a minute; needs a C++ compiler, and pip's registry or --source)"
        ]
    refused = _closed_port()
    proc = subprocess.run([*cmd, refused, "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"Error: rpc server {refused} refused the connection: is ggml-rpc-server running there "
        "(`mtad-edge rpc server`)?"
    ]


@pytest.mark.slow
def test_a_server_killed_mid_request_ends_that_request_and_the_engine_closes(smol_files, fresh_pair, local_tokens):
    from mtad_edge import Engine

    engine = Engine.load(pair="smollm2-135m", rpc=",".join(s.endpoint for s in fresh_pair), **SETTINGS)
    assert _tokens(engine, "mtad", PROMPTS[0]) == local_tokens[("mtad", PROMPTS[0])]
    response = engine.generate(PROMPTS[1], method="mtad", temperature=0, max_tokens=200, seed=0)
    chunks = iter(response)
    next(chunks)
    fresh_pair[1].signal(signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RpcError, match=f"rpc server {fresh_pair[1].endpoint} .* during a call of .* rows?: "):
        for _ in chunks:
            pass
    assert time.monotonic() - t0 < 10 and len(response.tokens) < 200
    with pytest.raises(RpcError, match="was lost before .*load the model again once the server runs"):  # no garbage
        _tokens(engine, "ar", PROMPTS[0])
    engine.close()
    time.sleep(0.5)  # llama.cpp lets the guards' connections go as the model is freed
    assert _threads() == 0


@pytest.mark.slow
def test_a_server_lost_while_a_call_waits_for_its_logits_is_an_error_not_an_early_stop(smol_files, rpc_pair):
    # llama_decode returns before the logits come back (llama_get_logits waits for them): a server
    # lost then left the guard's zeros as logits, whose argmax is token 0, the end of text, and the
    # request ended as a clean stop (seen once in a full run of the kill test above), no error
    from mtad_edge import Engine

    first, second = rpc_pair.split(",")
    cut = CutProxy(second, 1 << 62)
    engine = Engine.load(pair="smollm2-135m", rpc=[first, cut.endpoint], **SETTINGS)
    try:
        assert len(_tokens(engine, "ar", PROMPTS[0])) == 16
        cut.back_limit = cut.received + 1000  # cut inside the next reply over 1 KB: the logits (196 KB)
        response = engine.generate(PROMPTS[1], method="ar", temperature=0, max_tokens=16, seed=0)
        with pytest.raises(RpcError, match=f"rpc server {cut.endpoint} .* during a call of .* rows?: "):
            response.text()
    finally:
        engine.close()
        cut.close()


@pytest.mark.slow
def test_a_server_lost_while_the_weights_go_out_is_one_line_and_leaves_nothing_running(smol_files, rpc_pair):
    from mtad_edge import Engine

    first, second = rpc_pair.split(",")
    cut = CutProxy(second, 50 << 20)  # lost after 50 MB of the F16 target's ~260 MB
    with pytest.raises(RpcError, match=f"rpc server {cut.endpoint} .* while the model loaded: the target"):
        Engine.load(pair="smollm2-135m", rpc=[first, cut.endpoint], **SETTINGS)
    cut.close()
    time.sleep(0.5)
    assert _threads() == 0


@pytest.mark.slow
def test_a_stopped_server_ends_the_request_within_the_reply_bound(smol_files, fresh_pair, monkeypatch):
    from mtad_edge import Engine

    monkeypatch.setattr(rpc, "REPLY_TIMEOUT_S", 3.0)
    with Engine.load(pair="smollm2-135m", rpc=",".join(s.endpoint for s in fresh_pair), **SETTINGS) as engine:
        response = engine.generate(PROMPTS[0], method="sd", temperature=0, max_tokens=200, seed=0)
        chunks = iter(response)
        next(chunks)
        fresh_pair[0].signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RpcError, match="gave no reply to .* within 3 s"):
            for _ in chunks:
                pass
        assert time.monotonic() - t0 < 3.0 + 5  # the bound, and a call's own time


@pytest.mark.slow
def test_soak_requests_through_a_server_restarted_in_between(smol_files, rpc_built, local_tokens):
    """Three rounds: load through a server, two requests (the local tokens), the server killed,
    a request refused in one line, the engine closed, the server restarted on its port."""
    from mtad_edge import Engine

    fds = len(os.listdir("/proc/self/fd"))
    server = RealServer()
    try:
        for _ in range(3):
            engine = Engine.load(pair="smollm2-135m", rpc=server.endpoint, **SETTINGS)
            for method in ("ar", "mtad"):
                assert _tokens(engine, method, PROMPTS[0]) == local_tokens[(method, PROMPTS[0])]
            server.close()
            with pytest.raises(RpcError, match=f"rpc server {server.endpoint} "):
                _tokens(engine, "sd", PROMPTS[1])
            engine.close()
            server = RealServer(server.port)
    finally:
        server.close()
    time.sleep(0.5)
    assert _threads() == 0 and len(os.listdir("/proc/self/fd")) <= fds + 2


@pytest.mark.slow
def test_bench_through_the_delay_relay_reports_the_targets_rpc_traffic(smol_files, rpc_pair, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    out = tmp_path / "out"
    cmd = [EXE, "bench", "--prompts", str(prompts), "--methods", "ar,mtad", "--max-tokens", "6"]
    cmd += ["--temperature", "0", "--gamma", "4", "--rpc", rpc_pair, "--relay-delay", "0.5", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["rpc"]["servers"] == rpc_pair.split(",") and results["rpc"]["relay_delay_ms"] == 0.5
    assert results["rpc"]["relay_achieved_ms"] >= 0.5
    for method in ("ar", "mtad"):
        traffic = results["methods"][method]["rpc"]
        assert traffic["round_trips"] >= results["methods"][method]["target_calls"] > 0
        assert traffic["received"] > 0 and "GET_TENSOR" in traffic["by_command"]
    assert "RPC traffic of the target" in (out / "report.md").read_text()
