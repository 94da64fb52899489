"""Test helpers: a fake backend for the pure decoding logic, statistics, and the checks several
test modules share (imported as ``from helpers import ...``)."""

from __future__ import annotations

import http.client
import json
import math
import re
import shutil
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np

from mtad_edge.runtime.backend import Batch, VocabInfo, common_prefix

# The console script of this environment (beside its python), for tests that run it as a user does.
EXE = shutil.which("mtad-edge", path=str(Path(sys.executable).parent)) or shutil.which("mtad-edge")


class FakeClock:
    """Seconds that pass only when a fake model says so: call it like time.perf_counter."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeLM:
    """A deterministic toy language model implementing the Backend protocol.

    Its logits are a pseudo-random function of the *whole* context of the sequence they are
    computed in, so any mistake in KV bookkeeping (a beam evaluated on its sibling's cache, a
    rollback that keeps a stale token, a token at the wrong position) changes the distribution.
    ``salt`` makes a different model over the same vocabulary (a draft unlike its target).
    ``alphabet``: a byte-level vocabulary instead, one token per byte of it and an end-of-generation
    token after them (what a grammar's matcher needs: tokens with text, a tokenizer, an EOS).
    """

    def __init__(
        self,
        vocab: int = 5,
        salt: int = 0,
        n_ctx: int = 256,
        n_seq_max: int = 1,
        sharpness: float = 1.5,
        eog: int | None = None,
        clock: FakeClock | None = None,
        cost=None,
        alphabet: bytes | None = None,
    ):
        """``clock`` and ``cost``: each decode advances ``clock`` by ``cost(rows)`` seconds, a
        scripted machine for the adaptive controller."""
        self.clock, self.cost = clock, cost
        self.alphabet = alphabet
        if alphabet is not None:
            vocab, eog = len(alphabet) + 1, len(alphabet) if eog is None else eog
        self.n_vocab, self.salt, self.n_ctx, self.n_seq_max = vocab, salt, n_ctx, n_seq_max
        self.n_positions = n_ctx
        self.n_batch = n_ctx
        self.sharpness, self.eog = sharpness, eog
        self.seqs: dict[int, list[int]] = {}
        self.calls = 0
        self.evaluated = 0  # tokens evaluated, for prefix-reuse checks

    def logits_for(self, context: list[int]) -> np.ndarray:
        seed = hash((self.salt, *context)) % 2**32
        return (np.random.default_rng(seed).normal(size=self.n_vocab) * self.sharpness).astype(np.float32)

    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        if self.alphabet is not None:
            return [self.alphabet.index(b) for b in text.encode() if b in self.alphabet]
        return [ord(c) % self.n_vocab for c in text]

    def tokenize_segments(self, segments, add_special: bool = True, limit=None) -> list[int]:
        from mtad_edge.runtime.text.special import TooLong

        ids = self.tokenize("".join(text for text, _ in segments), add_special)
        if limit is not None and len(ids) > limit:
            raise TooLong(limit, "counted")
        return ids

    def token_bytes(self, token: int) -> bytes:
        if self.alphabet is not None:
            return self.alphabet[token : token + 1]  # the EOS token past the alphabet: b""
        return chr(ord("a") + token).encode()

    def is_eog(self, token: int) -> bool:
        return token == self.eog

    def vocab_info(self) -> VocabInfo:
        return VocabInfo("fake", self.n_vocab, 0, 1, False, lambda i: bytes([i]))

    def decode(self, batch: Batch) -> np.ndarray:
        self.calls += 1
        self.evaluated += len(batch)
        if self.clock is not None:
            self.clock.now += self.cost(len(batch))
        rows = []
        for tok, pos, seq_ids, want in zip(batch.tokens, batch.pos, batch.seq_ids, batch.logits):
            assert pos < self.n_ctx, "KV cache overflow"
            for s in seq_ids:
                assert 0 <= s < self.n_seq_max, f"seq {s} out of range"
                seq = self.seqs.setdefault(s, [])
                assert pos == len(seq), f"seq {s}: token at position {pos} but cache holds {len(seq)}"
                seq.append(tok)
            if want:
                rows.append(self.logits_for(self.seqs[seq_ids[0]]))
        return np.array(rows, dtype=np.float32).reshape(len(rows), self.n_vocab)

    def apply_chat_template(self, messages, template=None, add_assistant=True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_assistant else "")

    def held(self, seq: int) -> list[int]:
        return self.seqs.get(seq, [])

    def clear(self) -> None:
        self.seqs.clear()

    def copy_seq(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        s, d = self.seqs.get(src, []), self.seqs.setdefault(dst, [])
        lo, hi = max(p0, 0), (len(s) if p1 < 0 else p1)
        assert lo <= len(d), "copy would leave a hole"
        d[lo:hi] = s[lo:hi]

    def rollback(self, seq: int, n_keep: int) -> None:
        del self.seqs.setdefault(seq, [])[n_keep:]

    def close(self) -> None:
        pass


class SlowLM(FakeLM):
    """A FakeLM whose every decode call takes a while, so a long answer is still running when a
    test acts on it."""

    delay = 0.005

    def decode(self, batch):
        time.sleep(self.delay)
        return super().decode(batch)


def read_until(proc, pattern: str, timeout: float = 120.0) -> re.Match:
    """Read a started process's stderr (text) line by line until ``pattern`` matches; a load that
    hangs is killed after ``timeout`` s, and a process that exits first fails the test with what
    it said."""
    import pytest

    said, found = "", None
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    while (line := proc.stderr.readline()) and not (found := re.search(pattern, line)):
        said += line
    watchdog.cancel()
    if found is None:
        pytest.fail(f"server exited: {said}{proc.stderr.read()}")
    return found


def wait_until(predicate, timeout: float = 20.0) -> None:
    """Liveness, not speed: fails only if the condition never comes."""
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.01)


class Served:
    """The real app over an engine, served by uvicorn on a free loopback port in this process
    (``close()`` when done); its logs reach pytest's caplog."""

    def __init__(self, engine, queue_size: int = 2, **app_options):
        import uvicorn

        from mtad_edge.server.app import create_app

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = create_app(engine, "fake", queue_size=queue_size, **app_options)
        self.runs = self.app.state.runs
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_config=None)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started)

    def post(self, body, path: str = "/v1/completions", timeout: float = 60) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        return resp.status, json.loads(raw) if raw else {}

    def request(self, method: str, path: str, body=None, headers=None) -> tuple[int, dict, dict]:
        """Any request, with exactly the given headers (http.client adds Host, which ``headers``
        may replace): (status, lower-cased response headers, its JSON body, or {"text": ...})."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = dict(headers or {})
        conn.putrequest(method, path, skip_host="Host" in hdrs, skip_accept_encoding=True)
        for key, value in hdrs.items():
            conn.putheader(key, value)
        if data is not None:
            conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data)
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {"text": raw.decode(errors="replace")}
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body

    def stream(self, body, path: str = "/v1/completions") -> list:
        """A streamed request's events: each data line's JSON, "[DONE]" as it is."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        raw = conn.getresponse().read().decode()
        conn.close()
        data = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
        return [d if d == "[DONE]" else json.loads(d) for d in data]

    def get(self, path: str) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("GET", path)
        resp = conn.getresponse()
        out = resp.status, json.loads(resp.read())
        conn.close()
        return out

    def abandon_later(self, body, path: str = "/v1/completions") -> socket.socket:
        """Send a request on a raw socket; closing the socket is the client going away."""
        sock = socket.create_connection(("127.0.0.1", self.port))
        data = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        return sock

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.runs.close()


