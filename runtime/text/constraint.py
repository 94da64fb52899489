"""Constrained decoding: a grammar (JSON schema, JSON object, Lark, GBNF, regex) becomes a token
mask per position, through llguidance.

Three layers, all pure (no decoding code imported here):

- ``Grammar``: what a request asks for, hashable, checked for size when made;
- ``compile(grammar, backend)``: the grammar compiled for a model's vocabulary (``Compiled``),
  bounded in time (``COMPILE_S``) and in the engine's work (``LIMITS``), cached by hash per
  vocabulary (``CACHE_GRAMMARS``); a refusal is a one-line ``OptionError``;
- ``Matcher`` (``Compiled.start``): one run's state, following the committed answer. Masks are
  asked for by *path*: the tokens after the committed answer (a drafted path, a beam's prefix, a
  tree node's), cached per step so the aux's beams and the target's verify share them.

A mask is sampling's business: ``Matcher.apply`` sets disallowed logits to -inf before
temperature, top-k and top-p read them. A row whose path leaves the grammar (an illegal drafted
token before it) is left as it is: no rule reads it (the token before it has p = 0), and a finite
row keeps the rules' numerics clean. A path that reaches a dead end (nothing allowed, or
llguidance's per-step limits) is treated the same way; the loop then cuts the committed block
where it becomes illegal and ends the run (``Matcher.commit``, ``Matcher.state``).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, TypeVar, Union

import llguidance as llg
import numpy as np

from ..backend import Backend, TokenIds
from ..errors import OptionError, first_line, quoted

Kind = Literal["json_schema", "json_object", "lark", "gbnf", "regex"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "lark", "gbnf", "regex")

# A grammar's text may be this long: compiling grows faster than linearly with it (100k Lark
# alternatives, ~1 MB, took 28 s and hit an internal assertion), 128 KiB compiles well within 2 s.
MAX_GRAMMAR_BYTES = 128 * 1024
# A grammar that takes longer to compile is refused (its compile runs on, bounded by LIMITS), so that
# a request hears within 2 s, the grammar's construction and its first mask included.
COMPILE_S = 1.5
COMPILERS = 2  # compiles at once; a request waits for a free one within its own COMPILE_S
CACHE_GRAMMARS = 32  # compiled grammars kept per vocabulary (refusals too), least recently used dropped
CACHE_ROWS = 1024  # masks a run keeps (packed: 32 KiB each on a 262k vocabulary)
CACHE_BIASES = 16  # masks kept as rows of 0 / -inf per vocabulary (1 MiB each on 262k): JSON repeats a few

# llguidance's bounds on its own work: lexer states (each 1-2 kB) and error messages that do not
# echo the grammar; the rest at its defaults (a mask step's lexer fuel and Earley items bound one
# mask to a few ms, and a run that hits them ends as a dead end).
LIMITS = llg.LLParserLimits(max_lexer_states=50_000, verbose_errors=False)

# JSON as models write it, in one line: ", " between items and ": " after keys, no other
# whitespace (an unbounded whitespace rule lets a sampled model loop on newlines, and fixed
# separators make long forced spans). A schema's own "x-guidance" object overrides these.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

OPEN, DONE, DEAD = "open", "done", "dead"  # Matcher.state: more may follow / only the end / nothing


@dataclass(frozen=True)
class Grammar:
    """A constraint on the answer: ``kind`` (json_schema, json_object, lark, gbnf, regex) and its
    ``text``. ``strict`` (JSON schema): refuse the keywords llguidance does not implement (as
    OpenAI's strict mode refuses a schema it cannot enforce), else ignore them and enforce the rest.
    Make one with the constructors; ``Grammar.of`` takes the kind as a name (a surface's field)."""

    kind: Kind
    text: str
    strict: bool = True
    # What messages call it ("the tools' grammar"; default "the KIND grammar"): not part of its identity.
    about: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise OptionError(f"unknown grammar kind {quoted(self.kind)} (choose from {', '.join(KINDS)})", "grammar")
        if not isinstance(self.text, str):
            raise OptionError(f"a {self.kind} grammar must be text, got {type(self.text).__name__}", "grammar")
        if not isinstance(self.strict, bool):
            raise OptionError(f"strict must be True or False, got {quoted(self.strict)}", "grammar")
        size = len(self.text.encode("utf-8", "surrogatepass"))
        if size > MAX_GRAMMAR_BYTES:
            raise OptionError(f"{self.what} is {size} bytes long, more than the {MAX_GRAMMAR_BYTES} allowed", "grammar")

    @property
    def what(self) -> str:
        """The grammar as one-line messages name it."""
        return self.about or f"the {self.kind} grammar"

    @classmethod
    def json_schema(cls, schema: Union[str, Mapping[str, Any]], strict: bool = True) -> Grammar:
        """A JSON schema, as text or as the dict ``json.loads`` makes of it (key order kept: it is
        the order the properties are written in)."""
        if isinstance(schema, Mapping):
            try:
                text = json.dumps(schema, ensure_ascii=False)
            except RecursionError:
                raise OptionError("the JSON schema is nested too deeply", "grammar") from None
            except (TypeError, ValueError) as e:
                raise OptionError(f"the JSON schema is not JSON: {first_line(e)}", "grammar") from None
        elif isinstance(schema, str):
            text = schema
        else:
            raise OptionError(f"a JSON schema must be an object or its text, got {quoted(schema)}", "grammar")
        return cls("json_schema", text, strict)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: json_object``)."""
        return cls("json_object", '{"type": "object"}')

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """A Lark grammar in llguidance's dialect (llama-server's ``%llguidance`` grammars)."""
        return cls("lark", text)

    @classmethod
    def gbnf(cls, text: str) -> Grammar:
        """A llama.cpp GBNF grammar (llama-server's ``grammar`` field)."""
        return cls("gbnf", text)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """A regular expression the whole answer matches (Rust regex syntax, no look-around)."""
        return cls("regex", pattern)

    @classmethod
    def of(cls, kind: str, text: Union[str, Mapping[str, Any]], strict: bool = True) -> Grammar:
        """A grammar of the kind named ``kind``, as a surface reads it from a request."""
        if kind == "json_schema":
            return cls.json_schema(text, strict)
        if kind == "json_object":
            return cls.json_object()
        if not isinstance(text, str):
            raise OptionError(f"a {kind} grammar must be text, got {type(text).__name__}", "grammar")
        return cls(kind, text)  # type: ignore[arg-type]  # __post_init__ checks the kind

    @property
    def key(self) -> str:
        """The cache key: a hash of the kind, strictness and text."""
        raw = f"{self.kind}\0{int(self.strict)}\0".encode() + self.text.encode("utf-8", "surrogatepass")
        return hashlib.sha256(raw).hexdigest()

    def source(self) -> str:
        """llguidance's grammar definition (raises ValueError where the text is not the kind it says)."""
        if self.kind in ("json_schema", "json_object"):
            overrides: Any = {"lenient": not self.strict}
            return llg.LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS, overrides=overrides)
        if self.kind == "lark":
            return llg.LLMatcher.grammar_from_lark(self.text)
        if self.kind == "gbnf":
            from llguidance.gbnf_to_lark import any_to_lark

            return llg.LLMatcher.grammar_from_lark(any_to_lark(self.text))
        return llg.LLMatcher.grammar_from_regex(self.text)


