"""Can this auxiliary model draft for this target?

Identical vocabularies (type, size, BOS/EOS, add-BOS flag and every token text) are the fast path:
drafts are target tokens already. Different vocabularies draft inside their intersection
(runtime/vocab.py) when enough of the target's text is draftable; ``--vocab-mismatch`` overrides:
``refuse`` insists on identical vocabularies, ``allow`` drafts however little is shared.
"""

from __future__ import annotations

from typing import Optional

from ..backend import Backend
from ..errors import IncompatiblePairError
from .vocab import MIN_COVERAGE

MISMATCH_MODES = ("auto", "allow", "refuse")


def vocab_difference(target: Backend, aux: Backend) -> Optional[str]:
    """None when both models speak the same vocabulary token for token, else the first difference.

    Stricter than llama.cpp's own rule (sizes within 128, texts from id 5): MTAD compares p(x) and
    q(x) token by token, so the fast path needs every id to mean the same text in both models."""
    t, a = target.vocab_info(), aux.vocab_info()
    for what, tv, av in (
        ("vocabulary type", t.kind, a.kind),
        ("vocabulary size", t.n_tokens, a.n_tokens),
        ("BOS token", t.bos, a.bos),
        ("EOS token", t.eos, a.eos),
        ("add-BOS flag", t.add_bos, a.add_bos),
    ):
        if tv != av:
            return f"{what} differs ({tv!r} vs {av!r})"
    for i in range(t.n_tokens):
        tt, at = t.text(i), a.text(i)
        if tt != at:
            return f"token {i} differs ({tt!r} vs {at!r})"
    return None


def check_pair(target: Backend, aux: Backend, target_name: str = "target", aux_name: str = "aux") -> None:
    """Refuse a pair unless the vocabularies are identical (the fast path, --vocab-mismatch refuse)."""
    diff = vocab_difference(target, aux)
    if diff is not None:
        raise IncompatiblePairError(f"{target_name} and {aux_name} cannot be paired: {diff}")


def mismatch_verdict(mode: str, difference: str, coverage: float, mapped: int, n_aux: int, names: str) -> str:
    """The policy for different vocabularies: the one-line notice when the pair is accepted;
    IncompatiblePairError when it is refused. ``coverage``: the share of the target's tokens on a
    text sample that have an aux twin; ``mapped``: aux tokens with a target twin."""
    shared = (
        f"{mapped:,} of {n_aux:,} aux tokens have a target twin, {coverage:.1%} of the target's tokens on a text sample"
    )
    if mode == "refuse":
        raise IncompatiblePairError(f"{names} cannot be paired: {difference} (--vocab-mismatch refuse)")
    if mode == "auto" and coverage < MIN_COVERAGE:
        raise IncompatiblePairError(
            f"{names} cannot be paired: {difference}, and too little is shared to draft ({shared}; at least "
            f"{MIN_COVERAGE:.0%} needed, --vocab-mismatch allow drafts anyway)"
        )
    return f"note: {names} have different vocabularies ({difference}); drafting in the shared tokens: {shared}"