# Printable ASCII and a newline: a FakeLM(alphabet=...) that can write any JSON.
ASCII = bytes(range(32, 127)) + b"\n"

_FAKE_AUX = object()


def fake_engine(target=None, aux=_FAKE_AUX, **defaults):
    """The engine over fake backends: ``target`` (default: 5 sequences, room for mmtad's 4 beams)
    and ``aux`` (default: a different model over its vocabulary with 9 sequences; None: no aux),
    request ``defaults`` as keyword options."""
    from mtad_edge.engine import Engine
    from mtad_edge.loader import LoadedPair
    from mtad_edge.pairs import Pair
    from mtad_edge.runtime.config import DecodeConfig

    target = target or FakeLM(salt=1, n_seq_max=5)
    if aux is _FAKE_AUX:
        aux = FakeLM(salt=2, n_seq_max=9, vocab=target.n_vocab)
    return Engine(LoadedPair(target, aux, Pair(None, None)), DecodeConfig(**defaults))


# max_tokens of the two-token chi-square runs: a draft stops one token short of max_tokens, so a
# run of 4 lets the first draft hold 3 tokens whole (the block rule judged on a real block).
TWO_TOKEN_RUN = 4


def exact_two_token_joint(target, prompt, cfg) -> np.ndarray:
    """The exact distribution of the first two tokens a target alone samples after ``prompt``
    (flattened V x V), for chi-square tests of losslessness."""
    from mtad_edge.runtime.rules.sampling import filtered_logprobs

    p1 = np.exp(filtered_logprobs(target.logits_for(list(prompt)), cfg))
    joint = np.zeros((target.n_vocab, target.n_vocab))
    for a in range(target.n_vocab):
        if p1[a] > 0:
            joint[a] = p1[a] * np.exp(filtered_logprobs(target.logits_for([*prompt, a]), cfg))
    return joint.ravel()


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper chi-square quantile by Wilson-Hilferty; z = 3.09 is the 0.999 normal quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(observed: np.ndarray, expected_p: np.ndarray) -> tuple[float, int]:
    n = observed.sum()
    keep = expected_p > 0
    assert observed[~keep].sum() == 0, "sampled an outcome of probability 0"
    exp = expected_p[keep] * n
    return float(((observed[keep] - exp) ** 2 / exp).sum()), int(keep.sum() - 1)


