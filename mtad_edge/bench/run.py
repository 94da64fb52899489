"""The benchmark loop: every variant (a method with request options) on every prompt, repeated,
measured the same way."""

from __future__ import annotations

import decimal
import json
import math
import os
import random
import resource
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from mtad_edge.bench.drafting import share
from mtad_edge.bench.energy import EnergyMeter
from mtad_edge.bench.judge import Judge
from mtad_edge.bench.lookup import keepable
from mtad_edge.bench.quality import quality, run_counts
from mtad_edge.bench.variants import Variant
from mtad_edge.engine import Engine, check_text
from mtad_edge.runtime.backends.rpc import REPLY, Cmd
from mtad_edge.runtime.config import DecodeConfig
from mtad_edge.runtime.errors import ContextOverflowError, MtadEdgeError, json_problem


@dataclass(frozen=True)
class BenchConfig:
    variants: tuple[Variant, ...] = (Variant("ar", "ar"), Variant("sd", "sd"), Variant("mtad", "mtad"))
    repeats: int = 1
    decode: DecodeConfig = field(default_factory=DecodeConfig)  # the base; each variant overrides it

    @classmethod
    def of_methods(cls, methods: tuple[str, ...], **kw: Any) -> BenchConfig:
        return cls(variants=tuple(Variant(m, m) for m in methods), **kw)


# Packaged prompt sets, by name: the default mix (chat, code, explanation, story), the open-ended
# set the quality frontier is measured on (8 prompts where diversity and repetition show) and a
# larger one of 24 open-ended chat prompts (advice, explanations, stories, descriptions, opinions,
# instructions) for the quality preset.
# The input-grounded set (grounded): rewrite, summarise with quotes, edit code, with the source in
# the prompt, where an answer copies its input and prompt lookup drafts for free.
# The structured set: 24 chat prompts each with a JSON schema its answer follows (nested objects,
# arrays with bounds, enums, numbers with ranges, optional fields, anyOf, string formats and
# patterns), every string bounded so that a whole answer fits in the preset's max tokens.
PROMPT_SETS = {
    "default": "prompts.jsonl",
    "quality": "quality.jsonl",
    "quality-large": "quality-large.jsonl",
    "grounded": "grounded.jsonl",
    "structured": "structured.jsonl",
}

# `bench --preset NAME`: settings that go together; an option given on the command line wins.
# quality: enough prompt-runs to tell quality gaps from noise (24 prompts x 4 seeds = 96 runs per
# variant, 128 tokens each) and plain decoding's temperature curve to place every variant against.
PRESETS: dict[str, dict[str, Any]] = {
    "quality": {
        "prompts_file": "quality-large",
        "repeats": 4,
        "max_tokens": 128,
        "ar_temperatures": "1,0.8,0.6,0.4",
    },
    # structured: the schema set, with room for its longest answers (about 120 tokens)
    "structured": {"prompts_file": "structured", "max_tokens": 160},
}


def preset_settings(name: Optional[str], given: set[str]) -> dict[str, Any]:
    """The preset's settings that no option in ``given`` (names of options set on the command
    line) overrides."""
    if name is None:
        return {}
    return {k: v for k, v in PRESETS[name].items() if k not in given}


