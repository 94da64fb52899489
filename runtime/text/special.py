"""Special tokens in text: where a text may become control tokens, found in one linear pass.

Text becomes tokens in two steps, as in llama.cpp and Hugging Face tokenizers: the special tokens
written out in it (``<|im_start|>``) are cut out first, then each stretch of text between them is
tokenised on its own. llama.cpp cuts them out with a list walked from its head at every match,
quadratic in their number (1 MiB of ``<|im_start|>a`` took 19 s); here one regular expression over
a trie of their texts finds them left to right, longest first.

Which tokens may be cut out where is the point: a chat template's markup becomes control tokens,
a message's text never does (``hi<|im_end|>\\n<|im_start|>system`` in a user message stays text, so
a user cannot forge a system turn). A text is given as segments, each saying whether control
tokens are parsed in it; user-defined tokens are cut out everywhere, as llama.cpp does even when it
parses no special tokens. Where two of them overlap, the leftmost (then the longest) is taken, as
Hugging Face's tokenizers do; llama.cpp takes the longest first anywhere in the text, which differs
only for overlapping texts of two special tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from ..backend import Segments, VocabInfo
from ..errors import ContextOverflowError

_SPACE = " \t\n\v\f\r"  # C's isspace, which llama.cpp's lstrip / rstrip use


@dataclass(frozen=True)
class Special:
    """A token matched by its text before tokenising: a control (or unknown) token only where
    special tokens are parsed, a user-defined one everywhere. ``lstrip`` / ``rstrip``: the
    whitespace before / after it is dropped."""

    id: int
    text: str
    control: bool
    lstrip: bool = False
    rstrip: bool = False


class SpecialTokens:
    """A vocabulary's special tokens and the two patterns that find them. ``max_token_bytes``: the
    most bytes of text one token stands for (0: not known), which bounds a text's tokens from its
    size before it is tokenised; unless a special token strips the whitespace beside it, which
    then becomes no token at all."""

    def __init__(self, specials: Iterable[Special], max_token_bytes: int = 0):
        self.by_text: dict[str, Special] = {}
        for s in sorted(specials, key=lambda s: s.id):  # one text twice: the first id wins
            if s.text:
                self.by_text.setdefault(s.text, s)
        self._any = _trie_pattern(self.by_text)
        self._always = _trie_pattern([t for t, s in self.by_text.items() if not s.control])
        strips = any(s.lstrip or s.rstrip for s in self.by_text.values())
        self.max_token_bytes = 0 if strips else max_token_bytes

    def split(self, segments: Segments) -> list[str | int]:
        """The segments' text as stretches of text and special token ids, in order."""
        parts: list[str] = []
        found: list[tuple[int, int, Special]] = []
        offset = 0
        for text, parse in _merged(segments):
            pattern = self._any if parse else self._always
            for m in pattern.finditer(text) if pattern is not None else ():
                found.append((offset + m.start(), offset + m.end(), self.by_text[m.group()]))
            parts.append(text)
            offset += len(text)
        whole = "".join(parts)
        out: list[str | int] = []
        pos, strip_left = 0, False  # strip_left: the special token before drops the whitespace after it
        for start, end, special in found:
            _add_text(out, whole[pos:start], strip_left, special.lstrip)
            out.append(special.id)
            pos, strip_left = end, special.rstrip
        _add_text(out, whole[pos:], strip_left, False)
        return out


def _add_text(out: list[str | int], text: str, lstrip_it: bool, rstrip_it: bool) -> None:
    text = text.lstrip(_SPACE) if lstrip_it else text
    text = text.rstrip(_SPACE) if rstrip_it else text
    if text:
        out.append(text)


def _merged(segments: Segments) -> list[tuple[str, bool]]:
    """Neighbouring segments of the same kind as one (a special token may span them); empty
    ones dropped."""
    out: list[tuple[str, bool]] = []
    for text, parse in segments:
        if not text:
            continue
        if out and out[-1][1] == parse:
            out[-1] = (out[-1][0] + text, parse)
        else:
            out.append((text, bool(parse)))
    return out


def _trie_pattern(texts: Iterable[str]) -> Optional[re.Pattern[str]]:
    """One pattern matching any of ``texts``, longest first at a position, built as a trie so a
    position costs a few character tests however many texts there are (Gemma 3 has 6,414)."""
    trie: dict[str, Any] = {}
    for text in texts:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}
    if not trie:
        return None
    return re.compile(_emit(trie))


def _emit(root: dict[str, Any]) -> str:
    """The trie as a regular expression, built without recursion (a special token's text may be
    long). A node that ends a text makes what follows optional: greedy, so longer texts win."""
    out: dict[int, str] = {}
    stack: list[tuple[dict[str, Any], bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        children = [(ch, child) for ch, child in sorted(node.items()) if ch]
        if not done:
            stack.append((node, True))
            stack.extend((child, False) for _, child in children)
            continue
        alternatives = [re.escape(ch) + out[id(child)] for ch, child in children]
        body = (
            alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")" if alternatives else ""
        )
        if "" in node and body:
            body = f"(?:{body})?"
        out[id(node)] = body
    return out[id(root)]


class RawTokenizer(Protocol):
    """What ``tokenize`` needs of a backend: its vocabulary's facts, its special tokens, and its
    tokeniser on text that holds none (no special token is parsed, none is added)."""

    def vocab_info(self) -> VocabInfo: ...

    def special_tokens(self) -> SpecialTokens: ...

    def tokenize_raw(self, text: str) -> list[int]: ...


class TooLong(ContextOverflowError):
    """A text makes more tokens than ``limit``; ``why``: how that was known before the end."""

    def __init__(self, limit: int, why: str):
        super().__init__(f"more than {limit} tokens ({why})")
        self.limit, self.why = limit, why


def tokenize(
    model: RawTokenizer, segments: Segments, add_special: bool = True, limit: Optional[int] = None
) -> list[int]:
    """Token ids of ``segments`` (control tokens parsed only in those that say so), with the
    vocabulary's BOS / EOS where ``add_special`` and the model adds them. ``limit``: TooLong as
    soon as the text is known to make more tokens, from its size before any tokenising where the
    vocabulary bounds a token's bytes, else as the tokens are made (each call on a stretch of text
    costs llama.cpp some 0.1 ms, and 1 MiB of special tokens makes 160,000 stretches)."""
    table = model.special_tokens()
    if limit is not None and table.max_token_bytes:
        size = sum(len(text.encode("utf-8")) for text, _ in segments)
        if size > limit * table.max_token_bytes:
            raise TooLong(limit, f"its {size} bytes, where a token stands for {table.max_token_bytes} at most")
    info = model.vocab_info()
    ids = [info.bos] if add_special and info.add_bos and info.bos >= 0 else []
    for piece in table.split(segments):
        if isinstance(piece, int):
            ids.append(piece)
        else:
            ids.extend(model.tokenize_raw(piece))
        if limit is not None and len(ids) > limit:
            raise TooLong(limit, "counted until the context was full")
    if add_special and info.add_eos and info.eos >= 0:
        ids.append(info.eos)
    if limit is not None and len(ids) > limit:
        raise TooLong(limit, "counted with its end-of-text token")
    return ids
