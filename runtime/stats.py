"""What a run did: tokens, target calls, drafted and accepted tokens (in all and per drafter),
where its time went, and what the controller expected. ``to_dict`` is the JSON the CLI, the server
(``mtad_stats``) and bench report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass
class Stats:
    method: str = ""
    auto: Optional[str] = None  # method 'auto': which method it chose for this request, and why
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
    target_s: float = 0.0  # of draft_s + verify_s: the target's calls (a beam window's on the target too)
    other_s: float = 0.0
    wall_s: float = 0.0
    ttft_s: Optional[float] = None  # start of the run to its first committed block
    finish_reason: str = ""
    gamma_hist: dict[int, int] = field(default_factory=dict)  # drafted length -> steps (0: plain target steps)
    width_hist: dict[int, int] = field(default_factory=dict)  # beam width -> drafting steps
    alone_steps: int = 0  # MMTAD: drafting steps that verified the best beam alone, not the tree
    predicted_tokens: float = 0.0  # the controller's expected committed tokens, summed over steps
    predicted_s: float = 0.0  # and its expected seconds
    controller_s: float = 0.0  # time spent choosing (gamma, width) and learning
    gamma_min: Optional[int] = None  # gamma 'auto': the shortest draft it could choose
    # Per drafter (drafting/): steps it drafted, tokens drafted and accepted, and its own counters
    # (the aux: ahead_drafts, ahead_hits with --draft-ahead on; vocab_resyncs, vocab_mapped_share
    # with an aux of another vocabulary).
    drafters: dict[str, dict[str, Any]] = field(default_factory=dict)
    mask_s: float = 0.0  # a constraint's masks (inside draft_s and verify_s: computed where they are used)

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def block_efficiency(self) -> Optional[float]:
        """Generated tokens per target call (1.0 for ar)."""
        return self.generated / self.target_calls if self.target_calls else None

    @property
    def predicted_tokens_per_s(self) -> Optional[float]:
        """What the adaptive controller expected (None with a fixed gamma and width)."""
        return self.predicted_tokens / self.predicted_s if self.predicted_s > 0 else None

    @property
    def decode_s(self) -> float:
        return self.wall_s - self.prefill_s

    @property
    def tokens_per_s(self) -> Optional[float]:
        """Generated tokens per second of decoding (prompt prefill excluded, as llama-bench tg)."""
        return self.generated / self.decode_s if self.decode_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("acceptance_rate", "block_efficiency", "tokens_per_s", "predicted_tokens_per_s"):
            d[k] = getattr(self, k)
        d.update(self._old_names())
        return d

    def _old_names(self) -> dict[str, Any]:
        """The per-drafter fields as 0.1.0 named them, kept for one release (CHANGELOG)."""
        lookup, aux = self.drafters.get("ngram", {}), self.drafters.get("aux", {})
        return {
            "lookup_drafted": lookup.get("drafted", 0),
            "lookup_accepted": lookup.get("accepted", 0),
            "vocab_resyncs": aux.get("vocab_resyncs", 0),
            "vocab_mapped_share": aux.get("vocab_mapped_share"),
            "ahead_drafts": aux.get("ahead_drafts", 0),
            "ahead_hits": aux.get("ahead_hits", 0),
        }

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