# -- vocabularies ---------------------------------------------------------------------------------
# Each byte of a packed mask as 8 logit offsets (0 allowed, -inf not), llguidance's bit order.
_BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool), 0.0, -np.inf
).astype(np.float32)


class Vocab:
    """llguidance's view of one model's vocabulary and the grammars compiled for it. ``eog``: the
    tokens that end a generation (allowed where the grammar is complete)."""

    def __init__(self, tokenizer: llg.LLTokenizer, n_vocab: int, eog: Sequence[int]):
        self.tokenizer, self.n_vocab, self.eog = tokenizer, n_vocab, tuple(eog)
        self.compiled: OrderedDict[str, Union[Compiled, str]] = OrderedDict()  # grammar key -> it, or why refused
        self.lock = threading.Lock()
        self._biases: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._eog_bytes = [(t // 8, 1 << (t % 8)) for t in self.eog]

    def bias(self, packed: bytes) -> np.ndarray:
        """A packed mask as a row to add to logits: 0 where allowed, -inf elsewhere. Built by
        table lookup (a select over a row of scattered bits costs several times more) and kept
        for the masks that recur (a string's content, a separator)."""
        with self.lock:
            found = self._biases.get(packed)
            if found is not None:
                self._biases.move_to_end(packed)
                return found
        row = np.take(_BYTE_BIAS, np.frombuffer(packed, dtype=np.uint8), axis=0).reshape(-1)[: self.n_vocab]
        with self.lock:
            self._biases[packed] = row
            while len(self._biases) > CACHE_BIASES:
                self._biases.popitem(last=False)
        return row

    def any_allowed(self, packed: bytes, ends: bool = True) -> bool:
        """Whether a packed mask allows a token of the model's vocabulary (``ends`` False: other
        than an end-of-generation token)."""
        if not ends:
            raw = bytearray(packed)
            for at, bit in self._eog_bytes:
                raw[at] &= ~bit & 0xFF
            packed = bytes(raw)
        data, n = np.frombuffer(packed, dtype=np.uint8), self.n_vocab
        return bool(data[: n // 8].any()) or bool(n % 8 and int(data[n // 8]) & ((1 << (n % 8)) - 1))


_VOCABS: weakref.WeakKeyDictionary[Any, Vocab] = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()


def vocab_of(backend: Backend) -> Vocab:
    """The backend's ``Vocab``, built on first use (a second or two on a 262k vocabulary) and
    kept as long as the backend lives."""
    with _VOCABS_LOCK:
        found = _VOCABS.get(backend)
        if found is None:
            found = _VOCABS[backend] = _build_vocab(backend)
        return found


def _build_vocab(backend: Backend) -> Vocab:
    n = backend.n_vocab
    read = getattr(backend, "special_tokens", None)
    specials = list(read().by_text.values()) if read is not None else []
    handle = getattr(backend, "vocab_handle", None)  # llama.cpp: its own reading, its own tokenizer
    if handle is not None:
        # llama.cpp's end-of-generation tokens are special ones and its EOS: asking each of 262k
        # tokens took seconds (llguidance then reads every token's text through llama.cpp itself)
        ids = {s.id for s in specials} | {backend.vocab_info().eos}
        eog = sorted(i for i in ids if 0 <= i < n and backend.is_eog(i))
        if eog:
            from llguidance.llamacpp import lltokenizer_from_vocab

            with warnings.catch_warnings():  # it asks llama-cpp-python's deprecated name, once a token
                warnings.simplefilter("ignore", DeprecationWarning)
                return Vocab(lltokenizer_from_vocab(handle, n_vocab=n, eos_token=eog), n, eog)
    eog = [i for i in range(n) if backend.is_eog(i)]
    tokens = [backend.token_bytes(i) for i in range(n)]
    for s in specials:  # control tokens are never text a grammar matches: llguidance's 0xff mark
        if s.control and 0 <= s.id < n:
            tokens[s.id] = b"\xff" + s.text.encode()
    for i in eog:
        tokens[i] = tokens[i] if tokens[i].startswith(b"\xff") else b"\xff<eog-%d>" % i
    if not eog:  # llguidance needs an end token: one past the vocabulary, never sampled
        tokens.append(b"\xff<eos>")
    ends = eog or [n]
    wrapper = llg.TokenizerWrapper(_Tokenize(backend, tokens, ends[0]))
    return Vocab(llg.LLTokenizer(wrapper, eos_token=ends), n, eog)


class _Tokenize:
    """What llguidance's TokenizerWrapper reads: the tokens' bytes, the end token and a tokenizer
    of text (no BOS, special tokens kept text)."""

    bos_token_id = None

    def __init__(self, backend: Backend, tokens: list[bytes], eos: int):
        self.tokens, self.eos_token_id = tokens, eos
        self.special_token_ids = [i for i, t in enumerate(tokens) if t.startswith(b"\xff")]
        self._backend = weakref.ref(backend)  # the Vocab is kept by the backend's life: no cycle back to it

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")  # the wrapper then hands over str, not bytes
        backend = self._backend()
        if backend is None:
            raise RuntimeError("the model of this vocabulary was closed")
        raw: Optional[Callable[[str], list[int]]] = getattr(backend, "tokenize_raw", None)
        return raw(text) if raw is not None else backend.tokenize(text, add_special=False, special=False)


# -- compiling ------------------------------------------------------------------------------------
@dataclass
class Compiled:
    """A grammar compiled for a vocabulary: the matcher every run starts from a copy of."""

    grammar: Grammar
    vocab: Vocab
    template: llg.LLMatcher = field(repr=False)

    def start(self, at: int = 0) -> Matcher:
        """A run's matcher, at the start of the answer; ``at``: the tokens of context before it
        (the prompt), so that a drafter can tell its path from a context (``Matcher.path``)."""
        return Matcher(self, at)

    def complete(self, text: str) -> bool:
        """Whether ``text`` is a whole answer of the grammar (what a stop string left of one):
        its bytes as the model's tokens, consumed from the start, end where the grammar may."""
        m = self.template.deep_copy()
        ids = self.vocab.tokenizer.tokenize_str(text)
        return m.try_consume_tokens(ids) == len(ids) and not m.is_error() and m.is_accepting()


_SLOTS = threading.BoundedSemaphore(COMPILERS)
T = TypeVar("T")


def compile(grammar: Grammar, backend: Backend) -> Compiled:
    """``grammar`` compiled for ``backend``'s vocabulary, from the cache where it was compiled (or
    refused) before; else within ``COMPILE_S``, or an OptionError naming the problem."""
    if not isinstance(grammar, Grammar):
        raise OptionError(f"a constraint must be a Grammar, got {quoted(grammar)}", "grammar")
    vocab, key = vocab_of(backend), grammar.key
    with vocab.lock:
        found = vocab.compiled.get(key)
        if found is not None:
            vocab.compiled.move_to_end(key)
    if found is None:
        try:
            found = _bounded(lambda: _compile(grammar, vocab), grammar.what)
        except OptionError as e:
            found = str(e)
        with vocab.lock:
            vocab.compiled[key] = found
            while len(vocab.compiled) > CACHE_GRAMMARS:
                vocab.compiled.popitem(last=False)
    if isinstance(found, str):
        raise OptionError(found, "grammar")
    return found


def _compile(grammar: Grammar, vocab: Vocab) -> Compiled:
    what = grammar.what
    try:
        source = grammar.source()
    except RecursionError:
        raise OptionError(f"{what} is nested too deeply", "grammar") from None
    except Exception as e:  # ValueError, TypeError, and the GBNF converter's own kinds
        raise OptionError(f"{what} is refused: {_one_line(str(e))}", "grammar") from None
    matcher = llg.LLMatcher(vocab.tokenizer, source, log_level=0, limits=LIMITS)
    matcher.compute_bitmask()  # the first mask finds a grammar that matches nothing
    if matcher.is_error():
        raise OptionError(f"{what} is refused: {_why(matcher)}", "grammar")
    return Compiled(grammar, vocab, matcher)


def _why(matcher: llg.LLMatcher) -> str:
    """llguidance's error in one short line ('NoExtensionBias': nothing the grammar allows fits)."""
    text = _one_line(matcher.get_error() or matcher.stop_reason())
    if text in ("NoExtension", "NoExtensionBias"):
        return "it matches no text the model can write"
    return text


def _one_line(text: str) -> str:
    """A grammar compiler's message in one line: its first line, and the line naming the error
    where it says more below (a regex's 'error: backreferences are not supported')."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "no reason given"
    detail = next((line for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {detail}".strip()[:200]


def _bounded(work: Callable[[], T], what: str) -> T:
    """``work()`` on a thread of its own, waited for at most COMPILE_S (with the wait for a free
    compiler): llguidance compiles without the GIL, so the server's other requests go on."""
    deadline = time.monotonic() + COMPILE_S
    if not _SLOTS.acquire(timeout=COMPILE_S):
        raise OptionError(f"{what} could not be compiled: other grammars are compiling, try again", "grammar")
    done = threading.Event()
    box: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            box.append(work())
        except BaseException as e:  # handed to the waiting request (a late one is dropped)
            failed.append(e)
        finally:
            _SLOTS.release()
            done.set()

    threading.Thread(target=run, name="mtad-grammar", daemon=True).start()
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise OptionError(f"{what} takes longer than {COMPILE_S:g} s to compile: simplify it", "grammar")
    if failed:
        if isinstance(failed[0], OptionError):
            raise failed[0]
        raise OptionError(f"{what} is refused: {_one_line(str(failed[0]))}", "grammar")
    value: T = box[0]
    return value


# -- one run ----------------------------------------------------------------------------------------
Path = tuple[int, ...]


class Matcher:
    """One run's constraint, following the committed answer (``commit``). Masks are asked for by
    path (tokens after the committed answer), computed once per path and step, and thread-safe
    (the aux drafting ahead asks beside the target's verify). ``seconds``: time spent on masks."""

    def __init__(self, compiled: Compiled, at: int = 0):
        self.compiled, self.vocab = compiled, compiled.vocab
        self.n_vocab = self.vocab.n_vocab
        self.at = at  # context tokens before the matcher's state: the prompt and the committed answer
        self.answer: list[int] = []  # the committed answer it consumed
        self.seconds = 0.0
        self._m = compiled.template.deep_copy()
        self._masks: dict[Path, Optional[bytes]] = {}  # path -> packed mask; None: illegal or a dead end
        self._lock = threading.Lock()

    # -- the committed answer ----------------------------------------------------------------------
    def commit(self, tokens: Sequence[int]) -> int:
        """Consume committed ``tokens`` up to the first end-of-generation token (included); returns
        how many of those were legal (fewer: the answer left the grammar there, and the matcher
        stays before that token)."""
        ids = [int(t) for t in tokens]
        end = next((i + 1 for i, t in enumerate(ids) if t in self.vocab.eog), len(ids))
        ids = ids[:end]
        with self._lock:
            t0 = time.perf_counter()
            n = self._m.try_consume_tokens(ids) if ids else 0
            if self._m.is_error():
                self._rebuild(self.answer + ids[:n])
            answer = ids[:n]
            if n < len(ids) and ids[n] in self.vocab.eog and self._m.is_accepting():
                n += 1  # the end of a complete answer (llguidance takes none once nothing can follow)
            self.answer += answer
            self.at += len(answer)
            done, k = tuple(answer), len(answer)
            self._masks = {p[k:]: m for p, m in self._masks.items() if p[:k] == done}  # still ahead
            self.seconds += time.perf_counter() - t0
        return n

    def state(self) -> str:
        """After the committed answer: OPEN (tokens may follow), DONE (complete: only the end of
        generation may follow) or DEAD (nothing may: a dead end, or llguidance's limits)."""
        with self._lock:
            packed = self._timed(lambda: self._packed(()))
            if packed is not None and self.vocab.any_allowed(packed, ends=False):
                return OPEN
            return DONE if self._m.is_accepting() and not self._m.is_error() else DEAD

    def path(self, context: Sequence[int], beam: Sequence[int] = ()) -> Path:
        """The path after the committed answer of ``context`` (prompt, answer, and any tokens
        beyond it a draft assumes) followed by ``beam``."""
        return (*(int(t) for t in context[self.at :]), *(int(t) for t in beam))

    # -- masks ------------------------------------------------------------------------------------
    def allowed(self, path: Sequence[int] = ()) -> Optional[np.ndarray]:
        """(V,) bool: the tokens allowed after ``path``; None where the path leaves the grammar
        or reaches a dead end."""
        with self._lock:
            packed = self._timed(lambda: self._packed(tuple(int(t) for t in path)))
        return None if packed is None else self._unpack(packed)

    def masks(self, path: Sequence[int]) -> np.ndarray:
        """(len(path) + 1, V) bool: row i the tokens allowed after ``path[:i]`` (all False from
        where the path leaves the grammar)."""
        path = [int(t) for t in path]
        out = np.zeros((len(path) + 1, self.n_vocab), dtype=bool)
        for i, packed in enumerate(self._along([tuple(path[:i]) for i in range(len(path) + 1)])):
            if packed is not None:
                out[i] = self._unpack(packed)
        return out

    def apply(self, logits: np.ndarray, paths: Sequence[Sequence[int]]) -> np.ndarray:
        """``logits`` (rows, V') with row i masked by the tokens allowed after ``paths[i]``:
        disallowed tokens -inf (a new array). Rows whose path leaves the grammar or dead-ends
        stay as they are; columns past the grammar's vocabulary are disallowed."""
        packed = self._along([tuple(int(t) for t in p) for p in paths])
        t0 = time.perf_counter()
        out = np.array(logits, copy=True)
        width = out.shape[-1]
        for i, p in enumerate(packed):
            if p is None:
                continue
            bias = self.vocab.bias(p)
            if width > self.n_vocab:  # an aux with tokens past the target's: never allowed
                out[i, self.n_vocab :] = -np.inf
            out[i, : self.n_vocab] += bias[:width]
        with self._lock:
            self.seconds += time.perf_counter() - t0
        return out

    def apply_along(self, logits: np.ndarray, draft: TokenIds) -> np.ndarray:
        """``apply`` to the last len(draft) + 1 rows of ``logits``: a target call's rows after the
        committed answer and after each drafted token."""
        draft = [int(t) for t in draft]
        n = len(draft) + 1
        rows = np.asarray(logits)
        masked = self.apply(rows[-n:], [tuple(draft[:i]) for i in range(n)])
        if len(rows) == n:
            return masked
        return np.concatenate([rows[:-n], masked])

    def legal(self, path: Sequence[int]) -> int:
        """How many leading tokens of ``path`` the grammar allows."""
        with self._lock:
            return self._timed(lambda: self._try(path, lambda m: None)[0])

    def forced(self, path: Sequence[int] = ()) -> list[int]:
        """The canonical tokens of the bytes the grammar forces after ``path`` (llguidance's
        fast-forward tokens: the forced bytes tokenised as the model would, stopping before a
        token the next free byte could merge with); [] where nothing is forced or the path is
        illegal."""
        with self._lock:
            n, ff = self._timed(lambda: self._try(path, lambda m: m.compute_ff_tokens()))
        return ff if n == len(path) and ff is not None else []

    # -- internals (under the lock) -------------------------------------------------------------
    def _along(self, paths: Sequence[Path]) -> list[Optional[bytes]]:
        with self._lock:
            return self._timed(lambda: [self._packed(p) for p in paths])

    def _timed(self, work: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        try:
            return work()
        finally:
            self.seconds += time.perf_counter() - t0

    def _packed(self, path: Path) -> Optional[bytes]:
        if path in self._masks:
            return self._masks[path]
        if len(self._masks) >= CACHE_ROWS:
            self._masks.clear()
        n, packed = self._try(path, lambda m: m.compute_bitmask())
        if packed is not None and not self.vocab.any_allowed(packed):  # only tokens past the model's vocabulary
            packed = None
        self._masks[path] = packed if n == len(path) else None
        return self._masks[path]

    def _try(self, path: Sequence[int], read: Callable[[llg.LLMatcher], Optional[T]]) -> tuple[int, Optional[T]]:
        """Consume as much of ``path`` as is legal, ``read`` the matcher there if all of it was,
        and come back to the committed answer. A read that meets a dead end leaves llguidance's
        matcher in an error state for good: it is then rebuilt from the committed answer."""
        m, ids = self._m, [int(t) for t in path]
        n = m.try_consume_tokens(ids) if ids else 0
        value = read(m) if n == len(ids) and not m.is_error() else None
        if m.is_error():
            self._rebuild(self.answer)
            return n, None
        if n:
            m.rollback(n)
        return n, value

    def _rebuild(self, answer: list[int]) -> None:
        self._m = self.compiled.template.deep_copy()
        if answer:
            self._m.try_consume_tokens(answer)

    def _unpack(self, packed: bytes) -> np.ndarray:
        bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=self.n_vocab, bitorder="little")
        return bits.view(bool)
