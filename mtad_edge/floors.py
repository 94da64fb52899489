"""Tuned floors of gamma 'auto': the shortest draft that keeps MTAD's quality for one pair and one
set of options, written by `mtad-edge tune` (mtad_edge/tune.py) and read by the engine for every
request that would otherwise use the method's constant floor.

A record is cached per (model files, method, beam width, tree, temperature, top-k, top-p, accept
threshold): what changes the text, not the speed. A request with gamma 'auto', sampling, a fixed
width and no gamma_min of its own then starts from it (Stats.gamma_min shows it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import mtad_edge.store as store
from mtad_edge.pairs import Pair
from mtad_edge.runtime import methods
from mtad_edge.runtime.config import DecodeConfig
from mtad_edge.runtime.options import AUTO


def reference(cfg: DecodeConfig) -> int:
    """The gamma quality is measured against: the method's own 'auto' floor."""
    return methods.get(cfg.method).min_auto_gamma


def has_floor(method: str) -> bool:
    """Whether a method's 'auto' floor is a quality floor (a joint draft: mtad, mmtad)."""
    m = methods.get(method)
    return m.drafts and m.min_auto_gamma > 1


def key(pair: Pair, cfg: DecodeConfig) -> str:
    """The cache key of a floor: the model files and every option that changes the text."""
    s = cfg.sampling
    parts: list[Any] = [*store.file_identity(pair.target, pair.aux), cfg.method, cfg.beam_width, cfg.tree]
    parts += [s.temperature, s.top_k, s.top_p, cfg.accept_threshold]
    return store.key(parts)


def folder() -> Path:
    return store.home() / "floors"


def path_for(pair: Pair, cfg: DecodeConfig) -> Path:
    return folder() / f"{key(pair, cfg)}.json"


def floor_for(pair: Pair, cfg: DecodeConfig) -> DecodeConfig:
    """``cfg`` with gamma_min set from a tuned floor, when it is a request that would use the
    method's constant one (gamma 'auto', sampling, a fixed width, no gamma_min given) and a
    floor was measured for exactly these files and options; else ``cfg`` itself."""
    if cfg.gamma != AUTO or cfg.gamma_min is not None or cfg.sampling.greedy or not isinstance(cfg.beam_width, int):
        return cfg
    if not has_floor(cfg.method):
        return cfg
    try:
        floor = store.read_json(path_for(pair, cfg))["floor"]  # type: ignore[index]
    except (KeyError, TypeError):
        return cfg
    if not isinstance(floor, int) or isinstance(floor, bool) or not 1 <= floor <= reference(cfg):
        return cfg  # a damaged record: the constant floor is the safe one
    return dataclasses.replace(cfg, gamma_min=min(floor, cfg.gamma_max))


def save(pair: Pair, cfg: DecodeConfig, record: dict[str, Any]) -> Path:
    """Write the record where ``floor_for`` finds it (atomically); returns the path."""
    return store.write_json(path_for(pair, cfg), {**record, "target": str(pair.target), "aux": str(pair.aux)})
