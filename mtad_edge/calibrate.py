"""Seed the adaptive controller's cost tables with a short calibration at load time.

A few timed calls on throwaway positions: the target on 1, 2, 3, a middle and gamma_max+1 rows
(and a tree's size when MMTAD may run), the aux on 1..w rows as beams, once each after a warm-up
(under 0.5 s on the default pair). The result is cached per (model files, backend, threads, GPU
layers of each model, flash attention, library version) under the cache dir, so it runs once per machine and
setup. Decoding keeps refining the tables from the calls it makes anyway.
"""

from __future__ import annotations

import math
import os
import time
from importlib import metadata
from typing import Any, Optional

import numpy as np

import mtad_edge.store as store
from mtad_edge.loader import LoadedPair, ModelOptions
from mtad_edge.runtime.backend import Backend, Batch
from mtad_edge.runtime.config import SamplingConfig
from mtad_edge.runtime.drafting.controller import Costs, Model
from mtad_edge.runtime.rules.sampling import Columns, KeptRows

_TEXT = "The quick brown fox jumps over the lazy dog while the river runs quietly past the old mill."
PREFIX_TOKENS = 24  # the context the calls are timed on: short, so a calibration stays well under a second


def _version() -> str:
    for dist in ("llama-cpp-python", "onnxruntime"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def cache_key(models: LoadedPair, options: ModelOptions, target_rows: list[int], aux_rows: list[int]) -> str:
    parts: list[Any] = [options.backend, options.provider, options.threads or os.cpu_count(), options.n_gpu_layers]
    # the flash attention each context runs with (llama.cpp's): it moves what a call costs
    parts += [getattr(m, "flash_attn", None) for m in (models.target, models.aux)]
    parts += [getattr(m, "amx", 0) for m in (models.target, models.aux)]  # AMX's kernels, where they run
    # the aux's own placement (aux_gpu_layers, resolved): its calls cost otherwise on the CPU than on a GPU
    parts.append(getattr(getattr(models.aux, "config", None), "n_gpu_layers", None))
    if options.aux_threads is not None:  # the aux's own threads: its calls cost otherwise
        parts.append(["aux_threads", options.aux_threads])
    if models.rpc is not None:  # the target's calls go over the network to these servers
        parts.append(list(models.rpc.servers))
    parts += [*store.file_identity(models.pair.target, models.pair.aux), target_rows, aux_rows, _version()]
    return store.key(parts)


def timed_rows(model: Backend, prefix: list[int], rows: int, as_beams: bool, filtered: bool = True) -> float:
    """Seconds of one call adding ``rows`` rows after ``prefix`` (one sequence, or ``rows``
    beams of one token each), logits filtered as decoding does unless ``filtered`` is false (a
    verify's rows on their shared columns, beams' rows to their kept tokens); the cells are
    dropped after."""
    sampling = SamplingConfig()
    batch = Batch()
    for i in range(rows):
        seq = 1 + i if as_beams else 0
        if as_beams:
            model.copy_seq(0, seq)
        batch.add(prefix[i % len(prefix)], len(prefix) + (0 if as_beams else i), (seq,), True)
    t0 = time.perf_counter()
    logits = model.decode(batch)
    if filtered:
        kept = KeptRows.of(logits, sampling)
        if not as_beams:
            Columns.shared(np.zeros(0, dtype=np.int64), kept)
    seconds = time.perf_counter() - t0
    for s in range(1, rows + 1 if as_beams else 1):
        model.rollback(s, 0)
    model.rollback(0, len(prefix))
    return seconds


def measure(models: LoadedPair, target_rows: list[int], aux_rows: list[int]) -> dict[str, dict[int, float]]:
    """Time the calls (a warm-up first); both caches are cleared before and after."""
    out: dict[str, dict[int, float]] = {"target": {}, "aux": {}}
    for role, model, rows, as_beams in (
        ("target", models.target, target_rows, False),
        ("aux", models.aux, aux_rows, True),
    ):
        if model is None or not rows:
            continue
        model.clear()
        prefix = model.tokenize(_TEXT)[:PREFIX_TOKENS]
        model.decode(Batch.run(prefix, 0, logits="none"))
        timed_rows(model, prefix, 1, False)  # warm-up
        for r in rows:  # one timing each: the robust line through them shrugs off a disturbed one
            out[role][r] = timed_rows(model, prefix, r, as_beams)
        model.clear()
    return out


def stored_tables(raw: Any, rows: dict[str, list[int]]) -> Optional[dict[str, dict[int, float]]]:
    """A calibration record's tables, or None when it is not one: each role's timings of the rows
    asked for, in seconds that are finite floats over 0. A damaged record is timed again (a number
    past a float's range was an OverflowError traceback; NaN, 0 or negative seconds seeded plans)."""
    if not isinstance(raw, dict) or not set(raw) <= set(rows):
        return None
    tables: dict[str, dict[int, float]] = {}
    for role, table in raw.items():
        if not isinstance(table, dict):
            return None
        asked = {str(r): r for r in rows[role]}
        if not all(r in asked and type(s) is float and 0 < s < math.inf for r, s in table.items()):
            return None  # what measure writes: the rows asked, seconds as floats
        tables[role] = {asked[r]: s for r, s in table.items()}
    return tables


def calibrated_model(models: LoadedPair, options: ModelOptions, gamma_max: int, width: int, tree: bool) -> Model:
    """A controller Model seeded from the cache, or from a fresh calibration written to it."""
    # A few row counts: the controller's cost line (Theil-Sen) needs points, not every row; the
    # cheap end is sampled densely, where a verify's cost rises fastest.
    target_rows = sorted({1, 2, 3, (gamma_max + 3) // 2, gamma_max + 1})
    if tree:
        target_rows += sorted({width * gamma_max // 2 + 1} - set(target_rows))
    aux_rows = list(range(1, min(width, (models.aux.n_seq_max - 1) // 2) + 1)) if models.aux is not None else []
    record = store.path("calibration", cache_key(models, options, target_rows, aux_rows))
    tables = stored_tables(store.read_json(record), {"target": target_rows, "aux": aux_rows})
    if tables is None:
        measured = tables = measure(models, target_rows, aux_rows)
        store.remember(lambda: store.write_json(record, measured))
    target = tables.get("target")  # a tree verify starts from the same shape, scaled to its own calls
    return Model(target=Costs(seed=target), aux=Costs(seed=tables.get("aux")), tree=Costs(seed=target))
