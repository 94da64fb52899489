"""`mtad-edge bench`: every variant (a method with request options: ``sd g=2``, ``ar T=0.6``) on
a prompt set, with JSON, a Markdown report and plots."""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import click
from click.core import ParameterSource

from mtad_edge import store
from mtad_edge.bench import judge as judging
from mtad_edge.bench import lookup, native, peer, report
from mtad_edge.bench.paired import paired
from mtad_edge.bench.quality import frontier, resolution
from mtad_edge.bench.relay import RELAY_DELAY_MAX_MS, DelayRelay
from mtad_edge.bench.run import (
    PRESETS,
    BenchConfig,
    aggregate,
    load_prompts,
    preset_settings,
    projection,
    ratios,
    rendered_prompts,
    run_bench,
    validator,
)
from mtad_edge.bench.variants import Variant, expand
from mtad_edge.bench.variants import capacity as variant_capacity
from mtad_edge.cli.options import (
    FiniteRange,
    ModelChoice,
    decode_config,
    errors_as_click,
    given,
    model_options,
    sampling_options,
    write_out,
)
from mtad_edge.loader import aux_gpu_layers
from mtad_edge.runtime.backends.llama_cpp_backend import default_threads, uses_amx
from mtad_edge.runtime.drafting.controller import Controller, Model
from mtad_edge.runtime.errors import MtadEdgeError, json_problem
from mtad_edge.runtime.methods import names as method_names
from mtad_edge.runtime.options import OPTIONS


def _methods(value: str) -> tuple[str, ...]:
    names = tuple(m.strip() for m in value.split(",") if m.strip())
    for m in names:
        if m not in method_names():
            raise click.BadParameter(
                f"unknown method {m!r} (choose from {', '.join(method_names())})", param_hint="--methods"
            )
    if not names:
        raise click.BadParameter("no methods given", param_hint="--methods")
    return names


def _floats(value: str):
    return [float(v) for v in value.split(",") if v.strip()]


def _ints(value: str):
    return [int(v) for v in value.split(",") if v.strip()]


def _option_list(value: Optional[str], name: str, flag: str) -> list[Any]:
    """A comma-separated list of one request option's values, checked by the option table."""
    try:
        return [OPTIONS[name].parse(v.strip()) for v in (value or "").split(",") if v.strip()]
    except MtadEdgeError as e:
        raise click.BadParameter(str(e), param_hint=flag) from None


def sweep_settings(base, thresholds, gammas, widths) -> list[dict]:
    """One parameter at a time around the base settings (plus the base itself)."""
    base_point = dict(accept_threshold=base.accept_threshold, gamma=base.gamma, beam_width=base.beam_width)
    points = [base_point]
    for key, values in (("accept_threshold", thresholds), ("gamma", gammas), ("beam_width", widths)):
        points += [{**base_point, key: v} for v in values if v != base_point[key]]
    return points


