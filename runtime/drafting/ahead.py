"""Drafting ahead (``--draft-ahead on``): the aux drafts the next block on a thread of its own while
the target verifies this one.

The bet: the target keeps the whole draft and then draws the token the aux finds likeliest after
it (``BeamDrafter.ahead`` drafts on that text, paused between depths). The loop joins the thread
before anything touches the aux's cache; a bet that came true is kept, and the next step takes
it where its plan is the same and the controller (which has learned since) answers the recorded
keep-going questions the same way; anything else is undone (``BeamDrafter.drop_ahead``). Each
step's draws come from a stream of their own (``Run.rng``), so a draft made ahead is the draft
the step would make: the text is the same on and off.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Optional

from .base import Draft, Run
from .beams import Ahead, BeamDrafter, KeepGoing
from .controller import Plan


class Behind:
    """A draft ahead running beside the verify: ``join`` stops it at its next depth and waits."""

    def __init__(self, future: Future[Ahead], stop: threading.Event):
        self.future, self.stop = future, stop

    def join(self) -> None:
        self.stop.set()
        wait([self.future])


class DraftingAhead:
    """The policy around ``BeamDrafter.ahead``: when to draft ahead, what the next step takes, what
    it undoes. ``counters``: the aux's (``ahead_drafts``: blocks drafted behind a verify;
    ``ahead_hits``: those the next step took)."""

    def __init__(self, beams: BeamDrafter, run: Run, counters: dict[str, Any]):
        self.beams, self.run, self.counters = beams, run, counters
        counters.update(ahead_drafts=0, ahead_hits=0)
        self.kept: Optional[Ahead] = None  # a bet that came true, for the next step
        self.behind: Optional[Behind] = None  # the one running beside this step's verify
        self._pool: Optional[ThreadPoolExecutor] = None

    def start(
        self, plan: Plan, draft: Draft, tokens: Sequence[int], step: int, keep_going: Optional[KeepGoing]
    ) -> Optional[Behind]:
        """On the aux's thread, while the target verifies ``draft``, the next step's draft as if the
        target kept all of it, planned as this step was; None where no next step could take it."""
        run = self.run
        left = run.budget() - len(draft.tokens) - 1
        if plan.alone or left < 2 or len(draft.tokens) + 1 > run.space():
            return None
        # Where the costs are known, an aux call that would end after the verify is expected to is
        # not started (the loop would wait for it), and where the guess's call alone would, none is.
        m, until = run.model, None
        if m.target.known and m.aux.known:
            verify = m.target(len(draft.tokens) + 1)
            if verify < m.aux(1):
                return None
            until = (run.clock, run.clock() + verify, m.aux)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mtad-draft-ahead")
        stop = threading.Event()
        args = (tokens, draft, plan.longest, plan.width, run.q_rows, keep_going, run.rng(step), stop, until)
        future = self._pool.submit(self.beams.ahead, *args)
        self.behind = Behind(future, stop)
        return self.behind

    def take(self, plan: Plan, keep_going: Optional[KeepGoing]) -> Optional[tuple[Draft, float]]:
        """The draft made ahead, finished, and the seconds it took behind the last verify, if it is
        the one this step would make: the same plan, and the controller's keep-going questions
        answered as they were (it has learned since); those of the depths drafted now are asked now."""
        ahead, self.kept = self.kept, None
        if ahead is None:
            return None
        if (plan.longest, plan.width, plan.alone) != (ahead.gamma, ahead.width, False) or (
            keep_going is not None and any(keep_going(d, cum) != yes for d, cum, yes in ahead.asked)
        ):
            self.beams.drop_ahead(ahead)
            return None
        self.counters["ahead_hits"] += 1
        hidden = ahead.seconds  # drafted while the last step verified (the rest is drafted now)
        return ahead.finish(), hidden

    def drop(self) -> None:
        """A draft ahead this step does not take: the aux back as the last step's commit leaves it."""
        ahead, self.kept = self.kept, None
        if ahead is not None:
            self.beams.drop_ahead(ahead)

    def settle(self, draft: Draft, k: int, last: int) -> bool:
        """After the verify of ``draft`` kept k tokens and drew ``last``: keep the block drafted
        behind it where its bet came true (the aux already holds the text and the next draft's
        beams), else undo it. False where none ran (the caller commits as usual)."""
        behind, self.behind = self.behind, None
        if behind is None:
            return False
        ahead = behind.future.result()
        self.counters["ahead_drafts"] += 1
        if k == len(draft.tokens) and last == ahead.guess:
            self.kept = ahead
        else:
            self.beams.drop_ahead(ahead, k)
        return True

    def close(self) -> None:
        if self._pool is not None:  # a step waits for its draft ahead: the thread is idle here
            self._pool.shutdown()
            self._pool = None
