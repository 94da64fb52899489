"""Can this auxiliary model draft for this target? Both must speak the same vocabulary."""

from __future__ import annotations

from .backend import Backend
from .errors import IncompatiblePairError


def check_pair(target: Backend, aux: Backend, target_name: str = "target", aux_name: str = "aux") -> None:
    """Refuse a pair unless vocabulary type, BOS/EOS, size and every token text are equal.

    Stricter than llama.cpp's own rule (sizes within 128, texts from id 5): MTAD compares
    p(x) and q(x) token by token, so every id must mean the same text in both models.
    """
    t, a = target.vocab_info(), aux.vocab_info()
    pair = f"{target_name} and {aux_name} cannot be paired"
    for what, tv, av in (
        ("vocabulary type", t.kind, a.kind),
        ("vocabulary size", t.n_tokens, a.n_tokens),
        ("BOS token", t.bos, a.bos),
        ("EOS token", t.eos, a.eos),
        ("add-BOS flag", t.add_bos, a.add_bos),
    ):
        if tv != av:
            raise IncompatiblePairError(f"{pair}: {what} differs ({tv!r} vs {av!r})")
    for i in range(t.n_tokens):
        tt, at = t.text(i), a.text(i)
        if tt != at:
            raise IncompatiblePairError(f"{pair}: token {i} differs ({tt!r} vs {at!r})")