@click.command()
@model_options
@sampling_options
@click.option("--methods", default="ar,sd,mtad", show_default=True, help="Comma-separated methods to compare.")
@click.option(
    "--gammas",
    help="Comma-separated gamma values (ints, or 'auto'): each drafting method runs once per value, "
    "labelled 'METHOD g=VALUE'; writes gammas.png.",
)
@click.option(
    "--ar-temperatures",
    help="Comma-separated temperatures for plain decoding ('ar T=VALUE'): the curve every other variant "
    "is compared with at equal PPL (report.md, quality.png). E.g. 1,0.8,0.6,0.4,0.3.",
)
@click.option(
    "--variant",
    "variant_specs",
    multiple=True,
    metavar="SPEC",
    help="Also run METHOD with request options, e.g. 'mtad g=6 w=2 thr=0.3 T=0.8' "
    "(g gamma, w beam_width, thr accept_threshold, T temperature, k top_k, p top_p, or full names). Repeatable.",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(dir_okay=False),
    help="JSONL with 'prompt' or 'messages' per line, or a built-in set: 'default' (chat, code, explanation, "
    "story), 'quality' (8 open-ended prompts, for the quality frontier), 'quality-large' (24 open-ended "
    "chat prompts: advice, explanations, stories, descriptions, opinions, instructions), 'grounded' (8 "
    "rewrite, summarise and code-edit prompts with their source in the prompt, where prompt lookup pays) or "
    "'structured' (24 prompts, each answered under its JSON schema: validity, forced share; llama-server gets "
    "the same json_schema). A line's optional 'schema' constrains its answer.",
)
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--judge",
    "judge_ref",
    metavar="PAIR|GGUF",
    help="Also score every run's text under a model that took no part (a pair name means its target, e.g. "
    "gemma3-270m when benchmarking smollm2-135m): the judge's PPL, and each variant against plain decoding "
    "at equal judge PPL.",
)
@click.option(
    "--preset",
    type=click.Choice(sorted(PRESETS)),
    help="Settings that go together; options given beside it win. quality: --prompts quality-large (24 "
    "open-ended chat prompts) --repeats 4 --max-tokens 128 --ar-temperatures 1,0.8,0.6,0.4. structured: "
    "--prompts structured --max-tokens 160.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    help="Folder for results.json, report.md and the plots (default: a new bench-out/YYYY-MM-DD-HHMM).",
)
@click.option(
    "--llama-cpp-bin",
    type=click.Path(file_okay=False, exists=True),
    help="Folder with llama.cpp's llama-bench and llama-speculative-simple for the native column.",
)
@click.option(
    "--llama-server",
    metavar="BIN",
    help="llama.cpp's llama-server for the peer column: plain decoding and its draft-model speculation with "
    "the pair's aux (its defaults; n-max 8, p-min 0.5), on our prompt tokens, sampling and seeds, one server "
    "at a time, in each prompt's run order beside our variants.",
)
@click.option("--sweep", is_flag=True, help="Also sweep MTAD's threshold, gamma and beam width; writes sweep.png.")
@click.option(
    "--curve",
    "curve_dirs",
    multiple=True,
    type=click.Path(file_okay=False, exists=True),
    metavar="DIR",
    help="Instead of running: plot each method's speed-up over ar against the target's size from earlier "
    "runs' DIR/results.json (e.g. the stand-ins x1, x2, x4, x8); writes sizes.png and sizes.md. Repeatable.",
)
@click.option(
    "--relay-delay",
    type=FiniteRange(min=0, max=RELAY_DELAY_MAX_MS),
    metavar="MS",
    help="With --rpc: reach each rpc server through a loopback relay that adds MS milliseconds each way "
    "(bench/relay.py), to see what a network's latency costs each method.",
)
@click.option("--sweep-thresholds", default="0.1,0.3,0.5,0.7,0.9", show_default=True)
@click.option("--sweep-gammas", default="2,4,6", show_default=True)
@click.option("--sweep-widths", default="1,2,4,8", show_default=True)
@errors_as_click
def bench(
    model: ModelChoice,
    methods: str,
    gammas: Optional[str],
    ar_temperatures: Optional[str],
    variant_specs: tuple[str, ...],
    prompts_file: Optional[str],
    repeats: int,
    judge_ref: Optional[str],
    preset: Optional[str],
    out_dir: Optional[str],
    llama_cpp_bin: Optional[str],
    llama_server: Optional[str],
    sweep: bool,
    sweep_thresholds: str,
    sweep_gammas: str,
    sweep_widths: str,
    curve_dirs: tuple[str, ...],
    relay_delay: Optional[float],
    **sampling: Any,
) -> None:
    """Measure speed, acceptance, perplexity, diversity, repetition and energy of each variant
    (methods, gamma settings, plain decoding's temperatures) on the same pair, prompts and seeds."""
    if curve_dirs:
        _curve(curve_dirs, _out_folder(out_dir))
        return
    if relay_delay is not None and not model.options.rpc:
        raise click.BadParameter("needs --rpc (the servers to relay to)", param_hint="--relay-delay")
    if preset:
        ctx = click.get_current_context()
        typed = {k for k in PRESETS[preset] if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT}
        settings = preset_settings(preset, typed)
        prompts_file = settings.get("prompts_file", prompts_file)
        repeats = settings.get("repeats", repeats)
        ar_temperatures = settings.get("ar_temperatures", ar_temperatures)
        sampling["max_tokens"] = settings.get("max_tokens", sampling["max_tokens"])
    chosen = _methods(methods)
    # reproducible by default; the base request is mtad's unless it is not benched (a target alone: ar)
    base_method = "mtad" if "mtad" in chosen else chosen[0]
    base = decode_config(method=base_method, **{**sampling, "seed": sampling["seed"] or 0})
    gamma_values = _option_list(gammas, "gamma", "--gammas")
    temps = _option_list(ar_temperatures, "temperature", "--ar-temperatures")
    try:  # checked before anything loads; told apart again once the model's defaults are known
        variants, _ = expand(base, chosen, gamma_values, temps, variant_specs)
    except MtadEdgeError as e:
        raise click.BadParameter(str(e), param_hint="--variant") from None
    cfg = BenchConfig(variants=tuple(variants), repeats=repeats, decode=base)
    points = sweep_settings(base, _floats(sweep_thresholds), _ints(sweep_gammas), _ints(sweep_widths)) if sweep else []
    prompts = load_prompts(prompts_file)
    if any("schema" in p for p in prompts):
        validator()  # the validity column's library, before any loading
    judge_pair = judging.locate(judge_ref, _say) if judge_ref else None  # a bad --judge fails before any loading
    server_defaults = peer.check_binary(Path(llama_server)) if llama_server else {}  # so does a bad --llama-server
    threads = model.options.threads or default_threads()
    model = replace(model, options=replace(model.options, threads=threads))
    room = variant_capacity(base, variants)
    capacity = (
        max([room[0]] + [p["gamma"] for p in points if isinstance(p["gamma"], int)]),  # room for every setting
        max([room[1]] + [p["beam_width"] for p in points if isinstance(p["beam_width"], int)]),
    )
    engine_methods = list(dict.fromkeys([v.method for v in variants] + (["mtad"] if points else [])))
    out = _out_folder(out_dir)
    with (
        _relayed(model, relay_delay) as (model_here, relays),
        model_here.engine(base, engine_methods, capacity, given=given(sampling)) as engine,
        contextlib.ExitStack() as stack,
    ):
        recommended = engine.recommended  # what users get where an option is not given: the model's values
        base = base.with_options({k: v for k, (v, _) in recommended.items()})
        variants, dropped = expand(base, chosen, gamma_values, temps, variant_specs)  # 'ar T=1' may be 'ar' now
        for label, same in dropped:
            click.echo(f"bench: {label!r} is the same request as {same!r}; measured once as {same!r}", err=True)
        cfg = BenchConfig(variants=tuple(variants), repeats=repeats, decode=base)
        total = repeats * len(prompts) * len(variants) + len(points) * len(prompts)
        checked = [v.config(base, 0) for v in variants] + [replace(base, **p) for p in points]
        rendered = rendered_prompts(engine, prompts, checked)
        paths, learned, n_params = engine.pair, engine.learned, engine.n_params
        judge = None
        if judge_pair is not None:
            judge = stack.enter_context(
                judging.Judge.open(judge_pair, judging.context_for(prompts, rendered, base.max_tokens), model.options)
            )
            if judging.same_file(Path(str(judge_pair.target)), paths.target):
                _say(f"bench: the judge {judge_ref} is the target itself: its PPL is not independent")
        # llama-bench's tg runs before our first repeat and after each (the machine's speed drifts
        # over minutes), after as many cached tokens as our runs' median prompt
        tg_runs: list[dict[str, Any]] = []
        after_repeat: Callable[[int], None] = lambda rep: None
        if llama_cpp_bin:
            if paths.aux is None:
                raise MtadEdgeError("--llama-cpp-bin needs a pair with an aux model")
            depth = int(statistics.median(len(engine.tokenize(t)) for t in rendered)) if rendered else 0
            tg = functools.partial(
                native.llama_bench,
                Path(llama_cpp_bin),
                Path(str(paths.target)),
                base.max_tokens,
                threads,
                depth,
                engine.flash_attn,
                engine.amx,
            )
            tg_runs.append(tg())
            after_repeat = lambda rep: tg_runs.append(tg())
        column = None
        if llama_server:
            ids = [engine.tokenize(t) for t in rendered]
            aux = Path(str(paths.aux)) if paths.aux else None
            column = peer.Column(
                Path(llama_server),
                Path(str(paths.target)),
                aux,
                server_defaults,
                base,
                prompts,
                ids,
                threads,
                engine.n_ctx,
                model.options.flash_attn,  # llama-server's own default (auto: on for a CPU) unless one is asked for
                engine.amx,
                gpu_layers=(model.options.n_gpu_layers, aux_gpu_layers(engine.pair, model.options)),
                score=engine.score,
                say=_say,
                aux_threads=model.options.aux_threads,
            )
            column.probe()
            total += repeats * len(prompts) * len(column.settings)
        bar = stack.enter_context(click.progressbar(length=total, label="bench", file=sys.stderr))
        rows = run_bench(engine, prompts, cfg, bar.update, judge, after_repeat, column.hooks() if column else ())
        sweep_rows = []
        for p in points:
            one = BenchConfig.of_methods(("mtad",), repeats=1, decode=replace(base, **p))
            agg = aggregate(run_bench(engine, prompts, one, bar.update, judge))["mtad"]
            keys = ("tokens_per_s", "block_efficiency", "acceptance_rate", "ppl", "judge_ppl", "distinct_2", "rep_4")
            sweep_rows.append({**p, **{k: agg.get(k) for k in keys}})
        judge_info = judging.describe(judge, judge_ref or "", paths.target)
        kernels = engine.kernels
        achieved = [a for r in relays if (a := r.achieved_ms()) is not None]
    agg = aggregate(rows, {v.label: v for v in variants})
    results = {
        "schema": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "pair": {
            "name": paths.manifest.name if paths.manifest else Path(str(paths.target)).stem,
            "target": str(paths.target),
            "aux": str(paths.aux) if paths.aux else None,
            "target_parameters": n_params,
            "standin": paths.manifest.data.get("standin") if paths.manifest else None,
        },
        "config": {
            "methods": list(chosen),
            "gammas": gamma_values or None,
            "ar_temperatures": temps or None,
            "variant_specs": list(variant_specs) or None,
            "prompts": len(prompts),
            "repeats": repeats,
            "max_tokens": base.max_tokens,
            "temperature": base.sampling.temperature,
            "top_k": base.sampling.top_k,
            "top_p": base.sampling.top_p,
            "gamma": base.gamma,
            "beam_width": base.beam_width,
            "accept_threshold": base.accept_threshold,
            "seed": base.seed,
            "threads": threads,
            "aux_threads": model.options.aux_threads,
            "prompts_file": prompts_file or "default",
            "preset": preset,
            "judge": judge_info,
            "recommended": {k: list(v) for k, v in recommended.items()} or None,
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_threads_used": threads,
            "amx": uses_amx(),
            "kernels": kernels,
        },
        "variants": [_variant_json(v) for v in variants],
        "methods": agg,
        "ratios": ratios(agg),
        "projection": projection(agg) or None,
        "paired": paired(rows) or None,
        "frontier": frontier(agg) or None,
        "resolution": resolution(agg) or None,
        "native": _native(llama_cpp_bin, paths, rendered, base, threads, tg_runs) if tg_runs else None,
        "llama_server": column.results(rows, agg) if column else None,
        "sweep": sweep_rows or None,
        "rpc": {
            "servers": list(model.options.rpc),
            "relay_delay_ms": relay_delay,
            "relay_achieved_ms": statistics.mean(achieved) if achieved else None,
        }
        if model.options.rpc
        else None,
        "learned_costs": _learned_costs(learned),
        "lookup_ceiling": _lookup_ceiling(rows, learned, base.max_gamma),
        "runs": rows,
    }
    md = report.report_markdown(results, chart=not report.can_plot())
    try:
        report.write_json(out, results)
        (out / "report.md").write_text(md)
        pngs = [report.plot_bench(out, results), report.plot_quality(out, results)]
        if gamma_values:
            pngs.append(report.plot_gammas(out, results))
        if sweep_rows:
            pngs.append(report.plot_sweep(out, sweep_rows))
    except OSError as e:
        write_out(md + "\n")  # the whole report reaches the screen, whatever the output folder's disk does
        raise MtadEdgeError(f"cannot write the results into {out}: {store.os_error(e)}; {_kept(results)}") from None
    write_out("\n" + report.summary_text(results))
    drawn = ", ".join(str(p) for p in pngs if p)
    click.echo(
        f"wrote {out / 'report.md'} (every table, its terms explained), {out / 'results.json'}"
        + (f", {drawn}" if drawn else " (a text chart in the report; mtad-edge[bench] adds plots)"),
        err=True,
    )
    if column is not None and column.error is not None:  # the bench's own figures are written by now
        raise MtadEdgeError(f"the llama-server column is incomplete: {column.error} (the rest is in {out})")


