"""How much of a variant's text was drafted, repeat by repeat.

With ``--gamma auto`` the controller decides whether drafting pays, and on a machine whose speed
drifts that decision was what changed between two runs minutes apart (issue 73: sd drafted 387
tokens in one, 65 in the next, at the same acceptance): bench reports it beside the speed, with
its spread over repeats, so such a flip shows.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, Optional


def share(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Drafted tokens per repeat and their spread ((max - min) / median), drafted tokens over
    generated ones (over all runs and per repeat) and, where the runs say how many steps they made
    (``gamma_hist``: steps by drafted length), the share of steps that drafted."""
    repeats = sorted({r.get("repeat", 0) for r in rows})
    mine = [[r for r in rows if r.get("repeat", 0) == k] for k in repeats]
    drafted = [sum(r.get("drafted", 0) for r in rr) for rr in mine]
    generated = [sum(r.get("generated", 0) for r in rr) for rr in mine]
    middle = statistics.median(drafted) if drafted else 0
    out: dict[str, Any] = {
        "drafted_repeats": drafted,
        "drafted_spread": (max(drafted) - min(drafted)) / middle if middle > 0 else None,
        "drafted_share": sum(drafted) / sum(generated) if sum(generated) else None,
        "drafted_share_repeats": [_ratio(d, g) for d, g in zip(drafted, generated)],
    }
    if all(isinstance(r.get("gamma_hist"), dict) for r in rows) and rows:
        steps = [sum(sum(r["gamma_hist"].values()) for r in rr) for rr in mine]
        drafting = [sum(n for r in rr for k, n in r["gamma_hist"].items() if str(k) != "0") for rr in mine]
        out["drafting_steps_share"] = _ratio(sum(drafting), sum(steps))
        out["drafting_steps_share_repeats"] = [_ratio(d, s) for d, s in zip(drafting, steps)]
    return out


def _ratio(part: float, whole: float) -> Optional[float]:
    return part / whole if whole else None