def load_prompts(path: Optional[str | os.PathLike] = None) -> list[dict]:
    """JSONL: one object per line with ``prompt`` (raw text) or ``messages`` (chat); optional ``id``
    and ``schema`` (a JSON schema the answer follows, and is validated against).
    ``path`` may also name a packaged set (``default``, ``quality``, ``quality-large``, ``grounded``,
    ``structured``); None is ``default``."""
    name = "default" if path is None else str(path)
    if name in PROMPT_SETS and not Path(name).exists():
        text = resources.files("mtad_edge.data").joinpath(PROMPT_SETS[name]).read_text()
        where = f"built-in prompts {name!r}"
    else:
        try:
            text = Path(name).read_text()
        except OSError as e:
            raise MtadEdgeError(f"cannot read prompts file {name}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise MtadEdgeError(f"cannot read prompts file {name}: not UTF-8 text") from None
        where = name
    items: list[dict[str, Any]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise MtadEdgeError(f"{where} line {n}: not JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:
            raise MtadEdgeError(f"{where} line {n}: not JSON ({json_problem(e)})") from None
        if not isinstance(item, dict) or not (
            isinstance(item.get("prompt"), str) or isinstance(item.get("messages"), list)
        ):
            raise MtadEdgeError(f"{where} line {n}: needs a 'prompt' string or a 'messages' list")
        if "schema" in item and not isinstance(item["schema"], dict):
            raise MtadEdgeError(f"{where} line {n}: the 'schema' must be a JSON schema object")
        if "messages" not in item:  # checked here, with its line, not when its turn to run comes
            if not item["prompt"]:
                raise MtadEdgeError(f"{where} line {n}: the 'prompt' is empty")
            try:
                check_text(item["prompt"], "prompt", "the 'prompt'")
            except MtadEdgeError as e:
                raise MtadEdgeError(f"{where} line {n}: {e}") from None
        item.setdefault("id", f"p{len(items) + 1}")
        items.append(item)
    if not items:
        raise MtadEdgeError(f"{where}: no prompts")
    return items


def render(engine: Engine, item: dict[str, Any]) -> str:
    """The prompt text of a prompt-file item (chat messages rendered with the pair's template)."""
    return engine.render_chat(item["messages"]) if "messages" in item else item["prompt"]


def rendered_prompts(engine: Engine, prompts: list[dict[str, Any]], configs: Sequence[DecodeConfig] = ()) -> list[str]:
    """Each item's prompt text, checked before any run so that a bad one cannot end a bench after
    the prompts before it ran: its messages render, it has fewer tokens than the context has
    cells, and each of ``configs`` (the requests that will run it) can start it: a step's own
    cells depend on the method, gamma and width. Making a request does no work until it is read,
    and one that cannot start raises there."""
    texts = []
    for item in prompts:
        try:
            text = render(engine, item)
        except MtadEdgeError as e:
            raise MtadEdgeError(f"prompt {item['id']!r}: {e}") from None
        n = len(engine.tokenize(text))
        if n >= engine.n_ctx:
            raise ContextOverflowError(
                f"prompt {item['id']!r} has {n} tokens, and the context holds {engine.n_ctx} with the answer; "
                "shorten it or raise --ctx-size"
            )
        for cfg in configs:
            try:
                engine.generate(text, learned_costs=True, json_schema=item.get("schema"), **cfg.as_options())
            except ContextOverflowError as e:
                raise ContextOverflowError(f"prompt {item['id']!r} cannot run {cfg.method}: {e}") from None
            except MtadEdgeError as e:  # its schema is refused
                raise MtadEdgeError(f"prompt {item['id']!r}: {e}") from None
        texts.append(text)
    return texts


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _peak_rss_mb() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 / 1024 if sys.platform == "darwin" else kb / 1024  # bytes on macOS, KiB on Linux


def measure(
    engine: Engine, item: dict[str, Any], cfg: DecodeConfig, meter: EnergyMeter, judge: Optional[Judge] = None
) -> dict[str, Any]:
    """One request with every per-run figure; PPL (the target's, and the judge's where one is
    given) and the n-gram counts are computed afterwards, outside the timing."""
    cpu0 = _cpu_s()
    meter.start()
    # Seeds make variants sample alike; 'auto' plans as for an unseeded user, from learned costs.
    prompt = render(engine, item)
    traffic = engine.rpc_traffic
    response = engine.generate(prompt, learned_costs=True, json_schema=item.get("schema"), **cfg.as_options())
    text = response.text()
    energy = meter.stop()
    traffic = traffic_since(traffic, engine.rpc_traffic)
    cpu = _cpu_s() - cpu0
    st, tokens = response.stats, response.tokens
    logp = engine.score(response.prompt_ids, tokens)
    judged = judge.score(judge.prompt_text(item, prompt), text) if judge is not None else {}
    n = len(tokens)
    extra = st.to_dict()  # the adaptive controller's fields, on runtimes that have it
    return {
        "method": cfg.method,
        "chose": st.method if st.auto else None,  # method auto: what it decoded with
        "temperature": cfg.sampling.temperature,
        "seed": st.seed,
        "prompt_tokens": response.prompt_tokens,
        "generated": n,
        "wall_s": st.wall_s,
        "decode_s": st.decode_s,
        "prefill_s": st.prefill_s,
        "ttft_s": st.ttft_s,
        "tokens_per_s": st.tokens_per_s,
        "target_calls": st.target_calls,
        "drafted": st.drafted,
        "accepted": st.accepted,
        "acceptance_rate": st.acceptance_rate,
        "block_efficiency": st.block_efficiency,
        "draft_s": st.draft_s,
        "verify_s": st.verify_s,
        "target_s": st.target_s,
        "other_s": st.other_s,
        "logprob_sum": float(logp.sum()),
        "ppl": math.exp(-float(logp.mean())) if n else None,
        **judged,
        "cpu_s": cpu,
        "cpu_s_per_token": cpu / n if n else None,
        "peak_rss_mb": _peak_rss_mb(),
        "energy_j": energy,
        "j_per_token": energy / n if energy is not None and n else None,
        "accept_lengths": st.accept_lengths,
        "finish_reason": st.finish_reason,
        # with a schema: whether the answer parses and validates, and the masks' time
        "valid": valid_json(text, item["schema"]) if "schema" in item else None,
        "mask_s": st.mask_s if "schema" in item else None,
        "rpc": traffic,
        **{k: extra[k] for k in CONTROLLER_KEYS if extra.get(k) is not None},
        "drafters": {name: dict(counters) for name, counters in st.drafters.items()},
        **run_counts(tokens),
        "tokens": tokens,
        # On plain decoding's texts, what a lookup draft could keep at each position (bench/lookup.py).
        "lookup_kept": keepable(response.prompt_ids, tokens, cfg.max_gamma) if cfg.method == "ar" else None,
    }


def validator() -> Any:
    """jsonschema's module, for the structured set's validity column (the [bench] extra has it)."""
    try:
        import jsonschema
    except ImportError:
        raise MtadEdgeError(
            "the validity of structured answers is checked with jsonschema: pip install 'mtad-edge[bench]'"
        ) from None
    return jsonschema


def valid_json(text: str, schema: dict[str, Any]) -> bool:
    """Whether ``text`` is JSON that validates against ``schema`` (string formats checked where
    jsonschema has a checker for them: date, email, ipv4, uuid, ...). Numbers are read as the
    decimals JSON writes, schema and answer alike: in binary floats 0.07 is no multiple of 0.01."""
    jsonschema = validator()
    try:
        value = json.loads(text, parse_float=decimal.Decimal)
    except (ValueError, RecursionError):
        return False
    exact = json.loads(json.dumps(schema), parse_float=decimal.Decimal)
    base = jsonschema.validators.validator_for(exact)
    integral = base.TYPE_CHECKER.redefine(  # JSON schema: 2.0 is an integer
        "integer", lambda checker, x: base.TYPE_CHECKER.is_type(x, "integer") or _integral(x)
    )
    checker = jsonschema.validators.extend(base, type_checker=integral)
    return bool(checker(exact, format_checker=jsonschema.FormatChecker()).is_valid(value))


def _integral(x: Any) -> bool:
    return isinstance(x, decimal.Decimal) and x.is_finite() and x == x.to_integral_value()


# Stats of the adaptive-drafting controller (gamma/width "auto"): passed through when present.
CONTROLLER_KEYS = (
    "gamma_hist",
    "width_hist",
    "predicted_tokens_per_s",
    "predicted_tokens",
    "predicted_s",
    "controller_s",
    "gamma_min",
    "alone_steps",
)


def run_bench(
    engine: Engine,
    prompts: list[dict[str, Any]],
    cfg: BenchConfig,
    progress: Callable[[int], None] = lambda n: None,
    judge: Optional[Judge] = None,
    after_repeat: Callable[[int], None] = lambda rep: None,
    peers: Sequence[Callable[[int, int, int, int], None]] = (),
) -> list[dict[str, Any]]:
    """Rows for repeats x prompts x variants. Within a repeat every variant gets the same seed.
    ``judge``: every run's text is also scored by that model (bench/judge.py). ``after_repeat``
    is called with each repeat's index once it ended (the native column measures llama-bench there).
    ``peers``: runs outside the engine (bench/peer.py's llama-server settings), each called with
    (prompt index, repeat, seed, position in the order) in its place among the variants; they
    keep their own rows.

    The variants run in a fresh seeded order for each prompt and repeat: the engine keeps what it
    learned (costs, acceptance) and the machine warms up, so a fixed order would hand every variant
    the same neighbour. Rows come back in canonical order (repeat, prompt, variant as listed)."""
    meter = EnergyMeter()
    rows: list[dict[str, Any]] = []
    n = len(cfg.variants)
    for rep in range(cfg.repeats):
        for i, item in enumerate(prompts):
            seed = (cfg.decode.seed or 0) + 1000 * rep + i
            done: dict[int, dict[str, Any]] = {}
            for position, k in enumerate(run_order(n + len(peers), seed)):
                if k >= n:
                    peers[k - n](i, rep, seed, position)
                    progress(1)
                    continue
                v = cfg.variants[k]
                row = measure(engine, item, v.config(cfg.decode, seed), meter, judge)
                done[k] = {"label": v.label, "prompt_id": item["id"], "repeat": rep, "ran": position, **row}
                progress(1)
            rows.extend(done[k] for k in range(n))
        after_repeat(rep)
    return rows


def traffic_since(before: Optional[dict], after: Optional[dict]) -> Optional[dict[str, dict[str, int]]]:
    """The target's RPC traffic between two reads of ``Engine.rpc_traffic``, per command that ran
    (the prefill's included); None without rpc servers."""
    if after is None:
        return None
    out = {}
    for name, row in after.items():
        was = (before or {}).get(name, {})
        delta = {k: v - was.get(k, 0) for k, v in row.items()}
        if delta["calls"]:
            out[name] = delta
    return out


# The commands llama.cpp's RPC client waits on (a reply): each costs a round trip; the others are
# sent on without waiting.
ROUND_TRIPS = frozenset(Cmd(c).name for c in REPLY)


def rpc_totals(rows: list[dict]) -> Optional[dict[str, Any]]:
    """Runs' RPC traffic summed: calls, the calls that waited for a reply (round trips), bytes
    each way, and per command; None where no run went over RPC."""
    found = [r["rpc"] for r in rows if r.get("rpc") is not None]
    if not found:
        return None
    by: dict[str, dict[str, int]] = {}
    for traffic in found:
        for name, row in traffic.items():
            total = by.setdefault(name, {"calls": 0, "sent": 0, "received": 0})
            for k in total:
                total[k] += row[k]
    return {
        "calls": sum(r["calls"] for r in by.values()),
        "round_trips": sum(r["calls"] for n, r in by.items() if n in ROUND_TRIPS),
        "sent": sum(r["sent"] for r in by.values()),
        "received": sum(r["received"] for r in by.values()),
        "by_command": dict(sorted(by.items(), key=lambda kv: -kv[1]["calls"])),
    }


def run_order(n: int, seed: int) -> list[int]:
    """The order the n variants of one prompt run in: a permutation drawn from the prompt's seed."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def _total(rows, key):
    return sum(r[key] for r in rows)


def _forecast(rows: list[dict]) -> Optional[float]:
    """The controller's expected tok/s over ``rows`` (its expected tokens over its expected seconds,
    summed over the runs it planned); None where no run had an adaptive plan."""
    planned = [r for r in rows if r.get("predicted_s")]
    if not planned:
        return None
    return _total(planned, "predicted_tokens") / _total(planned, "predicted_s")


def _hist(rows: list[dict], key: str) -> Optional[dict[str, int]]:
    """Sum of the runs' histograms (keys as strings, sorted by value); None when no run has one."""
    found = [r[key] for r in rows if r.get(key) is not None]
    if not found:
        return None
    total: dict[str, int] = {}
    for h in found:
        for k, n in h.items():
            total[str(k)] = total.get(str(k), 0) + n
    return dict(sorted(total.items(), key=lambda kv: float(kv[0]) if kv[0].isdigit() else math.inf))


def aggregate(rows: list[dict], variants: Optional[dict[str, Variant]] = None) -> dict:
    """Per variant label: medians and spread over repeats for speed, totals for rates and PPL,
    pooled quality figures (distinct-n, rep-4, mean length) with their standard errors."""
    out = {}
    for label in dict.fromkeys(r.get("label", r["method"]) for r in rows):
        mine = [r for r in rows if r.get("label", r["method"]) == label]
        by_repeat = [[r for r in mine if r["repeat"] == k] for k in sorted({r["repeat"] for r in mine})]
        speeds = [_total(rr, "generated") / max(_total(rr, "decode_s"), 1e-12) for rr in by_repeat]
        # The controller's forecast pooled per repeat as the realised speed is, and the two compared
        # repeat by repeat: a median of forecasts against a median of repeats reads noise as a miss.
        forecasts = [(f, speed) for rr, speed in zip(by_repeat, speeds) if (f := _forecast(rr)) is not None]
        gen, calls, drafted = _total(mine, "generated"), _total(mine, "target_calls"), _total(mine, "drafted")
        energies = [r["energy_j"] for r in mine]
        hist: dict[str, int] = {}
        for r in mine:
            for k in r["accept_lengths"]:
                hist[str(k)] = hist.get(str(k), 0) + 1
        v = (variants or {}).get(label)
        out[label] = {
            "method": mine[0]["method"],
            "chose": _counts(r.get("chose") for r in mine),  # method auto: its choices, runs each
            "options": dict(v.options) if v else {},
            "temperature": mine[0].get("temperature"),
            "runs": len(mine),
            "generated": gen,
            "target_calls": calls,
            "tokens_per_s": statistics.median(speeds),
            "tokens_per_s_repeats": speeds,
            "tokens_per_s_min": min(speeds),
            "tokens_per_s_max": max(speeds),
            "block_efficiency": gen / calls if calls else None,
            "acceptance_rate": _total(mine, "accepted") / drafted if drafted else None,
            "ppl": math.exp(-_total(mine, "logprob_sum") / gen) if gen else None,
            "cpu_s_per_token": _total(mine, "cpu_s") / gen if gen else None,
            "j_per_token": sum(energies) / gen if gen and all(e is not None for e in energies) else None,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in mine),
            "ttft_s": statistics.median(r["ttft_s"] for r in mine if r["ttft_s"] is not None)
            if any(r["ttft_s"] for r in mine)
            else None,
            "draft_s": _total(mine, "draft_s"),
            "verify_s": _total(mine, "verify_s"),
            "target_s": _total(mine, "target_s"),
            "other_s": _total(mine, "other_s"),
            "accept_length_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "gamma_hist": _hist(mine, "gamma_hist"),
            "width_hist": _hist(mine, "width_hist"),
            "alone_steps": sum(r.get("alone_steps", 0) for r in mine),
            **share(mine),  # how much was drafted, repeat by repeat (the controller's choices)
            "predicted_tokens_per_s": statistics.median(f for f, _ in forecasts) if forecasts else None,
            "predicted_over_realised": statistics.median(f / speed for f, speed in forecasts) if forecasts else None,
            "controller_s": sum(r.get("controller_s", 0.0) for r in mine),
            "decode_s": _total(mine, "decode_s"),
            **quality(mine),
        }
        if all("judge_tokens" in r for r in mine):  # scored by a judge: its tokens, runs it could not hold whole
            out[label]["judge_tokens"] = _total(mine, "judge_tokens")
            out[label]["judge_truncated"] = sum(bool(r["judge_truncated"]) for r in mine)
        out[label]["time_ms_per_token"] = time_split(out[label])
        out[label]["rpc"] = rpc_totals(mine)
        out[label]["drafters"] = drafters(mine)
        out[label]["structured"] = structured(mine, out[label]["drafters"])
    return out


def structured(rows: list[dict[str, Any]], by: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Over the runs that had a schema: how many answers parse and validate, the share of tokens the
    forced-span drafter drafted (its ``drafted`` over the tokens generated), the masks' share of
    decoding time, and how the runs ended. None where no run had a schema."""
    mine = [r for r in rows if r.get("valid") is not None]
    if not mine:
        return None
    gen, decode = _total(mine, "generated"), _total(mine, "decode_s")
    forced = sum((r.get("drafters") or {}).get("forced", {}).get("drafted", 0) for r in mine)
    reasons: dict[str, int] = {}
    for r in mine:
        reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
    return {
        "runs": len(mine),
        "valid": sum(bool(r["valid"]) for r in mine),
        "validity": sum(bool(r["valid"]) for r in mine) / len(mine),
        "forced_share": forced / gen if gen and by and "forced" in by else None,
        "mask_share": sum(r["mask_s"] or 0.0 for r in mine) / decode if decode else None,
        "finish_reasons": reasons,
    }


RATIO_KEYS = ("tokens_per_s", "ppl", "cpu_s_per_token", "j_per_token", "block_efficiency")


def ratios(methods: dict) -> dict:
    """variant / baseline for each figure (the judge's PPL too where one scored the runs), against
    the variants labelled ar and sd when they ran."""

    def div(a, b):
        return a / b if a is not None and b else None

    def keys(base: dict) -> tuple[str, ...]:
        return RATIO_KEYS + (("judge_ppl",) if base.get("judge_ppl") is not None else ())

    return {
        f"vs_{base}": {
            m: {k: div(agg.get(k), methods[base][k]) for k in keys(methods[base])} for m, agg in methods.items()
        }
        for base in ("ar", "sd")
        if base in methods
    }


def time_split(agg: dict[str, Any]) -> dict[str, Optional[float]]:
    """Where a variant's decoding time went, in ms per generated token: the target's calls, the
    aux's drafting (its calls and beam selection) and the rest (sampling, verify rules, the
    loop, the controller: Python)."""
    gen = agg["generated"]
    if not gen:
        return {"target_ms": None, "aux_ms": None, "rest_ms": None}
    target, aux = agg["target_s"], agg["draft_s"]
    return {
        "target_ms": 1000 * target / gen,
        "aux_ms": 1000 * aux / gen,
        "rest_ms": 1000 * (agg["decode_s"] - target - aux) / gen,
    }


def projection(methods: dict[str, dict[str, Any]]) -> dict[str, dict[str, Optional[float]]]:
    """What each variant would reach where a verify of k rows costs what one row does (a big target
    on a GPU, memory-bound): every target call priced at plain decoding's own call (ar's target
    seconds per call in this run), the aux and the rest as measured here. A projection from the
    measured acceptance, not a measurement; empty without an ar variant."""
    ar = methods.get("ar")
    if not ar or not ar["target_calls"]:
        return {}
    one_row = ar["target_s"] / ar["target_calls"]
    out: dict[str, dict[str, Optional[float]]] = {}
    for label, agg in methods.items():
        seconds = agg["decode_s"] - agg["target_s"] + agg["target_calls"] * one_row
        out[label] = {"tokens_per_s": agg["generated"] / seconds if seconds > 0 else None}
    base = out["ar"]["tokens_per_s"]
    for row in out.values():
        row["x_ar"] = row["tokens_per_s"] / base if row["tokens_per_s"] and base else None
    return out


def _counts(values: Iterable[Optional[str]]) -> Optional[dict[str, int]]:
    """How many times each value came (None left out); None where none came."""
    return dict(Counter(v for v in values if v is not None)) or None


def drafters(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Per drafter over the runs (``Stats.drafters``): its counters summed (drafted, accepted,
    steps, and its own: the aux's ahead_*, vocab_resyncs and calls), histograms merged (the aux's
    shapes), a share weighted by the tokens each
    run generated (the aux's vocab_mapped_share across vocabularies), and its acceptance. None
    where nothing drafted (ar, beam)."""
    names = dict.fromkeys(name for r in rows for name in r.get("drafters", {}))
    out: dict[str, Any] = {}
    for name in names:
        runs = [(r["drafters"][name], r["generated"]) for r in rows if name in r.get("drafters", {})]
        agg: dict[str, Any] = {}
        for key in dict.fromkeys(k for counters, _ in runs for k in counters):
            seen = [(c[key], n) for c, n in runs if c.get(key) is not None]
            if seen and all(isinstance(v, dict) for v, _ in seen):  # a histogram (the aux's shapes: rows -> calls)
                merged: dict[int, int] = {}
                for v, _ in seen:
                    for k, c in v.items():
                        merged[int(k)] = merged.get(int(k), 0) + c
                agg[key] = dict(sorted(merged.items()))
            elif all(isinstance(v, int) for v, _ in seen):
                agg[key] = sum(v for v, _ in seen)
            else:
                agg[key] = sum(v * n for v, n in seen) / max(sum(n for _, n in seen), 1)
        agg["acceptance_rate"] = agg["accepted"] / agg["drafted"] if agg.get("drafted") else None
        out[name] = agg
    return out or None