OUT_ROOT = Path("bench-out")


def _out_folder(out_dir: Optional[str]) -> Path:
    """--out as given (made where missing), else a new folder under bench-out/ named by the local
    date and minute (a second run in the same minute gets -2, -3, ...): a run never overwrites another."""
    if out_dir is not None:
        return store.make_folder(Path(out_dir), "the output folder")
    stem = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    store.make_folder(OUT_ROOT, "the output folder")
    for n in range(1, 1000):
        folder = OUT_ROOT / (stem if n == 1 else f"{stem}-{n}")
        try:
            folder.mkdir()  # claimed atomically: a run beside this one takes the next name
            return folder
        except FileExistsError:
            continue
        except OSError as e:
            raise MtadEdgeError(f"cannot make the output folder {folder}: {store.os_error(e)}") from None
    raise MtadEdgeError(f"{OUT_ROOT} holds 999 runs of {stem}: give --out")


def _kept(results: dict[str, Any]) -> str:
    """Where a bench's results went when its output folder refused them (a full disk): the
    report is on standard output, the results in a temporary file where one can be written."""
    lost = "the report is above; the per-run results could not be kept anywhere"
    try:
        fd, name = tempfile.mkstemp(prefix="mtad-edge-results-", suffix=".json")
    except OSError:
        return lost
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(results, indent=2) + "\n")
    except OSError:
        store.drop(Path(name))
        return lost
    return f"the report is above, and the results were kept in {name}"


