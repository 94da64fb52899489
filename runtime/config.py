"""The request config: which method, how long, how to draft and how to sample. Defaults, bounds
and messages come from options.OPTIONS; what a method needs comes from its registry entry."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from . import drafting, methods
from .drafting.base import acceptance_key
from .drafting.controller import Model
from .errors import OptionError
from .methods import auto
from .options import AUTO, AUTO_WIDTH_MAX, OPTIONS, check, default

SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
)
DECODE_FIELDS = (
    "method",
    "max_tokens",
    "gamma",
    "gamma_max",
    "gamma_min",
    "beam_width",
    "tree",
    "drafter",
    "verify",
    "no_repeat",
    "repeat_bar",
    "accept_threshold",
    "draft_ahead",
    "aux_shape",
    "seed",
)


@dataclass(frozen=True)
class SamplingConfig:
    """Temperature, top-k, top-p and min-p (rules/sampling.py's Filter), and the penalties on
    recent tokens (rules/shape.py), checked by the option table."""

    temperature: float = default("temperature")
    top_k: int = default("top_k")  # 0 disables
    top_p: float = default("top_p")  # 1.0 disables
    min_p: float = default("min_p")  # 0 disables
    repeat_penalty: float = default("repeat_penalty")  # llama.cpp's, over the last repeat_last_n tokens (1: off)
    repeat_last_n: int = default("repeat_last_n")
    presence_penalty: float = default("presence_penalty")  # OpenAI's, over the same tokens (0: off)
    frequency_penalty: float = default("frequency_penalty")

    def __post_init__(self) -> None:
        for name in SAMPLING_FIELDS:
            object.__setattr__(self, name, check(name, getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class DecodeConfig:
    method: str = default("method")
    max_tokens: int = default("max_tokens")
    gamma: Union[int, str] = default("gamma")  # a length, or "auto"
    gamma_max: int = default("gamma_max")
    gamma_min: Optional[int] = default("gamma_min")  # None: the method's floor (or a tuned one)
    beam_width: Union[int, str] = default("beam_width")  # a width, or "auto"
    tree: str = default("tree")  # MMTAD: "final" beams' prefixes or the "full" tree of every live beam
    drafter: str = default("drafter")  # auto | aux | ngram | ngram+aux
    verify: str = default("verify")  # sd: "block" or "token"
    no_repeat: int = default("no_repeat")  # beam drafts skip tokens that repeat an n-gram this long (0: off)
    repeat_bar: float = default("repeat_bar")  # MTAD's bar for blocks that repeat a 4-gram (1: off)
    accept_threshold: float = default("accept_threshold")
    draft_ahead: str = default("draft_ahead")  # "on": the next draft made while the target verifies
    aux_shape: str = default("aux_shape")  # "fixed": every aux call of one shape (CUDA graphs); auto | free
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: Optional[int] = default("seed")

    def __post_init__(self) -> None:
        for name in DECODE_FIELDS:
            object.__setattr__(self, name, check(name, getattr(self, name)))
        if self.gamma_min is not None and self.gamma_min > self.gamma_max:
            raise OptionError(f"gamma_min must be <= gamma_max ({self.gamma_max}), got {self.gamma_min}", "gamma_min")
        if self.beam_width == AUTO and not methods.get(self.method).uses_beams:
            raise OptionError(
                f"beam_width 'auto' applies to methods that draft with beams (mtad, mmtad); {self.method} does not",
                "beam_width",
            )
        if self.draft_ahead == "on" and (not self.drafts_with_aux or methods.get(self.method).tree):
            if self.drafts_with_aux:
                why = "verifies a tree of beams"
            elif methods.get(self.method).drafts:
                why = f"with drafter {self.drafter} does not draft with the aux"
            else:
                why = "does not draft"
            raise OptionError(
                f"draft_ahead 'on' applies to sd and mtad drafting with the aux; {self.method} {why}", "draft_ahead"
            )

    def resolved(self, model: Model, aux: bool) -> tuple[DecodeConfig, Optional[str]]:
        """This config with method 'auto' resolved for a pair whose costs and acceptance ``model``
        holds (``aux``: it has an aux model), and why it chose as it did (None: not 'auto')."""
        if self.method != AUTO:
            return self, None
        width = self.beam_width if isinstance(self.beam_width, int) else AUTO_WIDTH_MAX
        name, why = auto.choose(self.sampling, self.max_gamma, width, model, aux, lambda m: acceptance_key(m, self))
        keep_width = methods.get(name).uses_beams
        return dataclasses.replace(self, method=name, beam_width=self.beam_width if keep_width else 1), why

    @property
    def drafts_with_aux(self) -> bool:
        """Whether the request drafts with the aux model (a drafting method, a drafter that uses it)."""
        return methods.get(self.method).drafts and drafting.uses_aux_model(self.drafter)

    @property
    def max_gamma(self) -> int:
        """The longest draft this request may make (what the contexts must hold room for)."""
        return self.gamma if isinstance(self.gamma, int) else self.gamma_max

    @property
    def adaptive(self) -> bool:
        """Whether a controller chooses gamma or the width step by step."""
        return AUTO in (self.gamma, self.beam_width)

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