def assert_rollback_equals_fresh(t, atol: float) -> None:
    """Decode 3 tokens, roll back to keep 1, decode one more: the logits equal a fresh run's."""
    ids = t.tokenize("Name a color.")
    t.rollback(0, 0)
    t.decode(Batch.run(ids, 0, logits="none"))
    t.decode(Batch.run([100, 200, 300], len(ids), logits="none"))
    t.rollback(0, len(ids) + 1)
    got = np.array(t.decode(Batch.run([555], len(ids) + 1)))[-1]
    t.rollback(0, 0)
    t.decode(Batch.run(ids, 0, logits="none"))
    t.decode(Batch.run([100], len(ids), logits="none"))
    want = np.array(t.decode(Batch.run([555], len(ids) + 1)))[-1]
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)


def generate_tokens(target, aux, prompt, cfg, **kw):
    """Run a Generation to the end: (generated token ids, stats)."""
    from mtad_edge.runtime.decoding import Generation

    gen = Generation(target, aux, prompt, cfg, **kw)
    return [t for block in gen for t in block], gen.stats


def counted(st, drafter: str, what: str = "drafted"):
    """A drafter's counter in a run's stats (``Stats.drafters``): 0 where it did not take part."""
    return st.drafters.get(drafter, {}).get(what, 0)


def greedy(target, aux, ids, n: int, method: str = "ar", drafter: str = "auto"):
    """(tokens, stats) of greedy decoding with ``method``."""
    from mtad_edge.runtime.config import DecodeConfig, SamplingConfig

    cfg = DecodeConfig(method, n, drafter=drafter, sampling=SamplingConfig(temperature=0.0))
    return generate_tokens(target, aux, ids, cfg)


def hf_greedy(hf, ids, n: int) -> list[int]:
    """Greedy continuation of ``ids`` by a transformers model."""
    import torch

    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def greedy_agreement(ours, hf_dir, cpp, prompts, n: int = 24) -> tuple[dict[str, int], int]:
    """Leading tokens of greedy ar on ``ours`` shared with the HF model in ``hf_dir`` and with the
    llama.cpp backend ``cpp``, summed over prompts; and the number of reference tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    agree, total = {"hf": 0, "llama.cpp F16": 0}, 0
    for p in prompts:
        ids = ours.tokenize(p)
        mine, _ = greedy(ours, None, ids, n)
        ref = hf_greedy(hf, ids, n)
        for key, other in (("hf", ref), ("llama.cpp F16", greedy(cpp, None, cpp.tokenize(p), n)[0])):
            agree[key] += common_prefix(mine, other)
        total += len(ref)
    return agree, total


def assert_drafting_equals_greedy_ar(target, aux, method: str, prompts, n: int) -> list:
    """Greedy ``method`` drafting with ``aux`` alone (the pair's two backends under test, no prompt
    lookup beside it) gives greedy ar's tokens on every prompt; returns the stats."""
    stats = []
    for p in prompts:
        ids = target.tokenize(p)
        out, st = greedy(target, aux, ids, n, method, drafter="aux")
        assert out == greedy(target, None, ids, n)[0], (method, p)
        stats.append(st)
    return stats