@contextlib.contextmanager
def _relayed(model: ModelChoice, delay_ms: Optional[float]) -> Iterator[tuple[ModelChoice, list[DelayRelay]]]:
    """``model`` with its rpc servers reached through delay relays where ``delay_ms`` is given, and
    the relays (closed after the engine that uses them)."""
    relays: list[DelayRelay] = []
    try:
        if delay_ms is not None and model.options.rpc:
            relays = [DelayRelay(server, delay_ms) for server in model.options.rpc]
            model = replace(model, options=replace(model.options, rpc=tuple(r.endpoint for r in relays)))
        yield model, relays
    finally:
        for r in relays:
            r.close()


def _curve(dirs: tuple[str, ...], out: Path) -> None:
    """Speed-up against target size from earlier runs (report.size_curve)."""
    runs = []
    for d in dirs:
        path = Path(d) / "results.json"
        try:
            run = json.loads(path.read_text())
        except OSError as e:
            raise MtadEdgeError(f"cannot read {path}: {e.strerror}") from None
        except (ValueError, RecursionError) as e:
            raise MtadEdgeError(f"cannot read {path}: {json_problem(e)}") from None
        if (problem := report.run_problem(run)) is not None:
            raise MtadEdgeError(f"{path} is not a results.json of mtad-edge bench: {problem}")
        runs.append(run)
    store.make_folder(out, "the output folder")
    md = report.size_curve_markdown(runs)
    (out / "sizes.md").write_text(md)
    png = report.plot_sizes(out, runs)
    click.echo(md)
    click.echo(f"wrote {out / 'sizes.md'}" + (f", {png}" if png else ""), err=True)


