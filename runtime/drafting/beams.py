"""Beam sampling over a model's joint probability: the aux's drafts (MTAD; width 1 is plain
sampled drafting) and the target's own beam search (``--method beam``).

``BeamDrafter`` is the mechanics on one model: ``start(tokens)`` begins a run on the committed
tokens (a prompt); ``propose(tokens, gamma, width)`` returns a Draft continuing them; ``commit(k)``
is told that the first k drafted tokens of the last draft were kept and rolls its KV cache back to
match; ``ahead`` drafts the next block as if the whole draft were kept (drafting/ahead.py says
when). With ``cross`` (drafting/cross.py) the aux speaks another vocabulary: it drafts in its own
tokens, restricted to those with a target twin, and hands over target tokens.

KV layout in the model's context: sequence 0 holds committed tokens (all but the last one or
two, which are "pending" and fed at the next propose). Beams live in sequences 1..w and
w+1..2w, used alternately: a new beam is a fresh copy of its parent's sequence plus one token.
With a unified KV cache a copy only tags cells with another seq id.

Calls of one shape (``rows``, the aux_shape option): llama.cpp's CUDA graphs are captured only
after two calls of one shape and dropped at any change, and drafting changes shape twice a step
(the pending tokens, then a row per beam). With ``rows`` = R every call evaluates R rows, each
asking for logits, in R distinct sequences: the real rows first, then filler rows (a token at
position 0 of an empty spare sequence, its logits unread); pending tokens of sequence 0 are also
tagged with spare copies of it, one fewer than they are, so they too count R sequences. Spare
sequences are the beams' 1..2W not in use, emptied before each call. A catch-up longer than R is
fed R rows a call (past ``SPLIT_MAX`` calls, all but its last R in one call, as a prefill).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..backend import Backend, Batch, common_prefix
from ..rules.repeats import Seen, ban
from ..rules.sampling import Filter, KeptRows, RankAt1, filtered_logprobs, kept_logprobs, sample_without_replacement
from ..rules.shape import Shape
from .base import Draft
from .cross import CrossVocab

SPLIT_MAX = 4  # a catch-up of more than this many calls of R rows feeds its bulk in one call

# Asked after each drafting depth d (1-based) with the best beam's cumulative log q: draft on?
KeepGoing = Callable[[int, float], bool]
# A draft being made: it pauses between depths (after a depth's beams are chosen, before the aux
# call for the next) and returns the Draft
Drafting = Generator[None, None, "Draft"]
# A draft ahead's bound: (the clock, the time by which its calls should end, an aux call's seconds by rows)
Until = tuple[Callable[[], float], float, Callable[[int], float]]


@dataclass
class Ahead:
    """The next block drafted while the target verified the last one (``BeamDrafter.ahead``),
    as far as it got: it stands if the target kept all of that draft and drew ``guess`` after it,
    and the next step plans (gamma, width) and answers ``asked`` (the drafter's keep-going
    questions) as it did; that step then finishes it."""

    guess: int
    gamma: int
    width: int
    asked: list[tuple[int, float, bool]]  # (depth, cumulative log q, answer) in the order asked
    base: int  # the draft before it: aux position of its x_1
    cached: int  # and the drafted tokens its beams held
    drafting: Drafting
    draft: Optional[Draft] = None  # once finished
    seconds: float = 0.0  # spent drafting (the guess's aux call aside)
    calls: int = 0  # aux calls made so far
    clock: Callable[[], float] = time.perf_counter

    def advance(self, stop: Optional[threading.Event] = None, until: Optional[Until] = None) -> Optional[Draft]:
        """Draft on, depth by depth, until done or ``stop`` is set (checked between depths), or
        ``until`` = (clock, deadline, seconds of an aux call by rows) says the next call would not
        end by the deadline (the verify's expected end: a call still running then is waited for)."""
        clock = self.clock
        while self.draft is None and (stop is None or not stop.is_set()):
            if until is not None:
                now, deadline, call_s = until
                if now() + call_s(2 if self.calls == 0 else self.width) > deadline:
                    break
            t0 = clock()
            try:
                next(self.drafting)
            except StopIteration as done:
                self.draft = done.value
            self.calls += 1
            self.seconds += clock() - t0
        return self.draft

    def finish(self) -> Draft:
        draft = self.advance()
        assert draft is not None
        return draft


def beam_slots(width: int) -> int:
    """Sequences a context needs for beam width w: committed + two banks of w."""
    return 2 * width + 1


def beam_cells(width: int, gamma: int) -> int:
    """KV cells the beams may hold beside the committed text: two banks of w x (gamma - 1)
    tokens, plus the pending committed tokens fed at the start of a draft."""
    return 2 * width * max(gamma - 1, 0) + 2


class BeamDrafter:
    """Beam sampling over a model's joint probability (MTAD, Qin et al. 2025).

    Step 1 draws w first tokens from q_1 (without replacement; top-w at temperature 0).
    Step d: every extension of every beam scores beam_score + log q_d(token); w of the w x V
    extensions are drawn without replacement in proportion to exp(score) (top-w at temperature 0).
    The draft is the beam with the best joint log q. Width 1 is ordinary sampling from q.
    At temperature 0 beams are ranked by the temperature-1 log q (after top-k/top-p), since the
    greedy distribution is degenerate.
    """

    def __init__(
        self,
        model: Backend,
        sampling: Filter,
        rng: np.random.Generator,
        max_width: int,
        clock: Callable[[], float] = time.perf_counter,
        cross: Optional[CrossVocab] = None,
        no_repeat: int = 0,
        shape: Shape = Shape(),
        rows: int = 0,
        counters: Optional[dict[str, Any]] = None,
    ):
        """``rows``: every call evaluates this many rows (0: what it needs), at most 2 x max_width;
        ``counters``: the dict its calls are counted in (``calls``, ``shapes``: rows -> calls,
        ``shape_changes``: calls whose rows differ from the call before, each a graph warm-up)."""
        if not 0 <= rows <= 2 * max_width:
            raise ValueError(
                f"calls of {rows} rows need more than the {2 * max_width} spare sequences of width {max_width}"
            )
        if model.n_seq_max < beam_slots(max_width):
            raise ValueError(
                f"the draft context has {model.n_seq_max} sequences, beam width {max_width} "
                f"needs {beam_slots(max_width)}"
            )
        self.model, self.rng, self.max_width, self.clock, self.cross = model, rng, max_width, clock, cross
        self.ctx: list[int] = []  # the aux's committed context: the target's own list when they share a vocabulary
        self.greedy = sampling.greedy
        self.score_cfg: Filter = (
            RankAt1(sampling.top_k, sampling.top_p, min_p=sampling.min_p) if self.greedy else sampling
        )
        self._width = max_width  # the width of the last draft (its banks of sequences)
        self._seqs, self._best = [0], 0  # after propose: each final beam's sequence, the best one
        self._cached = 0  # drafted tokens those sequences hold in their cache
        self._base = 0  # aux position of the last draft's first token
        self._beam_aux = np.zeros((1, 0), dtype=np.int64)  # the last draft's beams in aux tokens
        self._dead_aux = np.zeros((0, 0), dtype=np.int64)  # and the beams that died on the way
        self.seen = Seen(no_repeat) if no_repeat else None  # the context's n-grams a draft may not repeat
        # Penalties and a grammar's mask, each beam's row by its own path (a grammar's in the target's
        # vocabulary only: an aux of another drafts unmasked, and the verify rejects what it forbids).
        self.shape = shape if cross is None else Shape(shape.penalties)
        self.rows = rows
        self.counters: dict[str, Any] = counters if counters is not None else {}
        self.counters.update(calls=0, shapes={}, shape_changes=0)
        self._last_rows = 0  # rows of the last call made

    def start(self, tokens: list[int], prefill: bool = True) -> int:
        """A run begins on committed ``tokens``: the aux context (the same list when the vocabulary
        is shared, so it grows with it), its cache cut to the prefix it already holds and fed all
        but the last token; with ``prefill`` False, not fed yet (the first draft feeds it). Returns
        the context tokens left unfed."""
        model = self.model
        self.ctx = tokens if self.cross is None else self.cross.start(tokens)
        self._drop_beams(model.n_seq_max)
        model.rollback(0, common_prefix(model.held(0), self.ctx[:-1]))
        if prefill:
            n = len(model.held(0))
            self._decode(Batch.run(self.ctx[n:-1], n, logits="none"))
        return len(self.ctx) - 1 - len(model.held(0))

    @property
    def lagging(self) -> bool:
        """The aux cannot see all of the committed text yet (an incomplete character)."""
        return self.cross is not None and self.cross.lagging

    def propose(
        self,
        tokens: Sequence[int],
        gamma: int,
        width: int,
        rows: bool = False,
        keep_going: Optional[KeepGoing] = None,
        rng: Optional[np.random.Generator] = None,
        after: Sequence[int] = (),
    ) -> Draft:
        """Draft up to ``gamma`` tokens after ``tokens`` with ``width`` beams; ``rows`` keeps the
        filtered log q rows along the best beam (``Draft.q``); ``keep_going`` may stop the draft
        early (at least one token is always drafted); ``rng``: the draws' generator (default the
        drafter's own). ``after``: tokens the draft continues that are not committed yet (a span
        drafted by another drafter, verified in the same call): the first aux call feeds them
        with the pending tokens, and ``commit`` counts kept tokens from the first of them."""
        if self.cross is not None:
            assert not after, "a span to continue needs the target's vocabulary"
            self.cross.catch_up(self.ctx, tokens)
        ctx = [*self.ctx, *(int(t) for t in after)] if len(after) else self.ctx
        drafting = self._drafting(ctx, gamma, width, rows, keep_going, rng)
        while True:  # in line: no pause between depths
            try:
                next(drafting)
            except StopIteration as done:
                draft: Draft = done.value
                return draft

    def ahead(
        self,
        tokens: Sequence[int],
        last: Draft,
        gamma: int,
        width: int,
        rows: bool = False,
        keep_going: Optional[KeepGoing] = None,
        rng: Optional[np.random.Generator] = None,
        stop: Optional[threading.Event] = None,
        until: Optional[Until] = None,
    ) -> Ahead:
        """While the target verifies ``last`` (this drafter's last draft after ``tokens``), draft
        the next block as if the target kept all of it and then drew the token the aux finds
        likeliest after it (the guess). The aux is left as ``propose`` would leave it on that
        text, so a guess that comes true hands over the very draft the next step would make; one
        that does not is undone by ``drop_ahead``. It drafts until ``stop`` is set (the verify is
        done) or ``until`` bounds it (``Ahead.advance``), between depths; the next step finishes
        what is left. Shared vocabulary only."""
        assert self.cross is None, "a draft ahead needs the target's vocabulary"
        base, cached, n = self._base, self._cached, len(last.tokens)
        self.commit(n)  # as if every drafted token were kept: the aux holds x_1..x_{n-1}
        kept = [*tokens, *(int(t) for t in last.tokens)]
        row = self._feed(kept)  # x_n fed alone, for the aux's row after it
        if self.shape.active:
            row = self.shape.rows(row, kept, [()])
        guess = int(np.argmax(row))
        self.model.rollback(0, len(kept) - 1)  # then as the next draft finds it: x_n and the bonus unfed
        asked: list[tuple[int, float, bool]] = []

        def ask(depth: int, cum_logq: float) -> bool:
            answer = keep_going is None or keep_going(depth, cum_logq)
            asked.append((depth, cum_logq, answer))
            return answer

        drafting = self._drafting([*kept, guess], gamma, width, rows, ask, rng)
        ahead = Ahead(guess, gamma, width, asked, base, cached, drafting, clock=self.clock)
        ahead.advance(stop, until)
        return ahead

    def drop_ahead(self, ahead: Ahead, k: Optional[int] = None) -> None:
        """Undo a draft ahead: the aux as ``commit(k)`` would have left it after the draft before
        (k None: all of it kept)."""
        ahead.drafting.close()
        self.model.rollback(0, ahead.base + (ahead.cached if k is None else min(k, ahead.cached)))
        self._drop_beams(self._slots())

    def _drafting(
        self,
        ctx: list[int],
        gamma: int,
        width: int,
        rows: bool,
        keep_going: Optional[KeepGoing],
        rng: Optional[np.random.Generator],
    ) -> Drafting:
        model, clock, cross = self.model, self.clock, self.cross
        base = self._base = len(ctx)  # aux position of x_1
        self._width = width
        if self.seen is not None:
            self.seen.sync(ctx)
        t0, pending = clock(), len(ctx) - len(model.held(0))
        beam_tok = np.zeros((1, 0), dtype=np.int64)
        ids, logq = self._rows(self._feed(ctx), beam_tok, ctx)  # the current beams' rows
        seqs = [0]  # sequence of each current beam
        beam_logq = np.zeros((1, 0))
        row_of = np.zeros((1, 0), dtype=np.int64)  # which of each depth's rows every beam extended
        depth_rows: list[tuple[Optional[np.ndarray], np.ndarray]] = []  # with ``rows``: each depth's (ids, log q)
        score = np.zeros(1)
        bank = 0
        calls: list[tuple[int, float]] = []
        dead: list[np.ndarray] = []
        rng = None if self.greedy else rng if rng is not None else self.rng
        for d in range(gamma):
            cand = score[:, None] + logq  # joint log q of every extension the rows hold
            pick = sample_without_replacement(cand, width, rng)
            calls.append((pending if d == 0 else len(seqs), clock() - t0))  # an aux call and its selection
            parent, col = np.divmod(pick, logq.shape[-1])
            tok = col if ids is None else ids[parent, col]
            if d:
                alive = np.zeros(len(beam_tok), dtype=bool)
                alive[parent] = True
                if not alive.all():  # these prefixes have no child at this depth: dead ends
                    dead.append(np.pad(beam_tok[~alive], ((0, 0), (0, gamma - d)), constant_values=-1))
            beam_tok = np.concatenate([beam_tok[parent], tok[:, None]], axis=1)
            beam_logq = np.concatenate([beam_logq[parent], logq[parent, col][:, None]], axis=1)
            if rows:
                depth_rows.append((ids, logq))
                row_of = np.concatenate([row_of[parent], parent[:, None]], axis=1)
            score = cand[parent, col]
            seqs = [seqs[j] for j in parent]  # each beam's cache: its parent's, without `tok`
            if d == gamma - 1 or (keep_going is not None and not keep_going(d + 1, float(score.max()))):
                break
            yield  # between depths: a draft ahead may pause here
            # Give every beam a sequence of its own holding its parent's cache, then add `tok`.
            t0 = clock()
            new_seqs = [1 + bank * width + j for j in range(len(pick))]
            batch = Batch()
            for j, s in enumerate(new_seqs):
                model.rollback(s, 0)
                model.copy_seq(seqs[j], s)
                batch.add(tok[j], base + d, (s,), True)
            if self.rows:  # the parents are copied: their sequences may be spares now
                batch = self._pad(batch, new_seqs)
            ids, logq = self._rows(self._decode(batch)[: len(new_seqs)], beam_tok, ctx)
            seqs, bank = new_seqs, 1 - bank
        best = int(np.argmax(score))
        self._seqs, self._best, self._cached = seqs, best, beam_tok.shape[1] - 1  # each holds x_1..x_{n-1}
        self._beam_aux = beam_tok
        self._dead_aux = np.concatenate(dead) if dead else np.zeros((0, beam_tok.shape[1]), dtype=np.int64)
        q = self._q_along(depth_rows, row_of[best]) if rows else None
        ends = self._dead_aux if len(self._dead_aux) else None
        if cross is not None:  # hand over target tokens (and q over the target's vocabulary)
            beam_tok = cross.to_target(beam_tok)
            if q is not None:
                target_rows = cross.rows_to_target(q.dense())
                q = KeptRows(None, target_rows, target_rows.shape[-1])
            ends = None if ends is None else np.where(ends >= 0, cross.to_target(np.maximum(ends, 0)), -1)
        return Draft(beam_tok[best], beam_logq[best], q, beam_tok, beam_logq, best, calls, ends)

    def commit(self, k: int, beam: Optional[int] = None) -> None:
        """The target kept x_1..x_k of the last draft's ``beam`` (default: the best; indices past
        the final beams are the dead ends of ``Draft.paths(full=True)``). Sequence 0 adopts the
        cached part of them from a final beam's sequence (a dead end's cache is gone: the next
        draft feeds them); all beams are dropped. The target's bonus reaches the aux next draft.
        A negative k: the draft continued a span (``propose(after=...)``) the target kept only
        the first len(after) + k tokens of."""
        b = self._best if beam is None else beam
        base, finals = self._base, len(self._seqs)
        self.model.rollback(0, base + min(k, 0))
        m = min(k, self._cached) if b < finals and k > 0 else 0  # a beam's cache holds x_1..x_{n-1}
        if m:
            self.model.copy_seq(self._seqs[b], 0, base, base + m)
        self._drop_beams(self._slots())
        if self.cross is not None:
            path = self._beam_aux[b] if b < finals else self._dead_aux[b - finals]
            self.cross.accepted(self.ctx, path, k)

    def _decode(self, batch: Batch) -> np.ndarray:
        """The model's decode, counted (an empty batch reaches no model)."""
        n = len(batch)
        if n:
            c = self.counters
            c["calls"] += 1
            c["shapes"][n] = c["shapes"].get(n, 0) + 1
            c["shape_changes"] += n != self._last_rows
            self._last_rows = n
        return self.model.decode(batch)

    def _feed(self, ctx: Sequence[int]) -> np.ndarray:
        """Feed sequence 0 the tokens of ``ctx`` it does not hold yet (one at least); the logits row
        after the last of them, (1, V). With ``rows``: R rows a call (the module's docstring)."""
        model, r = self.model, self.rows
        n = len(model.held(0))
        run = [int(t) for t in ctx[n:]]
        if not r:
            return self._decode(Batch.run(run, n))[-1:]
        if len(run) > r * SPLIT_MAX:  # a long catch-up: its bulk as a prefill, one call
            bulk = len(run) - r
            self._decode(Batch.run(run[:bulk], n, logits="none"))
            n, run = n + bulk, run[bulk:]
        while True:
            chunk, run = run[:r], run[r:]
            logits = self._decode(self._pad(Batch.run(chunk, n, logits="all"), ()))
            n += len(chunk)
            if not run:
                return logits[len(chunk) - 1 : len(chunk)]

    def _pad(self, batch: Batch, live: Sequence[int]) -> Batch:
        """``batch`` (a run of sequence 0, or one row in each sequence of ``live``) made ``rows``
        rows in as many sequences, every row asking for logits; the spare sequences emptied first."""
        model = self.model
        spare = [s for s in range(1, 2 * self.max_width + 1) if s not in live]
        for s in spare:
            model.rollback(s, 0)
        k = len(batch)
        tags = spare[: k - 1] if not live else []  # a run of sequence 0: k - 1 copies of it
        for s in tags:
            model.copy_seq(0, s)
        out = Batch()
        for i in range(k):  # row i also in the copies i.. (each then holds a prefix of the run)
            out.add(batch.tokens[i], batch.pos[i], (*batch.seq_ids[i], *tags[i:]), True)
        for s in spare[len(tags) : len(tags) + self.rows - k]:
            out.add(batch.tokens[-1], 0, (s,), True)
        assert len(out) == self.rows, f"{k} rows do not pad to {self.rows}"
        return out

    def _slots(self) -> int:
        """The sequences the last draft may have used: its banks, or every spare."""
        return beam_slots(self.max_width if self.rows else self._width)

    def _rows(
        self, logits: np.ndarray, beam_tok: np.ndarray, ctx: list[int]
    ) -> tuple[Optional[np.ndarray], np.ndarray]:
        """Each current beam's filtered log q: (ids, rows) over its top-k tokens alone where top-k
        keeps a few (the same draws as full rows, for a fraction of the numpy work per aux call),
        else (None, rows over the whole vocabulary)."""
        if self.shape.active:
            logits = self.shape.rows(logits, ctx, beam_tok.tolist())
        kept = None if self.cross is not None else kept_logprobs(logits, self.score_cfg)
        if kept is None:
            return None, self._no_repeats(self._logq(logits), beam_tok, ctx)
        return kept[0], self._no_repeats(kept[1], beam_tok, ctx, kept[0])

    def _q_along(self, depth_rows: list[tuple[Optional[np.ndarray], np.ndarray]], row_of: np.ndarray) -> KeptRows:
        """The best beam's row of each depth (``row_of``: which of that depth's rows it extended)."""
        logq = np.stack([q[r] for (_, q), r in zip(depth_rows, row_of)])
        if depth_rows[0][0] is None:  # whole rows (no top-k, or another vocabulary)
            return KeptRows(None, logq, logq.shape[-1])
        ids = np.stack([np.asarray(i)[r] for (i, _), r in zip(depth_rows, row_of)])
        return KeptRows(ids, logq, self.model.n_vocab)

    def _no_repeats(
        self, logq: np.ndarray, beam_tok: np.ndarray, ctx: list[int], ids: Optional[np.ndarray] = None
    ) -> np.ndarray:
        """Each beam's row without the tokens that would repeat an n-gram of the text (no_repeat);
        a beam left with none dies, and where every beam would, the rows stay as they were (a
        draft needs a token). ``ids``: the rows' token ids (else a row is the whole vocabulary)."""
        if self.seen is None:
            return logq
        followers = [self.seen.followers(ctx, beam) for beam in beam_tok]
        rows = np.stack(
            [ban(row, f, None if ids is None else ids[j]) for j, (row, f) in enumerate(zip(logq, followers))]
        )
        return rows if np.isfinite(rows).any() else logq

    def _logq(self, logits: np.ndarray) -> np.ndarray:
        logq = filtered_logprobs(logits, self.score_cfg)
        if self.cross is None:
            return logq
        return self.cross.restrict(logq, np.asarray(logits), lambda x: filtered_logprobs(x, self.score_cfg))

    def _drop_beams(self, seqs: int) -> None:
        for s in range(1, seqs):  # both banks of the last draft's width; empty ones cost nothing
            self.model.rollback(s, 0)
        self._seqs, self._best, self._cached = [0], 0, 0
