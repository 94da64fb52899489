"""Seed the adaptive controller's cost tables with a short calibration at load time.

A few timed calls on throwaway positions: the target on 1, 2, 3, a middle and gamma_max+1 rows
(and a tree's size when MMTAD may run), the aux on 1..w rows as beams, after a warm-up, in
``ROUNDS`` rounds (about a second on the default pair). Each call is read against the target's
one-row call of its own round, so a machine that speeds up or slows down between rounds (another
process, the OS) changes no ratio, and each ratio is the median of its rounds (one disturbed round
is dropped). A calibration whose rounds disagree by more than ``BUSY`` was taken on a busy machine:
the engine uses it, but it is not cached, so it does not outlive the moment it was taken in. The
result is cached per (model files, backend, threads, GPU layers of each model, flash attention,
library version) under the cache dir, so it runs once per machine and setup. Decoding keeps
refining the tables from the calls it makes anyway.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Optional

import numpy as np

import mtad_edge.store as store
from mtad_edge.loader import LoadedPair, ModelOptions
from mtad_edge.runtime.backend import Backend, Batch
from mtad_edge.runtime.config import SamplingConfig
from mtad_edge.runtime.drafting.controller import Costs, Model
from mtad_edge.runtime.drafting.costs import median
from mtad_edge.runtime.rules.sampling import Columns, KeptRows

_TEXT = "The quick brown fox jumps over the lazy dog while the river runs quietly past the old mill."
PREFIX_TOKENS = 24  # the context the calls are timed on: short, so a calibration stays about a second
ROUNDS = 3  # each row timed once a round, against the target's one-row call of that round; the median
BUSY = 0.2  # log distance between a row's median round and its nearest other beyond which the machine was busy
VERSION = "rounds 3"  # how the cached tables were measured: records measured otherwise are timed again


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
    parts += [*store.file_identity(models.pair.target, models.pair.aux), target_rows, aux_rows, _version(), VERSION]
    return store.key(parts)


def timed_rows(
    model: Backend,
    prefix: list[int],
    rows: int,
    as_beams: bool,
    filtered: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
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
    t0 = clock()
    logits = model.decode(batch)
    if filtered:
        kept = KeptRows.of(logits, sampling)
        if not as_beams:
            Columns.shared(np.zeros(0, dtype=np.int64), kept)
    seconds = clock() - t0
    for s in range(1, rows + 1 if as_beams else 1):
        model.rollback(s, 0)
    model.rollback(0, len(prefix))
    return seconds


@dataclass
class Timings:
    """A calibration: seconds by rows for "target" and "aux", and how far its rounds disagreed
    (for the row whose rounds agree least: the log distance from the median of its ratios to its
    round's one-row call to the nearest other round's)."""

    tables: dict[str, dict[int, float]]
    spread: float = 0.0

    @property
    def busy(self) -> bool:
        return self.spread > BUSY


def measure(
    models: LoadedPair,
    target_rows: list[int],
    aux_rows: list[int],
    rounds: int = ROUNDS,
    clock: Callable[[], float] = time.perf_counter,
) -> Timings:
    """Time the calls (a warm-up first) in ``rounds`` rounds, each row against the target's one-row
    call of its round; both caches are cleared before and after."""
    roles = [
        (role, model, rows, as_beams)
        for role, model, rows, as_beams in (
            ("target", models.target, target_rows, False),
            ("aux", models.aux, aux_rows, True),
        )
        if model is not None and rows
    ]
    prefixes = {}
    for role, model, _, _ in roles:
        model.clear()
        prefixes[role] = prefix = model.tokenize(_TEXT)[:PREFIX_TOKENS]
        model.decode(Batch.run(prefix, 0, logits="none"))
        timed_rows(model, prefix, 1, False, clock=clock)  # warm-up
    # The target's one-row call before the first round and after each: every other call is read
    # against them, interpolated at its time, so a drift of the machine's speed within a round
    # cancels too (the rows' call of a round take from a tenth of a second to a few).
    refs: list[tuple[float, float]] = []  # (midpoint, seconds) of each one-row target call
    timed: list[tuple[str, int, float, float]] = []  # (role, rows, midpoint, seconds) of the others

    def call(role: str, model: Backend, rows: int, as_beams: bool) -> tuple[float, float]:
        t0 = clock()
        seconds = max(timed_rows(model, prefixes[role], rows, as_beams, clock=clock), 1e-9)
        return t0 + seconds / 2, seconds

    if models.target is not None and target_rows:
        refs.append(call("target", models.target, 1, False))
    for _ in range(rounds):
        for role, model, rows, as_beams in roles:
            for r in rows:  # one timing a round: the median over rounds shrugs off a disturbed one
                if (role, r) != ("target", 1):
                    timed.append((role, r, *call(role, model, r, as_beams)))
        if refs:
            refs.append(call("target", models.target, 1, False))
    for _, model, _, _ in roles:
        model.clear()
    level = median([s for _, s in refs]) if refs else 1.0
    ratios: dict[tuple[str, int], list[float]] = {("target", 1): [1.0]} if refs else {}
    for role, r, mid, seconds in timed:
        ratios.setdefault((role, r), []).append(seconds / _at(refs, mid) if refs else seconds)
    out: dict[str, dict[int, float]] = {role: {} for role, _, _, _ in roles}
    for (role, r), xs in ratios.items():
        out[role][r] = median(xs) * level
    # The level only sets the frame the first call of a run is read against: the ratios are the
    # record, each the median of its rounds, which one round off (a change of speed within it) does
    # not move: how far the median's nearest other round lies says whether it can be trusted.
    return Timings(out, max((_spread(xs) for xs in ratios.values()), default=0.0))


def _at(refs: list[tuple[float, float]], t: float) -> float:
    """The one-row call's seconds at time ``t``: between the reference calls either side of it."""
    before = max((p for p in refs if p[0] <= t), default=refs[0], key=lambda p: p[0])
    after = min((p for p in refs if p[0] >= t), default=refs[-1], key=lambda p: p[0])
    if after[0] <= before[0]:
        return before[1]
    return before[1] + (after[1] - before[1]) * (t - before[0]) / (after[0] - before[0])


def _spread(xs: list[float]) -> float:
    """Log distance from the median of ``xs`` to its nearest other value (0 for one value)."""
    if len(xs) < 2:
        return 0.0
    logs = sorted(math.log(x) for x in xs)
    mid = len(logs) // 2
    return min(abs(logs[mid] - y) for i, y in enumerate(logs) if i != mid)


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
        timed = measure(models, target_rows, aux_rows)
        tables = timed.tables
        if not timed.busy:  # a busy machine's calibration serves this engine, and is timed again next time
            store.remember(lambda: store.write_json(record, timed.tables))
    target = tables.get("target")  # a tree verify starts from the same shape, scaled to its own calls
    return Model(target=Costs(seed=target), aux=Costs(seed=tables.get("aux")), tree=Costs(seed=target))