def _say(message: str) -> None:
    click.echo(message, err=True)


def _variant_json(v: Variant) -> dict[str, Any]:
    return {"label": v.label, "method": v.method, "options": dict(v.options)}


def _native(bin_dir, paths, rendered, base, threads, tg_runs: list[dict]) -> dict:
    """llama-bench (AR, target alone: ``tg_runs``, before our repeats and after each) and
    llama-speculative-simple (greedy, same gamma) per prompt."""
    fa = tg_runs[0]["flash_attn"]
    tg = native.pooled(tg_runs)
    res = {"llama-bench tg target": tg}
    runs = [
        native.speculative_simple(
            Path(bin_dir),
            Path(paths.target),
            Path(paths.aux),
            text,
            base.max_tokens,
            threads,
            base.max_gamma,
            flash_attn=fa,
        )
        for text in rendered
    ]
    gen, sec = sum(r["generated"] for r in runs), sum(r["decode_s"] for r in runs)
    drafted, acc = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
    res[f"speculative-simple temp 0, draft {base.max_gamma}"] = {
        "tool": "llama-speculative-simple",
        "tokens_per_s": gen / sec if sec else None,
        "acceptance_rate": acc / drafted if drafted else None,
        "generated": gen,
        "runs": runs,
    }
    return res


