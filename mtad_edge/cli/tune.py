"""`mtad-edge tune`: measure the shortest draft gamma 'auto' may use for a pair without losing
MTAD's quality (mtad_edge/tune.py), and save it where every later request finds it."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any, Optional

import click

import mtad_edge.floors as floors
import mtad_edge.tune as tuning
from mtad_edge.bench.run import load_prompts
from mtad_edge.cli.options import (
    FiniteRange,
    ModelChoice,
    decode_config,
    errors_as_click,
    given,
    model_options,
    request_option,
)
from mtad_edge.runtime.backends.llama_cpp_backend import default_threads
from mtad_edge.runtime.errors import MtadEdgeError
from mtad_edge.store import os_error


def _fmt(v: Optional[float], spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


@click.command()
@model_options
@click.option(
    "--method",
    type=click.Choice(tuning.tunable()),
    default="mtad",
    show_default=True,
    help="The method whose floor is measured.",
)
@request_option("beam_width")
@request_option("tree")
@request_option("accept_threshold")
@request_option("temperature")
@request_option("top_k")
@request_option("top_p")
@request_option("seed", default=0, help="Base seed of the prompt-runs.")
@request_option("max_tokens", default=128, help="Tokens per prompt-run.")
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(dir_okay=False),
    default="quality",
    show_default=True,
    help="JSONL prompts, or a built-in set ('quality': 8 open-ended prompts; 'default').",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=6,
    show_default=True,
    help="Seeds per prompt: a ratio near the bound needs ~50 prompt-runs to be told from it.",
)
@click.option(
    "--bound",
    type=FiniteRange(min=1.0, max=2.0),
    default=tuning.BOUND,
    show_default=True,
    help="Largest PPL ratio to the reference gamma a shorter draft may have.",
)
@click.option(
    "--confidence",
    type=FiniteRange(min=0.5, max=0.99),
    default=tuning.CONFIDENCE,
    show_default=True,
    help="Share of bootstrap resamples of the prompt-runs a shorter draft must be within the bound in.",
)
@click.option("--dry-run", is_flag=True, help="Measure and print, but save nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON on stdout.")
@errors_as_click
def tune(
    model: ModelChoice,
    prompts_file: str,
    repeats: int,
    bound: float,
    confidence: float,
    dry_run: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Find the shortest draft that keeps MTAD's perplexity within BOUND x that at gamma 4 for this
    pair and these sampling options, and make it gamma 'auto''s floor (gamma_min) for them.

    Decodes the prompts at gamma 4, then 3, 2, 1 on the same seeds, stopping at the first not
    within the bound in CONFIDENCE of the bootstrap resamples of the prompt-runs; 5-12 minutes
    on a 135-270M pair on 2 CPU cores. Requests that give --gamma-min keep their own."""
    cfg = decode_config(**options)
    chosen = given(options)
    tuning.check_tunable(cfg)
    prompts = load_prompts(prompts_file)
    model = replace(model, options=replace(model.options, threads=model.options.threads or default_threads()))
    ref = floors.reference(cfg)
    width = cfg.beam_width if isinstance(cfg.beam_width, int) else 1
    with model.engine(replace(cfg, gamma=ref), [cfg.method], (ref, width), given=chosen) as engine:
        # the floor is measured for what requests get: the model's sampling where none is given
        cfg = cfg.with_options({k: v for k, (v, _) in engine.recommended.items()})
        tuning.check_tunable(cfg)
        s = cfg.sampling
        click.echo(
            f"tune: {cfg.method} on {model.label}, T={s.temperature:g} top-k {s.top_k} top-p {s.top_p:g}, "
            f"width {width}, {len(prompts) * repeats} prompt-runs x {cfg.max_tokens} tokens per gamma",
            err=True,
        )
        with click.progressbar(length=len(prompts) * repeats * ref, label="tune", file=sys.stderr) as bar:
            record = tuning.tune(engine, cfg, prompts, repeats, bound, confidence, bar.update)
        pair = engine.pair
    click.echo(
        f"{'gamma':>5}  {'PPL':>7}  {f'vs g={ref}':>8}  {'90 % interval':>16}  {f'<= {bound:g}':>7}  {'tok/s':>7}",
        err=True,
    )
    for g, row in record["gammas"].items():
        r = row.get("ppl_ratio") or {"ratio": 1.0, "low": None, "high": None}
        span = f"[{_fmt(r['low'], '.3f')}, {_fmt(r['high'], '.3f')}]" if "ppl_ratio" in row else ""
        share = f"{row['within']:.0%}" if "within" in row else ""
        verdict = "" if "within" not in row else "  passes" if row["within"] >= confidence else "  not shown within"
        click.echo(
            f"{g:>5}  {_fmt(row['ppl'], '.3f'):>7}  {r['ratio']:>8.3f}  {span:>16}  {share:>7}  "
            f"{_fmt(row['tokens_per_s'], '.1f'):>7}{verdict}",
            err=True,
        )
    if as_json:  # first: the minutes of measuring are kept even when the cache refuses the record
        click.echo(json.dumps(record))
    try:
        where = "not saved (--dry-run)" if dry_run else f"saved to {floors.save(pair, cfg, record)}"
    except OSError as e:
        raise MtadEdgeError(
            f"floor {record['floor']} measured, but the cache refused it: {os_error(e)} (--json prints the record)"
        ) from None
    click.echo(f"floor: gamma 'auto' drafts at least {record['floor']} for these options ({where})", err=True)
