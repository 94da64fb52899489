"""Prompt lookup: an n-gram drafter that needs no model.

The draft is what followed the most recent earlier occurrence of the context's last n tokens
(the context: the prompt plus the text so far), trying n from ``n_max`` down to ``n_min``, so
the longest match wins. It pays off where the output copies its input (code edits, quoting,
summaries, structured text) and costs a dictionary lookup otherwise.

References (read, not copied): Hugging Face's prompt lookup (``prompt_lookup_num_tokens``;
``PromptLookupCandidateGenerator`` tries n from ``max_matching_ngram_size`` = 2 down to 1 and
drafts up to 10 tokens from the first match it finds); llama.cpp's ``--spec-type ngram-simple``
(common/ngram-map.cpp: one key size n = 12, searched backwards for the last earlier
occurrence, drafting the m = 48 tokens after it) and ``ngram-map-k`` (the same key, drafting
only once the key has been seen ``min_hits`` times, its most frequent continuation first).

A draft is a deterministic function of the context, so its q is one-hot on the drafted tokens:
sd verifies it with ``verify.match_verify`` (draw the target's token at each depth, keep the draft
while they agree), which keeps x_d with probability p_d(x_d) and is lossless.

``LookupDrafter`` is the drafter the loop asks: free (no model call), first, with a controller
per match class that prices its drafts by their verify alone and may plan a plain step where they
do not pay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .base import Draft, Drafter, Kept, Offer, Run, learn_step
from .controller import Controller, FixedController

# The longest key tried. llama.cpp's lookup and n-gram cache use keys of 1..4 tokens: copied
# text matches on its last 4 tokens at the same place a longer key would (the most recent
# occurrence wins), while a longer key only finds fewer matches and costs one more index entry
# per position (one entry per position and key size: 3 sizes x 100k tokens = 300k entries).
NGRAM_MAX = 4
# The shortest key tried. Hugging Face goes down to 1, but one token (a space, a comma, "the")
# recurs everywhere and its last continuation is a poor guess: llama.cpp drafts from 1-grams only
# behind occurrence statistics this drafter does not keep, and ngram-simple never goes below its
# key size. Each rejected draft costs target rows, so a match must be at least a bigram.
NGRAM_MIN = 2
# How far back a match is measured (the context and the earlier occurrence agree on their last
# ``matched`` tokens, counted up to this): past the top class's edge, more tells nothing new.
MATCH_CAP = 16
# Lower edges of the match classes above the first: a bigram or trigram match, 4-7 agreeing
# tokens, a copied passage of 8 or more. A long agreement is kept far more often (docs/drafting.md),
# so each class learns its own acceptance: a passage is drafted long, a chance bigram short or not.
MATCH_EDGES = (4, 8)


def match_class(matched: int) -> int:
    """The class (0 .. len(MATCH_EDGES)) of a lookup whose context agrees on ``matched`` tokens."""
    return sum(matched >= edge for edge in MATCH_EDGES)


@dataclass(frozen=True)
class Lookup:
    """A lookup draft and how many tokens (up to MATCH_CAP) its source agreed on before it."""

    tokens: np.ndarray
    matched: int


class NgramDrafter:
    """Prompt-lookup drafts over a growing token list, with an incremental index.

    ``propose(tokens, gamma)`` and ``match_len(tokens)`` take the whole committed list each
    time. The index (for each n, a dict from n-gram to the start of its last occurrence that
    has a continuation) is brought up to date by the tokens appended since the last call: O(new
    tokens) per call, not O(context). A list that does not extend the one indexed (a new
    request) is detected by cheap spot checks (its length, first token, middle token and the
    last ``n_max`` tokens indexed) and the index is rebuilt; ``reset()`` forces that. A match is
    checked against the list given before it is used, so a change the spot checks miss also
    rebuilds when it matters, and a draft is always a true continuation of an earlier occurrence.
    """

    def __init__(self, n_min: int = NGRAM_MIN, n_max: int = NGRAM_MAX) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self._tokens: list[int] = []  # the list indexed (a copy)
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.index_ops = 0  # n-grams inserted since creation: the cost, for checks
        self.rebuilds = 0  # times a list that does not extend the indexed one was detected

    def propose(self, tokens: Sequence[int], gamma: int) -> Optional[np.ndarray]:
        """Up to ``gamma`` token ids that followed the most recent earlier occurrence of the
        longest matching suffix of ``tokens`` (n_max..n_min tokens); None when none matches or
        gamma < 1. The draft stops at the end of ``tokens``: a match near the end is short."""
        found = self.lookup(tokens, gamma)
        return found.tokens if found is not None else None

    def lookup(self, tokens: Sequence[int], gamma: int) -> Optional[Lookup]:
        """``propose``'s draft with the length of the match behind it: how many tokens before the
        draft's source equal the context's last ones (at least the key's n, at most MATCH_CAP)."""
        if gamma < 1:
            return None
        n, start = self._match(tokens)
        if not n:
            return None
        stop = min(start + n + gamma, len(tokens))
        draft = np.array([int(t) for t in tokens[start + n : stop]], dtype=np.int64)
        # Walk back from before the key, at the occurrence (i) and at the context's end (k) alike.
        matched, i, k = n, start - 1, len(tokens) - n - 1
        while matched < MATCH_CAP and i >= 0 and int(tokens[i]) == int(tokens[k]):
            matched, i, k = matched + 1, i - 1, k - 1
        return Lookup(draft, matched)

    def match_len(self, tokens: Sequence[int]) -> int:
        """The n of the match ``propose`` would use (0: none): whether a free draft exists."""
        return self._match(tokens)[0]

    def reset(self) -> None:
        """Forget the indexed list (a new request); the next call indexes its list from scratch."""
        self._tokens = []
        for index in self._index.values():
            index.clear()

    # -- internals ----------------------------------------------------------------------------
    def _match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(n, start of its most recent earlier occurrence) of the longest matching suffix."""
        self._sync(tokens)
        found = self._lookup()
        if found is not None and not self._holds(tokens, *found):
            # The list changed where the spot checks did not look: index it afresh.
            self.rebuilds += 1
            self.reset()
            self._sync(tokens)
            found = self._lookup()
        return found if found is not None else (0, 0)

    @staticmethod
    def _holds(tokens: Sequence[int], n: int, start: int) -> bool:
        """``tokens`` has its last n tokens at ``start`` too."""
        size = len(tokens)
        return all(int(tokens[start + j]) == int(tokens[size - n + j]) for j in range(n))

    def _lookup(self) -> Optional[tuple[int, int]]:
        toks = self._tokens
        size = len(toks)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            start = self._index[n].get(tuple(toks[size - n :]))
            if start is not None:
                return n, start
        return None

    def _sync(self, tokens: Sequence[int]) -> None:
        """Index ``tokens``: append what is new, or start over when it does not extend the list
        indexed."""
        old = len(self._tokens)
        if not self._extends(tokens):
            self.rebuilds += 1
            self.reset()
            old = 0
        if len(tokens) > old:
            self._tokens.extend(int(t) for t in tokens[old:])
            self._insert(old)

    def _extends(self, tokens: Sequence[int]) -> bool:
        old = self._tokens
        size = len(old)
        if not size:
            return True
        if len(tokens) < size:
            return False
        spots = {0, size // 2, *range(max(size - self.n_max, 0), size)}
        return all(int(tokens[i]) == old[i] for i in spots)

    def _insert(self, old: int) -> None:
        """Index every n-gram that gained a continuation: those ending at positions old - 1 ..
        len - 2 (later starts overwrite earlier ones, so each key keeps its last occurrence)."""
        toks = self._tokens
        for end in range(max(old - 1, 0), len(toks) - 1):
            for n, index in self._index.items():
                start = end - n + 1
                if start >= 0:
                    index[tuple(toks[start : end + 1])] = start
                    self.index_ops += 1


class LookupDrafter(Drafter):
    """Prompt lookup behind the drafting protocol: a free draft of one beam, as long as the match
    allows, planned by the controller of its match class (``MATCH_EDGES``): a copied passage and a
    chance bigram are accepted at very different rates, so each learns its own; a step with no
    match is planned by the weakest class's controller."""

    name = "ngram"
    free = True

    def __init__(self, run: Run):
        super().__init__(run)
        self.index = NgramDrafter()
        self.adaptive = run.cfg.adaptive
        self.ctrls = [self._controller(c) for c in range(len(MATCH_EDGES) + 1)]
        self.ctrl = self.ctrls[0]  # the last offer's

    def _controller(self, match: int) -> FixedController | Controller:
        """'auto' prices a lookup draft by its verify alone and may take a plain step where its
        drafts do not pay."""
        cfg = self.run.cfg
        if not cfg.adaptive:
            return FixedController(cfg.max_gamma, 1)
        key = f"{self.run.key} lookup m{match}"
        model, tree = self.run.model, self.run.method.tree
        return Controller(model, key, range(0, cfg.max_gamma + 1), [1], tree=tree, free=True, pot=self.run.key)

    def offer(self, tokens: Sequence[int], cap: int, step: int, after: tuple[int, ...] = ()) -> Offer:
        found = self.index.lookup(tokens, cap)
        self.ctrl = self.ctrls[match_class(found.matched) if found is not None else 0]
        plan = self.ctrl.plan(len(found.tokens) if found is not None else 0)
        return Offer(self, plan, found.tokens if found is not None and plan.gamma else None)

    def draft(self, offer: Offer, tokens: Sequence[int], step: int) -> Draft:
        assert offer.found is not None
        return Draft.certain(offer.found[: offer.plan.gamma])

    def learn(self, offer: Offer, draft: Optional[Draft], kept: Kept, seconds: float, calls_s: float) -> None:
        learn_step(self.ctrl, offer.plan, draft, kept, seconds, calls_s)

    def idle(self, seconds: float, timed: bool) -> None:
        if isinstance(self.ctrl, Controller):
            self.ctrl.observe_plain(seconds, timed)  # lookup planned none and another drafter stepped plainly
