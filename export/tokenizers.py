"""Are two Hugging Face tokenizers interchangeable for drafting? Checked before anything is written."""

from __future__ import annotations

from pathlib import Path

from mtad_edge.runtime.errors import IncompatiblePairError

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _load(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # missing or unreadable tokenizer files
        raise IncompatiblePairError(f"cannot load the tokenizer in {path}: {e}") from None


def check_tokenizers(target_dir: Path, aux_dir: Path) -> int:
    """Same vocabulary size, special tokens and every token text, as the runtime requires.
    Raises IncompatiblePairError naming the first difference; returns the vocabulary size."""
    t, a = _load(target_dir), _load(aux_dir)
    tv, av = t.get_vocab(), a.get_vocab()
    if len(tv) != len(av):
        raise IncompatiblePairError(f"tokenizers differ: vocabulary size {len(tv)} (target) vs {len(av)} (aux)")
    for name in SPECIAL:
        if getattr(t, name, None) != getattr(a, name, None):
            raise IncompatiblePairError(
                f"tokenizers differ: {name} {getattr(t, name, None)!r} (target) vs {getattr(a, name, None)!r} (aux)"
            )
    t_ids, a_ids = {i: s for s, i in tv.items()}, {i: s for s, i in av.items()}
    for i in range(len(tv)):
        if t_ids.get(i) != a_ids.get(i):
            raise IncompatiblePairError(
                f"tokenizers differ: token {i} is {t_ids.get(i)!r} (target) vs {a_ids.get(i)!r} (aux)"
            )
    return len(tv)
