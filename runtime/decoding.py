"""The decoding loop: ``ar``, lossless ``sd`` and ``mtad`` as small step functions.

Invariant (gpt-fast style): ``tokens`` is the committed text; the target's sequence 0 holds all
of it but the last token, which is "pending" and fed at the next step together with any draft.
Each step returns the tokens it commits; rolling back is cutting the KV cache by position.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

import numpy as np

from .backend import Backend, Batch
from .drafter import BeamDrafter, Cursor
from .errors import ContextOverflowError
from .sampling import SamplingConfig, filtered_logprobs, sample
from .tree import TokenTree, greedy_tree_accept, mmtad_accept
from .verify import greedy_accept_length, mtad_accept_length, speculative_verify

METHODS = ("ar", "sd", "mtad", "mmtad")


@dataclass(frozen=True)
class DecodeConfig:
    method: str = "mtad"
    max_tokens: int = 128
    gamma: int = 4
    beam_width: int = 4
    accept_threshold: float = 0.5
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: Optional[int] = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {self.gamma}")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if not 0 < self.accept_threshold <= 1:
            raise ValueError(f"accept_threshold must be in (0, 1], got {self.accept_threshold}")

    @property
    def width(self) -> int:
        """Beams the drafter keeps: w for mtad and mmtad, 1 for sd."""
        return self.beam_width if self.method in ("mtad", "mmtad") else 1

    @property
    def lookahead(self) -> int:
        """KV cells of the target one step may fill past the committed text."""
        if self.method == "mmtad":
            return self.beam_width * self.gamma + 1  # the pending token and up to w x gamma tree nodes
        return 1 if self.method == "ar" else self.gamma + 1


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

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("acceptance_rate", "block_efficiency", "tokens_per_s"):
            d[k] = getattr(self, k)
        return d

    def summary(self) -> str:
        def fmt(v, spec):
            return "n/a" if v is None else format(v, spec)

        return (
            f"{self.method}: {self.generated} tokens, {fmt(self.tokens_per_s, '.1f')} tok/s, "
            f"prompt {self.prompt_tokens} ({self.cached_tokens} cached), "
            f"{self.target_calls} target calls, block efficiency {fmt(self.block_efficiency, '.2f')}, "
            f"acceptance {fmt(self.acceptance_rate, '.1%')} ({self.accepted}/{self.drafted}), "
            f"draft {self.draft_s:.2f}s verify {self.verify_s:.2f}s other {self.other_s:.2f}s, "
            f"finish {self.finish_reason}"
        )


@dataclass
class KVState:
    """What sequence 0 of each model holds after a run, so the next run on the same backends
    (a chat's next turn) only prefills what differs. Emptied when a run stops mid-step."""

    target: list[int] = field(default_factory=list)
    aux: list[int] = field(default_factory=list)

    def clear(self) -> None:
        self.target, self.aux = [], []


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Generation:
    """A lazy run: iterate for blocks of new token ids; ``stats`` is complete after the last one.
    With ``kv`` the caches keep the longest prefix shared with the previous run."""

    def __init__(
        self,
        target: Backend,
        aux: Optional[Backend],
        prompt: list[int],
        cfg: DecodeConfig,
        kv: Optional[KVState] = None,
    ):
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        self.n_ctx = min(m.n_ctx for m in (target, aux) if m is not None)
        room = self.n_ctx - cfg.lookahead
        if len(prompt) > room:
            raise ContextOverflowError(
                f"prompt has {len(prompt)} tokens but the context holds {room} "
                f"(n_ctx minus {cfg.lookahead} for decoding); shorten it or raise --ctx-size"
            )
        if cfg.method != "ar" and aux is None:
            raise ValueError(f"method {cfg.method} needs an auxiliary model")
        if cfg.method == "mmtad" and target.n_seq_max < cfg.width + 1:
            raise ValueError(f"mmtad with {cfg.width} beams needs a target context with {cfg.width + 1} sequences")
        self.target, self.cfg = target, cfg
        self.seed = cfg.seed if cfg.seed is not None else secrets.randbits(32)
        self.rng = np.random.default_rng(self.seed)
        self.tokens = list(prompt)
        self.stats = Stats(method=cfg.method, prompt_tokens=len(prompt), seed=self.seed)
        self.kv = kv
        self.tgt = Cursor(target)
        self.drafter = None
        if cfg.method != "ar":
            self.drafter = BeamDrafter(aux, cfg.sampling, cfg.width, self.rng, keep_rows=cfg.method == "sd")

    def __iter__(self) -> Iterator[list[int]]:
        st, cfg = self.stats, self.cfg
        t0 = time.perf_counter()
        step = {"ar": self._ar_step, "sd": self._sd_step, "mtad": self._mtad_step, "mmtad": self._mmtad_step}[
            cfg.method
        ]
        consistent = False  # the caches match the bookkeeping only between steps
        try:
            self._prefill(self.kv or KVState())
            consistent = True
            st.prefill_s = time.perf_counter() - t0
            while True:
                if len(self.tokens) + cfg.lookahead > self.n_ctx:
                    st.finish_reason = "context"
                    return
                consistent = False
                new = step()
                self.tokens.extend(new)
                consistent = True
                out, stop = self._clip(new)
                st.generated += len(out)
                if out:
                    yield out
                if stop:
                    return
        finally:
            st.wall_s = time.perf_counter() - t0
            st.other_s = st.wall_s - st.prefill_s - st.draft_s - st.verify_s
            if self.kv is not None:
                if consistent:
                    self.kv.target = self.tokens[: self.tgt.n_kv]
                    self.kv.aux = self.tokens[: self.drafter.cursor.n_kv] if self.drafter else []
                else:
                    self.kv.clear()

    def _prefill(self, kv: KVState) -> None:
        """Evaluate all prompt tokens but the last, reusing the cached prefix shared with ``kv``."""
        for s in range(1, self.target.n_seq_max):  # tree branches a stopped run may have left
            self.target.rollback(s, 0)
        self.tgt.n_kv = self.stats.cached_tokens = _common_prefix(kv.target, self.tokens[:-1])
        self.target.rollback(0, self.tgt.n_kv)
        self.tgt.feed(self.tokens[:-1], logits="none")
        if self.drafter is not None:
            self.drafter.reset(keep=_common_prefix(kv.aux, self.tokens[:-1]))
            self.drafter.cursor.feed(self.tokens[:-1], logits="none")

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

    # -- steps ----------------------------------------------------------------------------------
    def _target_rows(self, draft=()) -> np.ndarray:
        """One target call on pending + draft; filtered log p for every draft position plus one."""
        t0 = time.perf_counter()
        logits = self.tgt.feed(self.tokens, draft, logits="all" if len(draft) else "last")
        p = filtered_logprobs(logits, self.cfg.sampling)
        self.stats.target_calls += 1
        self.stats.verify_s += time.perf_counter() - t0
        return p

    def _propose(self):
        t0 = time.perf_counter()
        draft = self.drafter.propose(self.tokens, self.cfg.gamma)
        self.stats.draft_s += time.perf_counter() - t0
        self.stats.drafted += len(draft.tokens)
        return draft

    def _commit(self, beam_tokens, k: int, bonus: int, beam: Optional[int] = None) -> list[int]:
        """Keep x_1..x_k of the accepted beam and the bonus; the aux cache follows."""
        new = [int(t) for t in beam_tokens[:k]] + [int(bonus)]
        self.drafter.commit(self.tokens + new, k, beam)
        self.stats.accepted += k
        self.stats.accept_lengths.append(k)
        return new

    def _ar_step(self) -> list[int]:
        p = self._target_rows()
        return [sample(p[-1], self.rng)]

    def _sd_step(self) -> list[int]:
        draft = self._propose()
        p = self._target_rows(draft.tokens)
        t0 = time.perf_counter()
        k, nxt = speculative_verify(p, draft.q_rows, draft.tokens, self.rng)
        self.stats.verify_s += time.perf_counter() - t0
        self.tgt.truncate(len(self.tokens) + k)  # pending token + k accepted draft tokens
        return self._commit(draft.tokens, k, nxt)

    def _mtad_step(self) -> list[int]:
        draft = self._propose()
        p = self._target_rows(draft.tokens)
        t0 = time.perf_counter()
        gamma = len(draft.tokens)
        if self.cfg.sampling.greedy:
            k = greedy_accept_length(draft.tokens, np.argmax(p[:gamma], axis=-1))
        else:
            logp_x = p[np.arange(gamma), draft.tokens]
            k = mtad_accept_length(logp_x, draft.logq_x, self.cfg.accept_threshold)
        nxt = sample(p[k], self.rng)
        self.stats.verify_s += time.perf_counter() - t0
        self.tgt.truncate(len(self.tokens) + k)
        return self._commit(draft.tokens, k, nxt)

    def _mmtad_step(self) -> list[int]:
        draft = self._propose()
        tree = TokenTree.from_beams(draft.beams)
        p = self._target_tree_rows(tree)  # row 0: the root; row 1 + i: node i
        t0 = time.perf_counter()
        rows = tree.parent_rows()  # (n, gamma): the row predicting each beam token
        if self.cfg.sampling.greedy:
            k, b = greedy_tree_accept(draft.beams, np.argmax(p, axis=-1)[rows])
        else:
            logp_x = p[rows, draft.beams]
            k, b = mmtad_accept(np.cumsum(logp_x, axis=1), np.cumsum(draft.logq_x), self.cfg.accept_threshold)
        nxt = sample(p[1 + tree.node_of[b, k - 1] if k else 0], self.rng)
        # Sequence 0 adopts beam b's first k tokens; the other branches are dropped.
        base = len(self.tokens)
        if k:
            self.target.copy_seq(1 + b, 0, base, base + k)
        for s in range(1, len(draft.beams) + 1):
            self.target.rollback(s, 0)
        self.tgt.n_kv = base + k
        self.stats.verify_s += time.perf_counter() - t0
        return self._commit(draft.beams[b], k, nxt, beam=b)

    def _target_tree_rows(self, tree: TokenTree) -> np.ndarray:
        """One target pass over the pending token (in every beam's sequence) and every tree node
        (in the sequences of the beams through it, at position = depth). Beam b is sequence 1 + b."""
        t0 = time.perf_counter()
        n = len(tree.node_of)
        for s in range(1, n + 1):
            self.target.rollback(s, 0)
            self.target.copy_seq(0, s)
        pending = self.tokens[self.tgt.n_kv :]
        batch = Batch()
        for i, tok in enumerate(pending):
            batch.add(tok, self.tgt.n_kv + i, range(n + 1), i == len(pending) - 1)
        base = len(self.tokens)
        for tok, depth, beams in zip(tree.token, tree.depth, tree.beams):
            batch.add(tok, base - 1 + depth, [1 + b for b in beams], True)
        p = filtered_logprobs(self.target.decode(batch), self.cfg.sampling)
        self.tgt.n_kv = base
        self.stats.target_calls += 1
        self.stats.verify_s += time.perf_counter() - t0
        return p


def generate_tokens(
    target: Backend, aux: Optional[Backend], prompt: list[int], cfg: DecodeConfig
) -> tuple[list[int], Stats]:
    """Run to the end; return (generated token ids, stats)."""
    gen = Generation(target, aux, prompt, cfg)
    out = [t for block in gen for t in block]
    return out, gen.stats
