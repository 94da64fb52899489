"""Bench variants: a method with request-option overrides and a label, e.g. ``sd g=2``,
``ar T=0.6`` or ``mtad g=6 w=2 thr=0.3``.

Why one notion: comparing methods, gamma settings (``--gammas``), plain decoding's temperature
curve (``--ar-temperatures``) and free settings (``--variant``) are all the same experiment,
several request configurations on the same prompts and seeds, aggregated per label. Options are
checked by the runtime's option table, so a bad value reads as it does everywhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mtad_edge.runtime import methods as registry
from mtad_edge.runtime.config import DecodeConfig
from mtad_edge.runtime.errors import OptionError
from mtad_edge.runtime.options import AUTO_WIDTH_MAX, OPTIONS

# Short names for labels and --variant specs; the option table's full names work too.
SHORT = {
    "gamma": "g",
    "gamma_min": "gmin",
    "beam_width": "w",
    "accept_threshold": "thr",
    "temperature": "T",
    "top_k": "k",
    "top_p": "p",
    "max_tokens": "n",
    "tree": "tree",
    "drafter": "d",
    "verify": "v",
    "no_repeat": "nr",
    "repeat_bar": "rb",
    "draft_ahead": "ahead",
    "aux_shape": "shape",
}
LONG = {v: k for k, v in SHORT.items()}


@dataclass(frozen=True)
class Variant:
    label: str
    method: str
    options: dict[str, Any] = field(default_factory=dict)  # request options over the bench's own

    def config(self, base: DecodeConfig, seed: int) -> DecodeConfig:
        return base.with_options({"method": self.method, **self.options, "seed": seed})


def _value(v: Any) -> str:
    return format(v, "g") if isinstance(v, float) else str(v)


def label_for(method: str, options: dict[str, Any]) -> str:
    order = [k for k in SHORT if k in options]
    return " ".join([method] + [f"{SHORT[k]}={_value(options[k])}" for k in order])


def make(method: str, options: dict[str, Any]) -> Variant:
    return Variant(label_for(method, options), method, dict(options))


def parse_spec(spec: str) -> Variant:
    """``"mtad g=6 w=2 thr=0.3 T=0.8"`` (or full option names) -> a Variant; OptionError names
    what is wrong."""
    words = spec.split()
    if not words:
        raise OptionError("empty variant (want e.g. 'mtad g=6 thr=0.3')", "variant")
    method = OPTIONS["method"].check(words[0])
    options: dict[str, Any] = {}
    for w in words[1:]:
        key, eq, text = w.partition("=")
        name = LONG.get(key, key)
        if not eq or name not in SHORT or name == "method":
            known = ", ".join(f"{s} ({n})" for n, s in SHORT.items())
            raise OptionError(f"variant {spec!r}: {w!r} is not OPTION=VALUE with an option of {known}", "variant")
        options[name] = OPTIONS[name].parse(text)
    return make(method, options)


def _draws(method: str) -> bool:
    """Whether gamma changes what the method does (everything but plain decoding)."""
    m = registry.get(method)
    return m.drafts or m.uses_beams


def _identity(v: Variant, base: DecodeConfig) -> DecodeConfig:
    """The effective request, with the options the method ignores set to the base's, so that
    ``ar`` and ``ar T=1`` (at a base temperature of 1) are recognised as one run."""
    cfg = v.config(base, 0)
    m = registry.get(v.method)
    if not _draws(v.method):
        cfg = dataclasses.replace(cfg, gamma=base.gamma, accept_threshold=base.accept_threshold)
    if not m.uses_beams:
        cfg = dataclasses.replace(cfg, beam_width=base.beam_width)
    return cfg


def expand(
    base: DecodeConfig,
    methods: Sequence[str],
    gammas: Sequence[Any] = (),
    ar_temperatures: Sequence[float] = (),
    specs: Iterable[str] = (),
) -> tuple[list[Variant], list[tuple[str, str]]]:
    """The variants of a bench run, in order: each method (one per gamma of ``gammas`` for the
    methods that draft), plain decoding at each of ``ar_temperatures``, then ``specs``. A
    variant equal in effect to an earlier one is measured once; returns (variants, [(dropped
    label, kept label)])."""
    wanted: list[Variant] = []
    for m in methods:
        if gammas and _draws(m):
            wanted += [make(m, {"gamma": g}) for g in gammas]
        else:
            wanted.append(Variant(m, m))
    wanted += [make("ar", {"temperature": float(t)}) for t in ar_temperatures]
    wanted += [parse_spec(s) for s in specs]
    kept: dict[DecodeConfig, Variant] = {}
    dropped = []
    for v in wanted:
        key = _identity(v, base)
        if key in kept:
            if kept[key].label != v.label:
                dropped.append((v.label, kept[key].label))
            continue
        kept[key] = v
    return list(kept.values()), dropped


def capacity(base: DecodeConfig, variants: Sequence[Variant]) -> tuple[int, int]:
    """The largest (gamma, beam width) any variant asks for (gamma 'auto': its gamma_max; width
    'auto': up to AUTO_WIDTH_MAX): the engine's contexts fit them all."""
    cfgs = [base] + [v.config(base, 0) for v in variants]
    width = max(c.beam_width if isinstance(c.beam_width, int) else AUTO_WIDTH_MAX for c in cfgs)
    return max(c.max_gamma for c in cfgs), width
