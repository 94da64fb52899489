"""The decoding loop: prefill, then one method step at a time, clipped at EOS and max_tokens.

Invariant (gpt-fast style): ``tokens`` is the committed text; the target's sequence 0 holds all
of it but the last token, which is "pending" and fed at the next step together with any draft.
Each step returns the tokens it commits; rolling back is cutting the KV cache by position. The
backends record what each sequence holds, so reusing a cached prefix across runs (a chat's next
turn) needs no bookkeeping here.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from . import methods
from .backend import Backend, TokenIds, common_prefix, feed
from .config import DecodeConfig
from .drafter import BeamDrafter, Draft
from .errors import ContextOverflowError, OptionError
from .sampling import filtered_logprobs

TIMED_FIELDS = ("prefill_s", "draft_s", "verify_s")


@dataclass
class Stats:
    method: str = ""
    seed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens already in the target's cache (reused, not prefilled)
    generated: int = 0
    target_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    wall_s: float = 0.0
    ttft_s: Optional[float] = None  # start of the run to its first committed block
    finish_reason: str = ""

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def block_efficiency(self) -> Optional[float]:
        """Generated tokens per target call (1.0 for ar)."""
        return self.generated / self.target_calls if self.target_calls else None

    @property
    def decode_s(self) -> float:
        return self.wall_s - self.prefill_s

    @property
    def tokens_per_s(self) -> Optional[float]:
        """Generated tokens per second of decoding (prompt prefill excluded, as llama-bench tg)."""
        return self.generated / self.decode_s if self.decode_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("acceptance_rate", "block_efficiency", "tokens_per_s"):
            d[k] = getattr(self, k)
        return d

    def summary(self) -> str:
        def fmt(v: Optional[float], spec: str) -> str:
            return "n/a" if v is None else format(v, spec)

        return (
            f"{self.method}: {self.generated} tokens, {fmt(self.tokens_per_s, '.1f')} tok/s, "
            f"prompt {self.prompt_tokens} ({self.cached_tokens} cached), "
            f"{self.target_calls} target calls, block efficiency {fmt(self.block_efficiency, '.2f')}, "
            f"acceptance {fmt(self.acceptance_rate, '.1%')} ({self.accepted}/{self.drafted}), "
            f"draft {self.draft_s:.2f}s verify {self.verify_s:.2f}s other {self.other_s:.2f}s, "
            f"finish {self.finish_reason}"
        )


class Generation:
    """A lazy run: iterate for blocks of new token ids; ``stats`` is complete after the last one.
    ``reuse``: keep the longest prefix the caches already hold (else start from a cleared cache,
    laid out exactly as in a fresh context)."""

    def __init__(
        self, target: Backend, aux: Optional[Backend], prompt: Sequence[int], cfg: DecodeConfig, reuse: bool = True
    ):
        if not prompt:
            raise OptionError("the prompt must contain at least one token", "prompt")
        self.method = methods.get(cfg.method)
        if self.method.needs_aux and aux is None:
            raise OptionError(f"method {cfg.method} needs an auxiliary model (use --aux, or method ar)", "method")
        self.target, self.aux, self.cfg, self.reuse = target, aux, cfg, reuse
        self.gamma, self.width = cfg.gamma, (cfg.beam_width if self.method.uses_beams else 1)
        self.layout = self.method.layout(self.gamma, self.width)
        if self.layout.target_seqs > target.n_seq_max:
            raise OptionError(
                f"{cfg.method} with {self.width} beams needs a target context with {self.layout.target_seqs} sequences",
                "beam_width",
            )
        room = self._room()
        if len(prompt) > room:
            raise ContextOverflowError(
                f"prompt has {len(prompt)} tokens but the context holds {room} "
                f"(n_ctx minus {self._lookahead()} for decoding); shorten it or raise --ctx-size"
            )
        self.seed = cfg.seed if cfg.seed is not None else secrets.randbits(63)
        self.rng = np.random.default_rng(self.seed)
        self.tokens = list(prompt)
        self.stats = Stats(method=cfg.method, prompt_tokens=len(prompt), seed=self.seed)
        self.drafter: Optional[BeamDrafter] = None
        if self.method.needs_aux and aux is not None:
            self.drafter = BeamDrafter(aux, cfg.sampling, self.rng, self.width)

    # -- the loop ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        st = self.stats
        t0 = time.perf_counter()
        between_steps = False  # caches match the bookkeeping only between steps
        try:
            with self.timed("prefill_s"):
                self._prefill()
            while True:
                between_steps = True
                if len(self.tokens) > self._room():
                    st.finish_reason = "context"
                    return
                between_steps = False
                new = self.method.step(self, self.gamma, self.width)
                self.tokens.extend(new)
                between_steps = True
                out, stop = self._clip(new)
                st.generated += len(out)
                if out:
                    if st.ttft_s is None:
                        st.ttft_s = time.perf_counter() - t0
                    yield out
                if stop:
                    return
        finally:
            if not between_steps:  # stopped inside a step: drop what it left half done
                self._drop_caches()
            st.wall_s = time.perf_counter() - t0
            st.other_s = st.wall_s - sum(getattr(st, f) for f in TIMED_FIELDS)

    def _prefill(self) -> None:
        """Evaluate all prompt tokens but the last, reusing the cached prefix they share."""
        if not self.reuse:
            self._drop_caches()
        context = self.tokens[:-1]
        for model in (self.target, self.aux if self.drafter else None):
            if model is None:
                continue
            for s in range(1, model.n_seq_max):  # beams or tree branches a stopped run may have left
                model.rollback(s, 0)
            model.rollback(0, common_prefix(model.held(0), context))
        self.stats.cached_tokens = len(self.target.held(0))
        feed(self.target, context, logits="none")
        if self.drafter is not None:
            feed(self.drafter.model, context, logits="none")

    def _drop_caches(self) -> None:
        self.target.clear()
        if self.aux is not None:
            self.aux.clear()

    def _lookahead(self) -> int:
        return self.layout.target_cells

    def _room(self) -> int:
        """Committed tokens the contexts can hold with room for one more step."""
        room = self.target.n_ctx - self.layout.target_cells
        if self.method.needs_aux and self.aux is not None:
            room = min(room, self.aux.n_ctx - self.layout.aux_cells)
        return room

    def _clip(self, new: list[int]) -> tuple[list[int], bool]:
        """Cut a committed block at an end-of-generation token or the max_tokens budget."""
        for i, t in enumerate(new):
            if self.target.is_eog(t):
                self.stats.finish_reason = "stop"
                return new[:i][: self.cfg.max_tokens - self.stats.generated], True
        room = self.cfg.max_tokens - self.stats.generated
        if len(new) >= room:
            self.stats.finish_reason = "length"
            return new[:room], True
        return new, False

    # -- what a method's step calls ---------------------------------------------------------------
    @contextlib.contextmanager
    def timed(self, stat: str) -> Iterator[None]:
        """Add the wall time of the block to ``stats.<stat>`` (prefill_s, draft_s, verify_s)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self.stats, stat, getattr(self.stats, stat) + time.perf_counter() - t0)

    def target_logp(self, draft: TokenIds = ()) -> np.ndarray:
        """One target call on the pending token plus ``draft``: filtered log p for every draft
        position plus one (one row without a draft)."""
        with self.timed("verify_s"):
            logits = feed(self.target, self.tokens, draft, logits="all" if len(draft) else "last")
            self.stats.target_calls += 1
            return filtered_logprobs(logits, self.cfg.sampling)

    def propose(self, gamma: int, width: int, rows: bool = False) -> Draft:
        assert self.drafter is not None
        with self.timed("draft_s"):
            draft = self.drafter.propose(self.tokens, gamma, width, rows=rows)
        self.stats.drafted += len(draft.tokens)
        return draft

    def commit(self, beam_tokens: TokenIds, k: int, bonus: int, beam: Optional[int] = None) -> list[int]:
        """Keep x_1..x_k of the accepted beam and the bonus: the target keeps the pending token
        and the k accepted tokens in its cache, the aux cache follows."""
        self.target.rollback(0, len(self.tokens) + k)
        new = [int(t) for t in beam_tokens[:k]] + [int(bonus)]
        assert self.drafter is not None
        self.drafter.commit(self.tokens + new, k, beam)
        self.stats.accepted += k
        self.stats.accept_lengths.append(k)
        return new


def generate_tokens(
    target: Backend, aux: Optional[Backend], prompt: Sequence[int], cfg: DecodeConfig
) -> tuple[list[int], Stats]:
    """Run to the end; return (generated token ids, stats)."""
    gen = Generation(target, aux, prompt, cfg)
    out = [t for block in gen for t in block]
    return out, gen.stats
