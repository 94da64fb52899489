"""Token ids -> text, streamed without ever splitting a multi-byte UTF-8 character."""

from __future__ import annotations

import codecs
from typing import Iterable


class TextStream:
    """Feed blocks of token ids, get the text that is complete so far."""

    def __init__(self, model):
        self.model = model
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tokens: Iterable[int]) -> str:
        return self._utf8.decode(b"".join(self.model.token_bytes(int(t)) for t in tokens))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def detokenize(model, tokens: Iterable[int]) -> str:
    s = TextStream(model)
    return s.push(tokens) + s.flush()
