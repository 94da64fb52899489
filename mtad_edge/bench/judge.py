"""An independent judge: the perplexity of every run's text under a model that took no part in
making it.

Why: the target's PPL is scored by the model that verified the text, and MTAD optimises exactly
that, so a lower target PPL partly measures agreement with the verifier. A judge (another model,
e.g. Gemma 3 270M for SmolLM2 or the reverse) reads the same *text*: it re-tokenises the prompt
and the prompt followed by the answer with its own tokenizer and scores the answer's tokens under
its own raw logits (mtad_edge.logprobs.token_logprobs).

The answer's tokens are those of ``tokenize(prompt + answer)`` beyond its common prefix with
``tokenize(prompt)``: where the tokenizer merges the prompt's last characters with the answer's
first (a trailing space and the next word), the merged token is scored as part of the answer. A
chat prompt is rendered with the judge's own chat template (its manifest's, else its GGUF's), so
the judge reads the conversation in the form it knows; a judge without a template reads the text
the pair's template made, and a raw prompt is read as is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from mtad_edge.loader import LoadedPair, ModelOptions, load_backend
from mtad_edge.logprobs import token_logprobs
from mtad_edge.pairs import Pair, resolve
from mtad_edge.runtime.backend import Backend, common_prefix
from mtad_edge.runtime.errors import MtadEdgeError

TEMPLATE_ROOM = 256  # bytes a chat template may add around the messages (the judge's context is sized by bytes)
TOKENS_PER_TOKEN = 4  # room for the answer: judge tokens per generated token (English text: about 1)


def locate(ref: str, say: Callable[[str], None] = lambda s: None) -> Pair:
    """``--judge PAIR|GGUF``: a pair name or manifest (its target model), a GGUF file, or an
    ``hf:`` reference; the one-line error for anything else."""
    path = Path(ref)
    try:
        if path.is_dir():
            raise MtadEdgeError(f"--judge {ref}: a folder; the judge is a pair name or a GGUF file")
        if (path.is_file() and path.suffix == ".json") or not (path.exists() or _looks_like_a_file(ref)):
            pair = resolve(pair=ref, say=say)  # a named pair or a manifest: its target
        else:
            pair = resolve(target=ref, say=say)
    except MtadEdgeError as e:
        raise MtadEdgeError(f"--judge {ref}: {e}") from None
    assert pair.target is not None
    _check_gguf(ref, Path(pair.target))
    return pair


def _looks_like_a_file(ref: str) -> bool:
    return ref.startswith("hf:") or ref.endswith(".gguf") or "/" in ref or "\\" in ref


def _check_gguf(ref: str, path: Path) -> None:
    if not path.is_file():
        raise MtadEdgeError(f"--judge {ref}: no such file {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise MtadEdgeError(f"--judge {ref}: {path} is not a GGUF file (it starts with {magic!r})")


def context_for(items: Sequence[dict[str, Any]], rendered: Sequence[str], max_tokens: int) -> int:
    """A context that holds any prompt and its answer in the judge's tokens: a token is at least one
    byte (plus BOS), a chat template adds at most ``TEMPLATE_ROOM`` bytes, and an answer of
    ``max_tokens`` tokens is taken to need at most ``TOKENS_PER_TOKEN`` judge tokens each (a run
    that does not fit is scored as far as it fits and counted in ``judge_truncated``)."""
    room = 0
    for item, text in zip(items, rendered):
        chat = sum(len(f"{m.get('role', '')}{m.get('content', '')}".encode()) for m in item.get("messages", []))
        room = max(room, len(text.encode()), chat + TEMPLATE_ROOM)
    return room + 8 + TOKENS_PER_TOKEN * max_tokens


class Judge:
    """One judge model (``n_seq_max`` 1), loaded once per bench; a context manager that frees it."""

    def __init__(self, model: Backend, pair: Pair, label: str):
        self.model, self.pair, self.label = model, pair, label
        self.chat_prompts: Optional[str] = None  # "judge" (its own template) or "pair" (it has none)
        self._prompts: dict[str, str] = {}

    @classmethod
    def open(cls, pair: Pair, n_ctx: int, options: ModelOptions) -> Judge:
        """Load ``pair``'s target as the judge, labelled by the pair's name (else the file's)."""
        assert pair.target is not None
        model = load_backend(Path(pair.target), n_ctx, 1, replace(options, backend="llama.cpp"))
        return cls(model, pair, pair.manifest.name if pair.manifest else Path(pair.target).stem)

    def prompt_text(self, item: dict[str, Any], rendered: str) -> str:
        """What the judge reads before the answer: a chat rendered with its own template (else
        ``rendered``, the pair's text); a raw prompt as is."""
        if "messages" not in item:
            return str(item["prompt"])
        key = repr(item["messages"])
        if key not in self._prompts:
            try:
                self._prompts[key] = LoadedPair(self.model, None, self.pair).render_chat(item["messages"])
                self.chat_prompts = self.chat_prompts or "judge"
            except MtadEdgeError:  # no chat template: the pair's rendering
                self.chat_prompts = "pair"
                self._prompts[key] = rendered
        return self._prompts[key]

    def score(self, prompt: str, text: str) -> dict[str, Any]:
        """The run fields: ``judge_logprob_sum`` and ``judge_tokens`` of ``text`` after ``prompt``,
        ``judge_ppl`` and ``judge_truncated`` (the context could not hold all of it)."""
        logp, truncated = judge_logprobs(self.model, prompt, text)
        n = len(logp)
        total = float(logp.sum())
        return {
            "judge_logprob_sum": total,
            "judge_tokens": n,
            "judge_ppl": math.exp(-total / n) if n else None,
            "judge_truncated": truncated,
        }

    def close(self) -> None:
        self.model.close()

    def __enter__(self) -> Judge:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def continuation(model: Backend, prompt: str, text: str) -> tuple[list[int], list[int]]:
    """(context, answer) in ``model``'s tokens: the answer is ``tokenize(prompt + text)`` beyond its
    common prefix with ``tokenize(prompt)`` (at least one token of context is kept: the first
    token has nothing to be predicted from)."""
    full = model.tokenize(prompt + text)
    k = max(1, common_prefix(model.tokenize(prompt), full))
    return full[:k], full[k:]


def judge_logprobs(model: Backend, prompt: str, text: str) -> tuple[Any, bool]:
    """log p_judge of each answer token (``continuation``), and whether the context cut it short."""
    context, answer = continuation(model, prompt, text)
    room = max(0, model.n_ctx - len(context))
    return token_logprobs(model, context, answer[:room]), len(answer) > room


def describe(judge: Optional[Judge], ref: str, target: Optional[Path]) -> Optional[dict[str, Any]]:
    """results.json ``config.judge``: what judged and how it read the prompts."""
    if judge is None:
        return None
    path = Path(str(judge.pair.target))
    return {
        "ref": ref,
        "model": str(path),
        "name": judge.label,
        "parameters": getattr(judge.model, "n_params", None),
        "n_vocab": judge.model.n_vocab,
        "n_ctx": judge.model.n_ctx,
        "chat_prompts": judge.chat_prompts,  # rendered with the "judge"'s template or the "pair"'s; None: no chat
        "same_as_target": target is not None and same_file(path, target),
    }


def same_file(a: Path, b: Optional[Path]) -> bool:
    """Whether two paths name the same file (the judge would be the target itself)."""
    if b is None:
        return False
    try:
        return a.resolve() == Path(b).resolve() or a.samefile(b)
    except OSError:
        return False