def logits_fresh(model, *chunks):
    """Last-row logits after decoding ``chunks`` one batch each into an emptied sequence 0.
    Tests compare runs with the same batch shapes: llama.cpp's numerics depend on them."""
    model.rollback(0, 0)
    pos = 0
    for c in chunks:
        out = model.decode(Batch.run(c, pos))
        pos += len(c)
    return np.array(out)[-1]


def logits_after_rollback(model, ids):
    """Decode ``ids``, token 100, a draft (200, 300, 400) that is then rolled back, and token 555:
    the last logits, to set against ``logits_fresh(fresh, ids, [100], [555])``."""
    model.rollback(0, 0)
    model.decode(Batch.run(ids, 0, logits="none"))
    model.decode(Batch.run([100], len(ids)))
    model.decode(Batch.run([200, 300, 400], len(ids) + 1))  # a draft, then rejected
    model.rollback(0, len(ids) + 1)
    return np.array(model.decode(Batch.run([555], len(ids) + 1)))[-1]


def assert_beams_match_single_sequences(model, ref, ids, beam_tokens=(10, 20, 30)) -> None:
    """Beams as the rows of one batch of ``model`` give ``ref``'s single-sequence logits (one
    sequence, in a call of more than one row too: a one-row call rounds otherwise)."""
    got = decode_beams(model, ids, list(beam_tokens))
    for row, tok in zip(got, beam_tokens):
        want = logits_fresh(ref, ids[:-1], [ids[-1], tok])
        # Rounding, not bookkeeping: on a 2-core AMD EPYC (AVX2, no AVX-512) the Q4_0 aux's repacked
        # kernels gave one beam token of three logits 0.53 off (every logit) wherever it was not the
        # batch's first row, and the others exact; a beam on another sequence's cells is off by more.
        np.testing.assert_allclose(row, want, rtol=0, atol=1.0)
        assert row.argmax() == want.argmax()
    for s in range(1, len(beam_tokens) + 1):
        model.rollback(s, 0)


def decode_beams(model, prompt_ids, beam_tokens):
    """Prefill ``prompt_ids`` in sequence 0, give each beam (sequences 1..n) a copy of it, and
    evaluate one token per beam in a single batch. Returns the logits rows, one per beam."""
    from mtad_edge.runtime.backend import Batch

    model.rollback(0, 0)
    model.decode(Batch.run(prompt_ids, 0, logits="none"))
    batch = Batch()
    for s, tok in enumerate(beam_tokens, start=1):
        model.rollback(s, 0)
        model.copy_seq(0, s)
        batch.add(tok, len(prompt_ids), (s,), True)
    return np.array(model.decode(batch))


def record_trees(monkeypatch):
    """Capture the beams of every tree MMTAD verifies, in order."""
    import mtad_edge.runtime.methods.mmtad as mmtad

    seen = []
    real = mmtad.TokenTree.from_beams

    def spy(beams):
        seen.append(np.array(beams))
        return real(beams)

    monkeypatch.setattr(mmtad.TokenTree, "from_beams", staticmethod(spy))
    return seen


def record_drafts(gen, monkeypatch):
    """Capture, for every step of ``gen``, the tokens generated before it and how many it drafted."""
    steps, step = [], gen.method.step

    def spy(view, gamma, width, draft):
        steps.append((gen.stats.generated, 0 if draft is None else len(draft.tokens)))
        return step(view, gamma, width, draft)

    monkeypatch.setattr(gen.method, "step", spy)
    return steps


def assert_blocks_follow_trees(blocks, trees, accept_lengths):
    """Each committed block is k tokens along one drafted beam, then the bonus token."""
    assert len(blocks) == len(trees) == len(accept_lengths)
    for block, beams, k in zip(blocks, trees, accept_lengths):
        assert len(block) == k + 1
        assert k == 0 or any(list(b[:k]) == block[:k] for b in beams.tolist()), (block, beams)