def _lookup_ceiling(rows: list[dict[str, Any]], model: Model, gamma: int) -> Optional[dict[str, Any]]:
    """Prompt lookup's ceiling on ar's texts (bench/lookup.py), a step keeping j drafted tokens
    priced as lookup's own controller prices a draft of j (on a copy: no acceptance is touched)."""
    if not model.target.known:
        return None
    controller = Controller(model.copy(frozen=True), "lookup ceiling", range(0, gamma + 1), [1], tree=False, free=True)
    found = lookup.ceiling([r for r in rows if r.get("label") == "ar"], lambda j: controller.step_seconds(j, 1))
    return {**found, "gamma": gamma} if found else None


def _learned_costs(model: Model) -> dict[str, Any]:
    """What the adaptive controller learned during the bench, in milliseconds: a call's cost by
    rows (target; MMTAD's tree verify apart) or beams (aux), as read at the end (through the
    machine's ``pace`` then, against the moments the entries were learned), the time a step
    spends outside model calls, and what the aux takes per token it feeds after plain steps."""

    def ms(table: dict[int, float]) -> dict[str, float]:
        return {str(r): round(s * 1000, 3) for r, s in sorted(table.items())}

    return {
        "target_ms": ms(model.target.entries()),
        "aux_ms": ms(model.aux.entries()),
        "tree_target_ms": ms(model.tree.entries()),
        "pace": round(model.pace.factor, 3),
        # the aux's level against the target's, learned from the two models' calls of one step
        "aux_level": round(math.exp(model.pace.aux), 3),
        "calibration_target_ms": ms(model.target.seed),
        "calibration_aux_ms": ms(model.aux.seed),
        "plain_step_overhead_ms": round(model.overhead * 1000, 3),
        "draft_step_overhead_ms": round(model.draft_overhead * 1000, 3),
        "aux_catchup_ms_per_token": None if model.catchup is None else round(model.catchup_s(1) * 1000, 3),
    }
