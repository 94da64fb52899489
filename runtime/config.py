"""The request config: which method, how long, how to draft and how to sample. Defaults, bounds
and messages come from options.OPTIONS; what a method needs comes from its registry entry."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import OptionError
from .options import OPTIONS, check, default
from .sampling import SamplingConfig

SAMPLING_FIELDS = ("temperature", "top_k", "top_p")
DECODE_FIELDS = ("method", "max_tokens", "gamma", "beam_width", "accept_threshold", "seed")


@dataclass(frozen=True)
class DecodeConfig:
    method: str = default("method")
    max_tokens: int = default("max_tokens")
    gamma: int = default("gamma")
    beam_width: int = default("beam_width")
    accept_threshold: float = default("accept_threshold")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: Optional[int] = default("seed")

    def __post_init__(self) -> None:
        for name in DECODE_FIELDS:
            object.__setattr__(self, name, check(name, getattr(self, name)))

    def as_options(self) -> dict[str, Any]:
        """The flat options this config was made of (the inverse of ``with_options``)."""
        flat = {k: getattr(self, k) for k in DECODE_FIELDS}
        return {**flat, **{k: getattr(self.sampling, k) for k in SAMPLING_FIELDS}}

    def with_options(self, options: dict[str, Any]) -> DecodeConfig:
        """This config with flat per-request options (``temperature=0.7, gamma=2, ...``);
        an unknown name or a bad value raises OptionError naming it."""
        unknown = sorted(set(options) - set(SAMPLING_FIELDS) - set(DECODE_FIELDS))
        if unknown:
            known = ", ".join(n for n in OPTIONS if n in SAMPLING_FIELDS + DECODE_FIELDS)
            raise OptionError(f"unknown option(s): {', '.join(unknown)} (known: {known})", unknown[0])
        s = self.sampling
        sampling = SamplingConfig(**{k: options.get(k, getattr(s, k)) for k in SAMPLING_FIELDS})
        return dataclasses.replace(self, sampling=sampling, **{k: options[k] for k in DECODE_FIELDS if k in options})