def near_tie_at_first_difference(target, ids, ar, out, tol: float):
    """None when ``out`` equals greedy ``ar``; else the first position where they differ, after
    asserting it is a near-tie: the target's top two tokens there (a fresh one-row decode of the
    prompt and ar's prefix) are ar's and out's, within ``tol`` logits. llama.cpp's numerics
    depend on batch shape, so a multi-row verify may round such a tie the other way."""
    if out == ar:
        return None
    i = next((i for i, (x, y) in enumerate(zip(ar, out)) if x != y), min(len(ar), len(out)))
    assert i < min(len(ar), len(out)), "one run stopped early while the other went on"
    target.clear()
    logits = np.array(target.decode(Batch.run(list(ids) + list(ar[:i]), 0, logits="last"))[-1])
    top = np.argsort(-logits)[:2]
    margin = float(logits[top[0]] - logits[top[1]])
    assert set(top) == {ar[i], out[i]} and margin < tol, (i, ar[i], out[i], top, margin)
    return i


def scripted_pair(aux_salt, aux_cost):
    """A fake target (10 ms a call plus 0.5 ms a row) and aux (``aux_cost(rows)``) whose calls
    advance one scripted clock: the adaptive controller's loop without a real machine."""
    clock = FakeClock()
    target = FakeLM(salt=1, n_seq_max=9, n_ctx=4096, clock=clock, cost=lambda rows: 0.010 + 0.0005 * rows)
    aux = FakeLM(salt=aux_salt, n_seq_max=17, n_ctx=4096, clock=clock, cost=aux_cost)
    return clock, target, aux


class AgreeingLM(FakeLM):
    """An aux that agrees with ``target`` as far as ``noise`` lets it: its logits are the target's
    plus ``noise`` times its own pseudo-random ones (0.8 over 5 tokens: at temperature 0 it keeps
    depth 1 of a draft 56 % of the time, depth 2 32 %, as an x4 stand-in's aux does). ``noise``
    may be a function of nothing, read at each call (an aux whose agreement changes)."""

    def __init__(self, target: FakeLM, noise, **kw):
        super().__init__(**kw)
        self.target, self.noise = target, noise

    def logits_for(self, context: list[int]) -> np.ndarray:
        noise = self.noise() if callable(self.noise) else self.noise
        return self.target.logits_for(context) + np.float32(noise) * super().logits_for(context)


def drifting_pair(speed, target_cost, aux_cost, noise=0.8, vocab=5, aux_speed=None):
    """A fake target and an ``AgreeingLM`` aux whose calls advance one scripted clock by their
    cost times the machine's ``speed(now)`` (1: steady; a wave of 0.7..1.3, say; ``aux_speed``:
    the aux's own, else the same): (clock, target, aux). ``clock.work`` sums the calls' costs at
    speed 1 (seconds a steady machine would have taken)."""
    clock = FakeClock()
    clock.work = 0.0

    def charged(cost, speed):
        def charge(rows: int) -> float:
            clock.work += cost(rows)
            return cost(rows) * speed(clock.now)

        return charge

    target = FakeLM(vocab, 1, 8192, 9, clock=clock, cost=charged(target_cost, speed))
    aux = AgreeingLM(target, noise, vocab=vocab, salt=7, n_ctx=8192, n_seq_max=17, clock=clock)
    aux.cost = charged(aux_cost, aux_speed or speed)
    return clock, target, aux


