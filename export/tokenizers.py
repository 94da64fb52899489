"""Can two Hugging Face tokenizers draft for each other? Checked before anything is written, by the
same policy as pairs loaded at run time (runtime/compat.py): identical vocabularies are the fast
path; different ones are accepted with a notice when enough of the target's text is draftable in
their shared tokens, or refused (``--vocab-mismatch refuse`` insists on identical ones)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from mtad_edge.runtime.errors import IncompatiblePairError, first_line
from mtad_edge.runtime.text.compat import mismatch_verdict
from mtad_edge.runtime.text.vocab import COVERAGE_SAMPLE, build_map, piece_bytes, token_keys

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _load(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        # False, not the default None: transformers would ask on a terminal whether to run the folder's code
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # missing or unreadable tokenizer files; transformers' messages run to several lines
        raise IncompatiblePairError(f"cannot load the tokenizer in {path}: {first_line(e)}") from None


def first_difference(t: Any, a: Any) -> Optional[str]:
    """None for interchangeable tokenizers (size, special tokens, every token text), else the first difference."""
    tv, av = t.get_vocab(), a.get_vocab()
    if len(tv) != len(av):
        return f"vocabulary size {len(tv)} (target) vs {len(av)} (aux)"
    for name in SPECIAL:
        if getattr(t, name, None) != getattr(a, name, None):
            return f"{name} {getattr(t, name, None)!r} (target) vs {getattr(a, name, None)!r} (aux)"
    t_ids, a_ids = {i: s for s, i in tv.items()}, {i: s for s, i in av.items()}
    for i in range(len(tv)):
        if t_ids.get(i) != a_ids.get(i):
            return f"token {i} is {t_ids.get(i)!r} (target) vs {a_ids.get(i)!r} (aux)"
    return None


def _keys(tok: Any) -> list[bytes]:
    """Each token's bytes (control tokens: their text), as the runtime's vocabulary map reads them."""
    spec = json.loads(tok.backend_tokenizer.to_str()) if getattr(tok, "is_fast", False) else {}
    byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
    special = set(tok.all_special_ids) | {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))

    def token_bytes(i: int) -> bytes:
        return b"" if i in special else piece_bytes(pieces[i] or "", byte_level)

    return token_keys(len(tok), token_bytes, lambda i: (pieces[i] or "").encode())


def check_tokenizers(target_dir: Path, aux_dir: Path, mode: str = "auto", say: Callable[[str], None] = print) -> None:
    """Apply the pair policy to two tokenizers; IncompatiblePairError names the first difference
    (and, for too little in common, the coverage). An accepted mismatch is reported through ``say``."""
    t, a = _load(target_dir), _load(aux_dir)
    difference = first_difference(t, a)
    if difference is None:
        return
    names = "the target and aux tokenizers"
    if mode == "refuse":
        mismatch_verdict(mode, difference, 0.0, 0, len(a), names)  # raises
    vocab = build_map(_keys(t), _keys(a))
    coverage = vocab.coverage_of(t.encode(COVERAGE_SAMPLE, add_special_tokens=False))
    say(mismatch_verdict(mode, difference, coverage, vocab.mapped, len(a), names))
