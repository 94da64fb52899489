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
    become one, so a stop string is never emitted in part."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""

    def push(self, piece: str) -> tuple[str, bool]:
        self.buf += piece
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[: min(hits)], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.buf.endswith(s[:k])), default=0)
        out, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold :]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out