def deterministic_q(tokens: np.ndarray, n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The draft distribution of a deterministic draft (a prompt lookup) as sd's q-reading rules
    take it: (logq_x, q_rows), log q = 0 at each drafted token and -inf elsewhere in its row."""
    tokens = np.asarray(tokens, dtype=np.int64)
    rows = np.full((len(tokens), n_vocab), -np.inf)
    rows[np.arange(len(tokens)), tokens] = 0.0
    return np.zeros(len(tokens)), rows


# -- crafted GGUF files: a real model's metadata rewritten in front of its unchanged tensor data --
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
GGUF_U32, GGUF_STRING = 4, 8


def _gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def gguf_kv(key: str | bytes, vtype: int, value) -> bytes:
    """One metadata entry: a key, its value type, its value (an int for scalars, text for strings)."""
    if vtype == GGUF_STRING:
        return _gguf_string(key) + struct.pack("<I", vtype) + _gguf_string(value)
    fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}[vtype]
    return _gguf_string(key) + struct.pack("<I", vtype) + struct.pack(fmt, value)


def rewrite_gguf(
    src: Path, dest: Path, set_ints: dict | None = None, extra: list[bytes] = (), first: list[bytes] = ()
) -> Path:
    """``src`` with the integer keys of ``set_ints`` given new values (uint32 entries added where
    missing), the raw entries ``first`` put before its metadata and ``extra`` after it; tensor infos
    and data unchanged (re-aligned to 32 bytes, GGUF's default alignment)."""
    data = src.read_bytes()
    off = 4
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, off)
    off += 20
    todo = dict(set_ints or {})
    entries = []

    def skip_value(vtype: int, at: int) -> int:
        if vtype in _GGUF_SCALARS:
            return at + _GGUF_SCALARS[vtype]
        if vtype == GGUF_STRING:
            return at + 8 + struct.unpack_from("<Q", data, at)[0]
        etype, count = struct.unpack_from("<IQ", data, at)
        at += 12
        if etype in _GGUF_SCALARS:
            return at + _GGUF_SCALARS[etype] * count
        for _ in range(count):
            at = skip_value(etype, at)
        return at

    for _ in range(n_kv):
        start = off
        n = struct.unpack_from("<Q", data, off)[0]
        key = data[off + 8 : off + 8 + n].decode()
        off += 8 + n
        vtype = struct.unpack_from("<I", data, off)[0]
        end = skip_value(vtype, off + 4)
        entries.append(gguf_kv(key, vtype, todo.pop(key)) if key in todo else data[start:end])
        off = end
    entries = list(first) + entries + [gguf_kv(k, GGUF_U32, v) for k, v in todo.items()] + list(extra)
    infos_start = off
    for _ in range(n_tensors):
        n = struct.unpack_from("<Q", data, off)[0]
        off += 8 + n
        n_dims = struct.unpack_from("<I", data, off)[0]
        off += 4 + 8 * n_dims + 4 + 8
    infos = data[infos_start:off]
    tensor_data = data[off + (-off % 32) :]
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(entries)) + b"".join(entries) + infos
    dest.write_bytes(head + b"\0" * (-len(head) % 32) + tensor_data)
    return dest


# -- fake models with vocabularies of their own (drafting across vocabularies) -------------------
# Token 0 is a control token in both (it prints nothing). The target has "ba" and "cd" the aux
# lacks; the aux has "dc" and "e" the target lacks; "a", "b", "c", "d", "ab" are shared.
TARGET_PIECES = [b"", b"a", b"b", b"c", b"ab", b"ba", b"cd", b"d"]
AUX_PIECES = [b"", b"b", b"a", b"d", b"ab", b"c", b"dc", b"e"]
PROMPT_PIECES = [1, 2, 3]  # "abc" in the target's vocabulary


class PieceLM(FakeLM):
    """A fake model with a vocabulary of text pieces; tokenize is greedy longest match."""

    def __init__(self, pieces, **kw):
        super().__init__(vocab=len(pieces), **kw)
        self.pieces = pieces

    def tokenize(self, text, add_special=True):
        data, out, i = text.encode(), [], 0
        while i < len(data):
            fits = [j for j, p in enumerate(self.pieces) if p and data.startswith(p, i)]
            if not fits:
                i += 1
                continue
            best = max(fits, key=lambda j: len(self.pieces[j]))
            out.append(best)
            i += len(self.pieces[best])
        return out

    def token_bytes(self, token):
        return self.pieces[token]

    def vocab_info(self):
        return VocabInfo("pieces", len(self.pieces), -1, -1, False, lambda i: self.pieces[i] or b"<control>")


def cross_pair(target_salt=1, aux_salt=2, sharpness=1.0):
    target = PieceLM(TARGET_PIECES, salt=target_salt, n_seq_max=17, n_ctx=512, sharpness=sharpness)
    aux = PieceLM(AUX_PIECES, salt=aux_salt, n_seq_max=9, n_ctx=512, sharpness=sharpness)
    from mtad_edge.runtime.text.vocab import map_models

    return target, aux, map_models(target, aux)
