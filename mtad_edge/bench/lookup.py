"""Prompt lookup's ceiling on plain decoding's own texts: the most any draft-length policy of the
shipped n-gram drafter could gain on these prompts.

A lookup draft is a deterministic function of the text so far, and sd keeps it token by token
exactly when the target's own draw agrees (``verify.match_verify``), so sd with lookup writes
text distributed as ``ar``'s. On ``ar``'s texts, then, every position has the number of lookup
tokens a draft from there would keep (with drafts up to ``gamma`` long), and the cheapest way to
cover a text by steps (a step from position i keeps j <= kept(i) tokens plus the target's own,
at the price of a verify of 1 + j rows) is what no controller that drafts lookup's tokens can
beat: it knows in advance how many will be kept and pays for no rejected row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from mtad_edge.runtime.backend import common_prefix
from mtad_edge.runtime.drafting.lookup import NgramDrafter


def keepable(prompt: Sequence[int], tokens: Sequence[int], gamma: int) -> list[int]:
    """For each position i of ``tokens``: how many of the lookup draft proposed after
    ``prompt + tokens[:i]`` (at most ``gamma`` long) equal ``tokens[i:]``, token by token."""
    drafter = NgramDrafter()
    context = list(prompt)
    kept = []
    for i in range(len(tokens)):
        draft = drafter.propose(context, gamma)
        kept.append(0 if draft is None else common_prefix(draft.tolist(), tokens[i : i + len(draft)]))
        context.append(int(tokens[i]))
    return kept


def cheapest_cover(kept: Sequence[int], price: Callable[[int], float]) -> tuple[float, int]:
    """(seconds, steps) of the cheapest steps over a text whose position i keeps up to
    ``kept[i]`` drafted tokens: a step from i keeps j of them (0 <= j <= kept[i]), commits j + 1
    tokens and costs ``price(j)``. Dynamic programming from the end of the text."""
    n = len(kept)
    best: list[tuple[float, int]] = [(0.0, 0)] * (n + 1)
    for i in range(n - 1, -1, -1):
        options = []
        for j in range(kept[i] + 1):
            s, k = best[min(i + j + 1, n)]
            options.append((price(j) + s, k + 1))
        best[i] = min(options)
    return best[0]


def ceiling(rows: list[dict[str, Any]], price: Callable[[int], float]) -> Optional[dict[str, float]]:
    """Lookup's ceiling over the ``ar`` runs that carry ``lookup_kept``: ``block_efficiency``, the
    most tokens a step any policy keeps (the fewest steps: the speed-up bound where a verify's rows
    cost what one row does), ``x_ar``, the most speed over ``ar`` with steps priced by ``price(j)``
    (seconds of a step that keeps j drafted tokens; j = 0 is a plain step), and
    ``keepable_share``, the share of positions where a lookup draft keeps anything. None without
    such runs."""
    runs = [r["lookup_kept"] for r in rows if r.get("lookup_kept") is not None]
    generated = sum(len(kept) for kept in runs)
    if not generated:
        return None
    steps = sum(cheapest_cover(kept, lambda j: 1.0)[1] for kept in runs)
    seconds = sum(cheapest_cover(kept, price)[0] for kept in runs)
    return {
        "block_efficiency": generated / steps,
        "x_ar": generated * price(0) / seconds,
        "keepable_share": sum(j > 0 for kept in runs for j in kept) / generated,
    }
