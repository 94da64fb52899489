"""A grammar's forced spans, drafted for free.

Where the constraint forces bytes (a JSON key the schema fixes, `", "` between fields, the rest of
an enum value once its first letters are out), their canonical tokens (llguidance's fast-forward
tokens, which stop before a token the next free byte could merge with: vllm-metal #650 found that
"exactly one legal token" almost never fires, because the string is forced but not its
tokenisation) are a draft that costs no model call. q is one-hot on them, so sd keeps each with
the target's masked probability and MTAD's joint test reads log q = 0 there; the target keeps them
unless it tokenises the bytes otherwise. A drafter that ``continues`` a span (the aux) drafts
after it in the same verify call, fed the span with its first call (drafting/__init__.py joins
them), so a forced span costs neither an aux call per token nor a verify of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import OptionError
from .base import Draft, Drafter, Offer, Run
from .controller import Plan


class ForcedDrafter(Drafter):
    name = "forced"
    free = True
    certain = True

    def __init__(self, run: Run):
        super().__init__(run)
        if run.constraint is None:
            raise OptionError(
                "drafter forced drafts a grammar's forced spans: give the request a constraint "
                "(a JSON schema, a grammar or a regex)",
                "drafter",
            )
        self.matcher = run.constraint

    def offer(self, tokens: Sequence[int], cap: int, step: int, after: tuple[int, ...] = ()) -> Offer:
        span = self.matcher.forced()[:cap] if cap > 0 else []
        if not span:
            return Offer(self, Plan(0, 1))
        n, target = len(span), self.run.model.target
        # Kept whole, as a forced span is unless the target tokenises it otherwise: n + 1 tokens.
        seconds = target(n + 1) if target.known else 0.0
        return Offer(self, Plan(n, 1, tokens=n + 1.0, seconds=seconds), np.array(span, dtype=np.int64))

    def draft(self, offer: Offer, tokens: Sequence[int], step: int) -> Draft:
        assert offer.found is not None
        return Draft.certain(offer.found)
