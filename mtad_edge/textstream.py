"""Token ids -> text, streamed without ever splitting a multi-byte UTF-8 character, and cut at
stop strings without ever emitting part of one."""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence

from mtad_edge.runtime.backend import Backend


class TextStream:
    """Feed blocks of token ids, get the text that is complete so far."""

    def __init__(self, model: Backend):
        self.model = model
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tokens: Iterable[int]) -> str:
        return self._utf8.decode(b"".join(self.model.token_bytes(int(t)) for t in tokens))

    def flush(self) -> str:
        """The end of the text: bytes held back as the start of a character that never came
        (max_tokens cut inside it) are dropped rather than shown as U+FFFD."""
        self._utf8.reset()
        return ""


def detokenize(model: Backend, tokens: Iterable[int]) -> str:
    s = TextStream(model)
    return s.push(tokens) + s.flush()


class StopText:
    """Cuts streamed text at the first stop string, holding back any tail that could still
    become one, so a stop string is never emitted in part.

    Linear in the text and the stop strings: each stop string has a Knuth-Morris-Pratt matcher
    that reads every character once, and only the tail that may still start a stop string is kept.
    (Slicing every prefix of every stop string at every push cost 43 s for 16 tokens with four
    250 kB stop strings.)"""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._matchers = [_Matcher(s) for s in self.stops]
        self.buf = ""  # text not emitted yet: the longest tail that is the start of a stop string

    def push(self, piece: str) -> tuple[str, bool]:
        base, self.buf = len(self.buf), self.buf + piece
        starts = [base + end - len(m.stop) for m in self._matchers if (end := m.feed(piece)) >= 0]
        if starts:  # the earliest start of a stop string that ends in this piece
            out, self.buf = self.buf[: min(starts)], ""
            return out, True
        hold = max((m.state for m in self._matchers), default=0)
        out, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold :]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class _Matcher:
    """Knuth-Morris-Pratt over one stop string: ``state`` is the length of the longest start of
    the stop string that the text read so far ends with."""

    def __init__(self, stop: str):
        self.stop, self.state = stop, 0
        self.fail = [0] * len(stop)  # fail[i]: the longest proper border of stop[: i + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k

    def feed(self, text: str) -> int:
        """Read ``text``; the index just past the first complete stop string in it, else -1."""
        stop, fail, k = self.stop, self.fail, self.state
        for i, c in enumerate(text):
            while k and c != stop[k]:
                k = fail[k - 1]
            if c == stop[k]:
                k += 1
                if k == len(stop):
                    self.state = fail[k - 1]
                    return i + 1
        self.state = k
        return -1
