"""Writing a benchmark out: results.json, report.md, bench.png, quality.png (and gammas.png for
--gammas, sweep.png for --sweep)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import mtad_edge.store as store
from mtad_edge.bench.native import against_tg


def _fmt(v, spec=".2f", none="–"):
    return none if v is None else format(v, spec)


def write_json(out: Path, results: dict) -> Path:
    """results.json, written whole or not at all (a full disk leaves no partial file behind)."""
    path = out / "results.json"
    with store.atomic(path) as tmp:
        tmp.write_text(json.dumps(results, indent=2) + "\n")
    return path


def _amx_line(machine: dict) -> list[str]:
    """Whether AMX multiplied the pair's weights: it halves a quantized aux's cost on CPUs that
    have it (docs/backends.md#amx), so a run's speeds depend on it."""
    if not machine.get("amx"):
        return []
    models = {k: v for k, v in (machine.get("kernels") or {}).items() if v}
    on = {k: v["amx"] for k, v in models.items() if v.get("amx")}
    if on:
        kinds = " and ".join(f"{n} of the {k}'s" for k, n in on.items())
        return ["", f"This CPU has AMX: llama.cpp multiplied {kinds} matrix kinds with it."]
    if any(v.get("repacked") for v in models.values()):
        return [
            "",
            "This CPU has AMX, and this llama.cpp build's AMX kernels do not run on it: quantized "
            "weights ran on the repacked kernels (`scripts/amx-llama-cpp.sh` builds ones that run; "
            "docs/backends.md#amx).",
        ]
    return ["", "This CPU has AMX; none of the pair's matrices are of a type llama.cpp multiplies with it."]


def report_markdown(results: dict, chart: bool = False) -> str:
    """The report; ``chart``: a text bar chart of the speeds too (where no plot is drawn)."""
    methods, rat = results["methods"], results.get("ratios", {})
    cfg = results["config"]
    lines = [
        f"# mtad-edge bench: {results['pair']['name']}",
        "",
        verdict(results),
        "",
        f"{cfg['prompts']} prompts x {cfg['repeats']} repeats (seeds shared by every variant), "
        f"max {cfg['max_tokens']} tokens, "
        f"temperature {cfg['temperature']}, "
        f"top-k {cfg['top_k']}, top-p {cfg['top_p']}, gamma {cfg['gamma']}, beam width {cfg['beam_width']}, "
        f"threshold {cfg['accept_threshold']}, {cfg['threads']} threads"
        + (f" ({cfg['aux_threads']} for the aux)." if cfg.get("aux_threads") else ".")
        + _recommended_words(cfg.get("recommended")),
        *_amx_line(results.get("machine") or {}),
        "",
        "| variant | tok/s (min-max) | x ar | x sd | TTFT s | block eff. | acceptance | PPL | PPL x ar "
        "| CPU s/tok | J/tok | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, a in methods.items():
        va, vs = rat.get("vs_ar", {}).get(m, {}), rat.get("vs_sd", {}).get(m, {})
        lines.append(
            f"| {m} | {_fmt(a['tokens_per_s'], '.1f')} "
            f"({_fmt(a['tokens_per_s_min'], '.1f')}-{_fmt(a['tokens_per_s_max'], '.1f')}) "
            f"| {_fmt(va.get('tokens_per_s'))} | {_fmt(vs.get('tokens_per_s'))} | {_fmt(a['ttft_s'], '.3f')} "
            f"| {_fmt(a['block_efficiency'])} | {_fmt(a['acceptance_rate'], '.1%')} | {_fmt(a['ppl'], '.2f')} "
            f"| {_fmt(va.get('ppl'))} | {_fmt(a['cpu_s_per_token'], '.4f')} "
            f"| {_fmt(a['j_per_token'], '.3f', 'n/a (no GPU)')} "
            f"| {_fmt(a['peak_rss_mb'], '.0f')} |"
        )
    lines += ["", COLUMNS]
    if chart:
        lines += ["", "```text", *text_chart(methods, rat.get("vs_ar") or {}), "```"]
    lines += _time_table(methods)
    lines += _projection_table(results.get("projection") or {})
    lines += _costs_table(results.get("learned_costs") or {})
    lines += _quality_tables(results)
    lines += _controller_table(methods)
    lines += _drafting_table(methods, (results.get("llama_server") or {}).get("settings") or {})
    lines += _paired_table(results.get("paired") or [])
    lines += _vocab_table(methods)
    lines += _rpc_table(methods, results.get("rpc"))
    lines += _drafters_table(methods)
    lines += _structured_table(methods, results.get("llama_server"))
    lines += _aux_calls_table(methods)
    lines += _lookup_line(results.get("lookup_ceiling"))
    native = results.get("native")
    if native:
        lines += [
            "",
            "Native llama.cpp on the same files and threads:",
            "",
            "| tool | setting | tok/s | acceptance |",
            "|---|---|---|---|",
        ]
        for key, n in native.items():
            setting, speed, rate = key, _fmt(n["tokens_per_s"], ".1f"), _fmt(n.get("acceptance_rate"), ".1%")
            if "depth" in n:  # tg after the prompts' median length, as our tok/s, before and after each repeat
                runs = " / ".join(_fmt(x, ".1f") for x in n.get("tokens_per_s_runs") or [])
                bare = _fmt(n.get("tokens_per_s_depth_0"), ".1f")
                setting += f", after {n['depth']} cached tokens, before our repeats and after each: {runs}"
                setting += f" (no cache: {bare})"
            lines.append(f"| {n['tool']} | {setting} | {speed} | {rate} |")
        tg, ar = native.get("llama-bench tg target"), (results.get("methods") or {}).get("ar")
        ratio = (
            against_tg(ar.get("tokens_per_s_repeats") or [], tg.get("tokens_per_s_runs") or []) if tg and ar else None
        )
        if ratio is not None:
            beside = "median over repeats, each against the llama-bench runs on either side of it"
            lines += ["", f"ar runs {ratio:.3f}x llama-bench's tg ({beside})."]
    lines += _peer_table(results.get("llama_server"), methods)
    if results.get("sweep"):
        lines += [
            "",
            "MTAD sweep (one parameter at a time around the defaults):",
            "",
            "| threshold | gamma | beam width | tok/s | block eff. | acceptance | PPL | distinct-2 | rep-4 |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for s in results["sweep"]:
            lines.append(
                f"| {s['accept_threshold']} | {s['gamma']} | {s['beam_width']} | {_fmt(s['tokens_per_s'], '.1f')} "
                f"| {_fmt(s['block_efficiency'])} | {_fmt(s['acceptance_rate'], '.1%')} | {_fmt(s['ppl'])} "
                f"| {_fmt(s.get('distinct_2'), '.3f')} | {_fmt(s.get('rep_4'), '.3f')} |"
            )
    lines.append("")
    return "\n".join(lines)


# The main table's columns, said under it (each later table says its own terms where it starts).
COLUMNS = (
    "**tok/s**: generated tokens per second of decoding (the prompt's prefill left out), median over repeats. "
    "**x ar**, **x sd**: that speed over plain decoding's (ar) and speculative sampling's (sd). "
    "**TTFT**: seconds to the first token. **block eff.** (block efficiency): tokens generated per call of the "
    "target model (1 for ar; what drafting gains before its costs). **acceptance**: the share of drafted "
    "tokens the target kept. **PPL** (perplexity): how likely the target finds the text, exp(-mean log "
    "p(token | text before it)) under its raw distribution, the same scoring for every variant; lower is "
    "likelier, not always better (a lower temperature lowers it too). **CPU s/tok**: CPU time per token; "
    "**J/tok**: GPU energy per token; **peak RSS**: the process's memory."
)


def _recommended_words(recommended: Optional[dict]) -> str:
    """ " Sampling not given took the model's: temperature 0.7 (the pair's manifest)."""
    if not recommended:
        return ""
    said = ", ".join(f"{name} {value:g} ({source})" for name, (value, source) in recommended.items())
    return f" Options not given took the model's recommended values: {said}."


def _ratio(vs_ar: dict, label: str) -> Optional[float]:
    return (vs_ar.get(label) or {}).get("tokens_per_s")


def verdict(results: dict) -> str:
    """The run in one plain sentence: each variant's speed against plain decoding's (ar), fastest
    first ("mtad is 1.42x as fast as plain decoding here; sd 1.10x")."""
    methods, vs_ar = results["methods"], (results.get("ratios") or {}).get("vs_ar") or {}
    others = [m for m in methods if m != "ar" and _ratio(vs_ar, m) is not None]
    if "ar" not in methods:
        return "Verdict: no plain decoding (ar) ran, so there is nothing to compare the speeds with."
    if not others:
        return "Verdict: only plain decoding (ar) ran, so there is nothing to compare it with."
    ranked = sorted(others, key=lambda m: -(_ratio(vs_ar, m) or 0.0))
    best, rest = ranked[0], ranked[1:]
    x = _ratio(vs_ar, best) or 0.0
    tail = ("; " + ", ".join(f"{m} {_ratio(vs_ar, m):.2f}x{_chose(methods[m])}" for m in rest)) if rest else ""
    best_said = f"{best}{_chose(methods[best])}"
    if x >= 1 + SAME_SPEED:
        head = f"{best_said} is {x:.2f}x as fast as plain decoding (ar) here"
    elif x > 1 - SAME_SPEED:
        head = f"{best_said} runs about as fast as plain decoding (ar) here ({x:.2f}x)"
    else:
        head = (
            f"nothing beat plain decoding (ar) here: the fastest, {best_said}, ran {x:.2f}x its speed "
            "(drafting pays where the target costs far more than the aux: docs/standins.md)"
        )
    ppl = (vs_ar.get(best) or {}).get("ppl")
    quality = f" {best}'s text: {ppl:.2f}x ar's perplexity." if ppl is not None and best != "ar" else ""
    return f"Verdict: {head}{tail}.{quality}"


def _chose(agg: dict) -> str:
    """ " (as mtad)", " (as sd 4, mtad 2)": what method auto decoded with, where it ran."""
    chose = agg.get("chose")
    if not chose:
        return ""
    if len(chose) == 1:
        return f" (as {next(iter(chose))})"
    return " (as " + ", ".join(f"{m} {n}" for m, n in sorted(chose.items(), key=lambda kv: -kv[1])) + ")"


# Within this share of ar's speed a variant is called "about as fast": runs move that much.
SAME_SPEED = 0.05
_BAR_WIDTH = 30
_EIGHTHS = " ▏▎▍▌▋▊▉"


def text_chart(methods: dict, vs_ar: dict) -> list[str]:
    """Each variant's tok/s as a bar of block characters, with x ar: the plot without matplotlib."""
    speeds = {m: a.get("tokens_per_s") for m, a in methods.items()}
    top = max((v for v in speeds.values() if v), default=0.0)
    width = max((len(m) for m in speeds), default=0)
    lines = []
    for m, v in speeds.items():
        eighths = round((v or 0.0) / top * _BAR_WIDTH * 8) if top else 0
        bar = "█" * (eighths // 8) + (_EIGHTHS[eighths % 8] if eighths % 8 else "")
        x = _ratio(vs_ar, m)
        lines.append(
            f"{m:<{width}}  {bar:<{_BAR_WIDTH + 1}} {_fmt(v, '.1f')} tok/s"
            + (f"  {x:.2f}x ar" if x is not None else "")
        )
    return lines


def summary_text(results: dict) -> str:
    """What `mtad-edge bench` prints at the end: the main figures per variant, their bars and the verdict."""
    methods, vs_ar = results["methods"], (results.get("ratios") or {}).get("vs_ar") or {}
    head = ("variant", "tok/s", "x ar", "acceptance", "PPL")
    rows = [
        (
            m,
            _fmt(a.get("tokens_per_s"), ".1f"),
            _fmt(_ratio(vs_ar, m)),
            _fmt(a.get("acceptance_rate"), ".1%"),
            _fmt(a.get("ppl"), ".2f"),
        )
        for m, a in methods.items()
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    table = [line(head), *(line(r) for r in rows)]
    return "\n".join([*table, "", *text_chart(methods, vs_ar), "", verdict(results)]) + "\n"


def _peer_table(peer: Optional[dict], methods: dict) -> list[str]:
    """Every variant and llama-server setting as a share of llama-server's plain decoding."""
    if not peer:
        return []
    x, found = peer.get("x_llama_server_ar") or {}, peer.get("settings") or {}
    lines = [
        "",
        f"llama-server ({peer['binary']}) on the same files, prompt tokens, sampling (temperature "
        f"{peer['temperature']}, min-p 0) and seeds; one server at a time, each started for its prompt-run:",
        "",
        "| row | tok/s (min-max) | x llama-server ar | acceptance | PPL |",
        "|---|---|---|---|---|",
    ]
    for label, a in {**methods, **found}.items():
        lines.append(
            f"| {label} | {_fmt(a['tokens_per_s'], '.1f')} "
            f"({_fmt(a['tokens_per_s_min'], '.1f')}-{_fmt(a['tokens_per_s_max'], '.1f')}) "
            f"| {_fmt(x.get(label))} | {_fmt(a['acceptance_rate'], '.1%')} | {_fmt(a['ppl'], '.2f')} |"
        )
    drafts = [f"{label}: {a['accepted']} of {a['drafted']}" for label, a in found.items() if a["drafted"]]
    if drafts:
        lines += ["", "llama-server's drafted tokens kept: " + "; ".join(drafts) + "."]
    greedy = {k: a for k, a in found.items() if "same_tokens_as_ar" in a}  # at temperature 0
    same = [f"{k} {a['same_tokens_as_ar']} of {a['compared_with_ar']}" for k, a in greedy.items()]
    if same:
        lines += ["", "Greedy: runs whose tokens equal our ar's: " + ", ".join(same) + "."]
    differ = sum(a["prompt_tokens_differ"] for a in found.values())
    if differ:
        lines += ["", f"In {differ} runs llama-server counted other prompt tokens than we sent: those do not compare."]
    for note in (peer.get("no_draft"), peer.get("error") and f"the column stopped: {peer['error']}"):
        if note:
            lines += ["", f"llama-server: {note}."]
    return lines


def _pm(agg: dict, key: str, spec: str = ".3f") -> str:
    se = (agg.get("se") or {}).get(key)
    return _fmt(agg.get(key), spec) + ("" if se is None else f" ± {format(se, spec)}")


def _quality_tables(results: dict) -> list[str]:
    """Diversity and repetition per variant (the judge's PPL beside the target's where a judge
    scored the runs); then each variant against plain decoding's curve at equal target PPL and at
    equal judge PPL; then the smallest gap this run tells from noise."""
    methods = results["methods"]
    if not any(a.get("distinct_2") is not None for a in methods.values()):
        return []
    judged = any(a.get("judge_ppl") is not None for a in methods.values())
    judge = (results.get("config") or {}).get("judge") or {}
    lines = [
        "",
        "Quality (PPL under the target"
        + (
            f"; judge PPL: the same text re-tokenised and scored by {judge.get('name') or 'the judge'}, a model "
            "that took no part"
            if judged
            else ""
        )
        + "). **distinct-n**: the share of an output's token n-grams that differ from each other (higher: more "
        "varied); **rep-4**: the share of its 4-grams it already wrote earlier (lower: repeats less); both "
        "pooled over runs, ± one bootstrap standard error over runs:",
        "",
        "| variant | T | PPL" + (" | judge PPL" if judged else "") + " | distinct-1 | distinct-2 | distinct-3 | rep-4 "
        "| mean length |",
        "|---|---|---|" + ("---|" if judged else "") + "---|---|---|---|---|",
    ]
    for m, a in methods.items():
        lines.append(
            f"| {m} | {_fmt(a.get('temperature'), 'g')} | {_pm(a, 'ppl', '.2f')} "
            + (f"| {_pm(a, 'judge_ppl', '.2f')} " if judged else "")
            + f"| {_fmt(a.get('distinct_1'), '.3f')} "
            f"| {_pm(a, 'distinct_2')} | {_fmt(a.get('distinct_3'), '.3f')} | {_pm(a, 'rep_4')} "
            f"| {_fmt(a.get('mean_length'), '.1f')} |"
        )
    truncated = sum(a.get("judge_truncated") or 0 for a in methods.values())
    if truncated:
        lines += ["", f"The judge's context held {truncated} run(s) only in part: scored as far as it held them."]
    front = results.get("frontier") or {}
    lines += _frontier_table(methods, front, "ppl", "PPL")
    lines += _frontier_table(methods, front.get("judge") or {}, "judge_ppl", "judge PPL")
    lines += _resolution_line(results.get("resolution") or {})
    return lines


def _frontier_table(methods: dict, front: dict, by: str, name: str) -> list[str]:
    """Each variant against plain decoding's curve at the same PPL (``by``: the target's or the judge's)."""
    if not front.get("variants"):
        return []
    curve = ", ".join(f"T={p['temperature']:g}: {p[by]:.2f}" for p in front["curve"])
    lines = [
        "",
        f"Against plain decoding at the same {name} (the ar curve, {name} by temperature: {curve}). "
        "Beyond: more diverse (distinct-2 higher) *and* repeating less (rep-4 lower) than plain decoding "
        f"at that {name}; behind: both worse. A gap marked * exceeds two combined standard errors.",
        "",
        f"| variant | {name} | ar T at same {name} | distinct-2 (ar there) | rep-4 (ar there) | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for m, p in front["variants"].items():
        a = methods[m]
        t = p["matched_temperature"]
        t_txt = {"at": f"{t:.2f}", "below": f"< {t:g} (lowest {name})", "above": f"> {t:g} (highest {name})"}
        cells = [
            f"{a[k]:.3f} ({p['curve_' + k]:.3f}, {p[k + '_gap']:+.3f}{'*' if p['clear'].get(k) else ''})"
            for k in ("distinct_2", "rep_4")
        ]
        ppl, verdict = _fmt(a[by], ".2f"), p["verdict"]
        lines.append(f"| {m} | {ppl} | {t_txt[p['ppl_range']]} | {cells[0]} | {cells[1]} | {verdict} |")
    return lines


def _resolution_line(res: dict) -> list[str]:
    """The smallest gap between two variants this run tells from noise (quality.resolution)."""
    if res.get("distinct_2") is None:
        return []
    parts = [f"{res['distinct_2']:.3f} in distinct-2"]
    if res.get("rep_4") is not None:
        parts.append(f"{res['rep_4']:.3f} in rep-4")
    for key, name in (("ppl", "PPL"), ("judge_ppl", "judge PPL")):
        if res.get(key) is not None:
            parts.append(f"{res[key]:.2f} in {name}")
    return [
        "",
        f"Gaps below {', '.join(parts)} are within noise here: two combined standard errors of two variants "
        f"with the median variant's error ({res['runs']} runs each).",
    ]


def _time_table(methods: dict) -> list[str]:
    """Where each variant's decoding time went, per generated token."""
    rows = [(m, a.get("time_ms_per_token")) for m, a in methods.items() if a.get("time_ms_per_token")]
    if not rows:
        return []
    lines = [
        "",
        "Where the time goes (ms per generated token): the target's calls, the aux's drafting, the rest "
        "(sampling, verify rules, the loop, the controller):",
        "",
        "| variant | target | aux | rest | total |",
        "|---|---|---|---|---|",
    ]
    for m, t in rows:
        total = sum(v for v in t.values() if v is not None) if t["target_ms"] is not None else None
        lines.append(f"| {m} | {_fmt(t['target_ms'])} | {_fmt(t['aux_ms'])} | {_fmt(t['rest_ms'])} | {_fmt(total)} |")
    return lines


def _projection_table(proj: dict) -> list[str]:
    """The memory-bound projection (bench/run.py: projection), labelled as what it is."""
    if not proj:
        return []
    lines = [
        "",
        "Projection, not a measurement: where a verify of k rows costs one row (a big target on a GPU), "
        "every target call priced at ar's call in this run, the aux and the rest as measured:",
        "",
        "| variant | projected tok/s | x ar |",
        "|---|---|---|",
    ]
    lines += [f"| {m} | {_fmt(p['tokens_per_s'], '.1f')} | {_fmt(p['x_ar'])} |" for m, p in proj.items()]
    return lines


def _costs_table(costs: dict) -> list[str]:
    """What a call cost at the end of the run, by rows (target, MMTAD's tree) or beams (aux)."""
    tables = [(name, costs.get(key) or {}) for name, key in COST_TABLES]
    if not any(t for _, t in tables):
        return []
    lines = ["", "Learned call costs (ms, by rows evaluated; the aux by beams):", ""]
    for name, table in tables:
        if table:
            lines.append(f"- {name}: " + ", ".join(f"{r}: {ms:.1f}" for r, ms in table.items()))
    return lines


COST_TABLES = (("target", "target_ms"), ("MMTAD tree verify", "tree_target_ms"), ("aux", "aux_ms"))


def _controller_table(methods: dict) -> list[str]:
    """The adaptive controller's choices (gamma/width histograms, predicted vs realised speed)."""
    rows = [(m, a) for m, a in methods.items() if any(k != "0" for k in a.get("gamma_hist") or {})]  # drafting
    if not any(a.get("predicted_tokens_per_s") is not None for _, a in rows):  # nothing adaptive ran
        return []
    lines = [
        "",
        "Drafting choices: target calls per draft length gamma (0: a plain step) and per beam width (MMTAD: "
        "how many verified the best beam alone). **predicted tok/s**: the speed the controller expected from "
        "the costs and acceptance it learned; **realised**: the speed measured; **predicted / realised** near "
        "1 means its picture was right, above 1 that it expected more than it got. Controller time: its own "
        "share of decoding:",
        "",
        "| variant | gamma histogram | width histogram | predicted tok/s | realised tok/s | predicted / realised "
        "| controller time |",
        "|---|---|---|---|---|---|---|",
    ]

    def alone(a: dict) -> str:
        return f" (best beam alone: {a['alone_steps']})" if a.get("alone_steps") else ""

    for m, a in rows:
        hist = lambda h: ", ".join(f"{k}: {n}" for k, n in (h or {}).items()) or "–"  # noqa: E731
        lines.append(
            f"| {m} | {hist(a.get('gamma_hist'))} | {hist(a.get('width_hist'))}{alone(a)} "
            f"| {_fmt(a.get('predicted_tokens_per_s'), '.1f')} | {_fmt(a['tokens_per_s'], '.1f')} "
            f"| {_fmt(a.get('predicted_over_realised'), '.2f')} "
            f"| {_fmt(_share(a.get('controller_s'), a.get('decode_s')), '.2%')} of decoding |"
        )
    return lines


def _drafting_table(methods: dict, peer: dict) -> list[str]:
    """How much each row that drafted drafted, repeat by repeat: where the controller's choice to
    draft flips between repeats (a drifting machine), its spread shows it."""
    rows = {label: a for label, a in {**methods, **peer}.items() if any(a.get("drafted_repeats") or ())}
    if not rows:
        return []
    lines = [
        "",
        "Drafting share (drafted tokens / generated, and the share of steps that drafted, over the run and"
        " per repeat; the drafted tokens' spread: (max - min) / median over repeats):",
        "",
        "| row | drafted / generated (repeats) | steps that drafted (repeats) | drafted tokens per repeat | spread |",
        "|---|---|---|---|---|",
    ]

    def cell(a: dict, key: str) -> str:
        each = [x for x in a.get(f"{key}_repeats") or () if x is not None]
        span = f" ({min(each):.0%}-{max(each):.0%})" if len(each) > 1 else ""
        return _fmt(a.get(key), ".0%") + span

    for label, a in rows.items():
        lines.append(
            f"| {label} | {cell(a, 'drafted_share')} | {cell(a, 'drafting_steps_share')} "
            f"| {', '.join(str(n) for n in a['drafted_repeats'])} | {_fmt(a.get('drafted_spread'), '.0%')} |"
        )
    return lines


def _paired_table(rows: list) -> list[str]:
    """Each 'g=auto' variant against the fixed settings of its method, paired (bench/paired.py)."""
    if not rows:
        return []

    def ci(x: Optional[dict]) -> str:
        if x is None:
            return "–"
        if x["low"] is None:
            return f"{x['ratio']:.3f}"
        return f"{x['ratio']:.3f} [{x['low']:.3f}, {x['high']:.3f}]"

    lines = [
        "",
        "Adaptive against fixed, paired on the same prompts and seeds (90 % bootstrap interval over prompt-runs):",
        "",
        "| variant | against | prompt-runs | tok/s ratio | median of per-run tok/s ratios | PPL ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        median = _fmt(r.get("speed_median"), ".3f")
        lines.append(
            f"| {r['variant']} | {r['against']} | {r['runs']} | {ci(r['speed'])} | {median} | {ci(r['ppl'])} |"
        )
    return lines


def _share(part: Optional[float], whole: Optional[float]) -> Optional[float]:
    return part / whole if part is not None and whole else None


def _drafters_table(methods: dict) -> list[str]:
    """Where several drafters took part: what each drafted and what the target kept of it."""
    rows = [(m, a["drafters"]) for m, a in methods.items() if a.get("drafters")]
    if not any(sum(d["drafted"] > 0 for d in ds.values()) > 1 or "aux" not in ds for _, ds in rows):
        return []
    lines = ["", "Drafters (who drafted, and what the target kept of it):", ""]
    lines += ["| variant | drafter | steps | drafted | kept | acceptance |", "|---|---|---|---|---|---|"]
    for m, ds in rows:
        for name, d in ds.items():
            lines.append(
                f"| {m} | {name} | {d.get('steps', 0)} | {d['drafted']} | {d['accepted']} "
                f"| {_fmt(d['acceptance_rate'], '.1%')} |"
            )
    return lines


def _structured_table(methods: dict, peer: Optional[dict]) -> list[str]:
    """With schemas (--prompts structured): the answers that parse and validate, per row, with
    ours' share of tokens the grammar forced and drafted free, the masks' share of decoding time,
    and how the runs ended."""
    rows = {m: a["structured"] for m, a in methods.items() if a.get("structured")}
    theirs = {k: a["structured"] for k, a in ((peer or {}).get("settings") or {}).items() if a.get("structured")}
    if not rows and not theirs:
        return []
    lines = ["", "Structured answers (each prompt's JSON schema; valid: parses and validates):", ""]
    lines += ["| row | valid | forced share | mask share | finish |", "|---|---|---|---|---|"]
    for label, st in {**rows, **theirs}.items():
        ends = ", ".join(f"{k} {n}" for k, n in sorted((st.get("finish_reasons") or {}).items()))
        lines.append(
            f"| {label} | {st['valid']} of {st['runs']} ({st['validity']:.0%}) | {_fmt(st.get('forced_share'), '.1%')} "
            f"| {_fmt(st.get('mask_share'), '.1%')} | {ends or '–'} |"
        )
    return lines


def _aux_calls_table(methods: dict) -> list[str]:
    """The aux's calls per drafting step and their shapes (rows -> calls): where one shape held,
    llama.cpp's CUDA graphs could too (each change of shape is a warm-up of two ungraphed calls)."""
    aux = {m: a["drafters"]["aux"] for m, a in methods.items() if (a.get("drafters") or {}).get("aux", {}).get("calls")}
    if not aux:
        return []
    lines = ["", "Aux calls (all of them, its prefills too; a change: a call of other rows than the one before):", ""]
    lines += ["| variant | calls per drafting step | rows: calls | changes of shape per step |", "|---|---|---|---|"]
    for m, d in aux.items():
        steps = max(d.get("steps", 0), 1)
        shapes = ", ".join(f"{k}: {v}" for k, v in (d.get("shapes") or {}).items())
        lines.append(f"| {m} | {d['calls'] / steps:.2f} | {shapes} | {d.get('shape_changes', 0) / steps:.2f} |")
    return lines


def _lookup_line(ceil: Optional[dict]) -> list[str]:
    """Prompt lookup's ceiling on ar's texts (bench/lookup.py), said as a bound, not a measurement."""
    if not ceil:
        return []
    return [
        "",
        f"Prompt lookup's ceiling on ar's texts (drafts up to {ceil['gamma']}, no row rejected): at most "
        f"{ceil['block_efficiency']:.2f} tokens a step, so at most {ceil['block_efficiency']:.2f}x ar even where a "
        f"verify's rows cost what one does; at the learned costs, {ceil['x_ar']:.2f}x ar at most. A lookup draft "
        f"would keep a token at {ceil['keepable_share']:.0%} of positions.",
    ]


def _rpc_table(methods: dict, rpc: Optional[dict]) -> list[str]:
    """The target's traffic with its rpc servers per variant (prefills included)."""
    rows = [(m, a, a["rpc"]) for m, a in methods.items() if a.get("rpc")]
    if not rows:
        return []
    servers = ", ".join((rpc or {}).get("servers") or [])
    delay = (rpc or {}).get("relay_delay_ms")
    got = (rpc or {}).get("relay_achieved_ms")
    relay = f", through a relay adding {delay:g} ms each way (measured {_fmt(got, '.3f')})" if delay is not None else ""
    lines = ["", f"RPC traffic of the target (rpc servers {servers}{relay}), per generated token:", ""]
    lines += ["| variant | target calls | RPC calls | round trips | KB sent | KB received | most frequent |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for m, a, t in rows:
        n = max(a["generated"], 1)
        top = ", ".join(f"{k} {v['calls'] / n:.1f}" for k, v in list(t["by_command"].items())[:3])
        lines.append(
            f"| {m} | {a['target_calls'] / n:.2f} | {t['calls'] / n:.1f} | {t['round_trips'] / n:.1f} "
            f"| {t['sent'] / n / 1000:.1f} | {t['received'] / n / 1000:.1f} | {top} |"
        )
    return lines


def _vocab_table(methods: dict) -> list[str]:
    """Drafting across vocabularies: the share of generated tokens the aux could draft, resyncs."""
    aux = {m: a["drafters"]["aux"] for m, a in methods.items() if "aux" in (a.get("drafters") or {})}
    rows = [(m, a) for m, a in aux.items() if a.get("vocab_mapped_share") is not None]
    if not rows:
        return []
    lines = ["", "Across vocabularies (aux with another tokenizer):", ""]
    lines += ["| variant | generated tokens the aux can draft | re-tokenisations |", "|---|---|---|"]
    lines += [f"| {m} | {_fmt(a['vocab_mapped_share'], '.1%')} | {a['vocab_resyncs']} |" for m, a in rows]
    return lines


def _save(plt, fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def can_plot() -> bool:
    """Whether matplotlib is there to draw the plots (else the report carries a text chart)."""
    return _pyplot() is not None


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


def plot_bench(out: Path, results: dict) -> Optional[Path]:
    """tokens/s and block efficiency per method, acceptance-length histogram, PPL per method."""
    plt = _pyplot()
    if plt is None:
        return None
    methods = results["methods"]
    names = list(methods)
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    speed = [methods[m]["tokens_per_s"] for m in names]
    err = [
        [s - methods[m]["tokens_per_s_min"] for m, s in zip(names, speed)],
        [methods[m]["tokens_per_s_max"] - s for m, s in zip(names, speed)],
    ]
    ax[0, 0].bar(names, speed, yerr=err, color="tab:blue", capsize=4)
    peers = {f"native {key}": n for key, n in (results.get("native") or {}).items()}
    peers.update(((results.get("llama_server") or {}).get("settings") or {}).items())
    for key, n in peers.items():
        ax[0, 0].axhline(n["tokens_per_s"], ls="--", lw=1, color="gray")
        ax[0, 0].annotate(key, (len(names) - 0.5, n["tokens_per_s"]), fontsize=7, ha="right", va="bottom")
    ax[0, 0].set(title="tokens / s (decode)", ylabel="tok/s")
    ax[0, 1].bar(names, [methods[m]["block_efficiency"] or 0 for m in names], color="tab:green")
    ax[0, 1].set(title="block efficiency (tokens / target call)")
    width = 0.8 / max(1, len(names))
    for i, m in enumerate(names):
        hist = methods[m]["accept_length_hist"]
        if hist:
            ks = [int(k) for k in hist]
            total = sum(hist.values())
            shift = (i - (len(names) - 1) / 2) * width
            ax[1, 0].bar([k + shift for k in ks], [v / total for v in hist.values()], width=width, label=m)
    ax[1, 0].set(title="accepted draft tokens per target call", xlabel="k", ylabel="share of calls")
    if any(methods[m]["accept_length_hist"] for m in names):
        ax[1, 0].legend()
    else:
        ax[1, 0].text(0.5, 0.5, "no drafting method ran", ha="center", transform=ax[1, 0].transAxes)
    ax[1, 1].bar(names, [methods[m]["ppl"] or 0 for m in names], color="tab:orange")
    ax[1, 1].set(title="PPL of the output under the target", ylabel="perplexity")
    if len(names) > 4:
        for a in (ax[0, 0], ax[0, 1], ax[1, 1]):
            a.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.suptitle(f"mtad-edge bench: {results['pair']['name']}")
    fig.tight_layout()
    return _save(plt, fig, out / "bench.png")


def plot_sweep(out: Path, sweep: list[dict]) -> Optional[Path]:
    """Speed vs PPL for each MTAD setting, with the Pareto frontier (faster and lower PPL)."""
    plt = _pyplot()
    if plt is None or not sweep:
        return None
    fig, ax = plt.subplots(figsize=(8, 6))
    pts = [(s["tokens_per_s"], s["ppl"], s) for s in sweep if s["ppl"] is not None]
    ax.scatter([p[0] for p in pts], [p[1] for p in pts])
    for x, y, s in pts:
        ax.annotate(f"t{s['accept_threshold']} g{s['gamma']} w{s['beam_width']}", (x, y), fontsize=7)
    frontier, best = [], float("inf")
    for x, y, _ in sorted(pts, key=lambda p: -p[0]):
        if y < best:
            frontier.append((x, y))
            best = y
    ax.plot([p[0] for p in frontier], [p[1] for p in frontier], "r--", label="frontier")
    ax.set(xlabel="tokens / s", ylabel="PPL (lower is better)", title="MTAD: speed vs PPL")
    ax.legend()
    return _save(plt, fig, out / "sweep.png")


def plot_quality(out: Path, results: dict) -> Optional[Path]:
    """PPL against distinct-2 and against rep-4: plain decoding's temperature curve as a line,
    every other variant as a point (error bars: one standard error); a second row by the judge's
    PPL where a judge scored the runs."""
    plt = _pyplot()
    methods = results["methods"]
    if plt is None or not any(a.get("distinct_2") is not None for a in methods.values()):
        return None
    front = results.get("frontier") or {}
    rows = [("ppl", front.get("curve") or [], "PPL under the target")]
    if any(a.get("judge_ppl") is not None for a in methods.values()):
        judge = ((results.get("config") or {}).get("judge") or {}).get("name") or "the judge"
        rows.append(("judge_ppl", (front.get("judge") or {}).get("curve") or [], f"PPL under {judge}"))
    fig, grid = plt.subplots(len(rows), 2, figsize=(13, 5.5 * len(rows)), squeeze=False)
    for axes, (by, curve, xlabel) in zip(grid, rows):
        for ax, key, name, better in (
            (axes[0], "distinct_2", "distinct-2", "up: more diverse"),
            (axes[1], "rep_4", "rep-4", "down: repeats less"),
        ):
            if curve:
                ax.plot([p[by] for p in curve], [p[key] for p in curve], "o-", color="gray", label="ar (temperature)")
                for p in curve:
                    ax.annotate(
                        f"T={p['temperature']:g}",
                        (p[by], p[key]),
                        fontsize=7,
                        color="gray",
                        xytext=(3, 3),
                        textcoords="offset points",
                    )
            for label, a in methods.items():
                if a.get("method") == "ar" or a.get(key) is None or a.get(by) is None:
                    continue
                se = a.get("se") or {}
                ax.errorbar(a[by], a[key], xerr=se.get(by), yerr=se.get(key), fmt="o", capsize=3, label=label)
                ax.annotate(label, (a[by], a[key]), fontsize=7, xytext=(3, -9), textcoords="offset points")
            ax.set(xlabel=f"{xlabel} (lower: more likely text)", ylabel=name, title=f"{xlabel} vs {name} ({better})")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(f"mtad-edge bench: quality against plain decoding, {results['pair']['name']}")
    fig.tight_layout()
    return _save(plt, fig, out / "quality.png")


def plot_gammas(out: Path, results: dict) -> Optional[Path]:
    """tok/s and PPL against a fixed gamma per method, 'auto' as a dashed line (--gammas)."""
    plt = _pyplot()
    methods = results["methods"]
    by_method: dict[str, list[tuple[object, dict]]] = {}
    for a in methods.values():
        g = a.get("options", {}).get("gamma")
        if g is not None and set(a["options"]) == {"gamma"}:
            by_method.setdefault(a["method"], []).append((g, a))
    if plt is None or not by_method:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for i, (m, pts) in enumerate(by_method.items()):
        color = f"C{i}"
        fixed = sorted((g, a) for g, a in pts if isinstance(g, int))
        for ax, key in ((axes[0], "tokens_per_s"), (axes[1], "ppl")):
            ax.plot([g for g, _ in fixed], [a[key] for _, a in fixed], "o-", color=color, label=m)
            for g, a in pts:
                if not isinstance(g, int) and a.get(key) is not None:
                    ax.axhline(a[key], ls="--", color=color, label=f"{m} g={g}")
    for ax, title in ((axes[0], "tokens / s (decode)"), (axes[1], "PPL under the target")):
        ax.set(xlabel="gamma", title=title)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"mtad-edge bench: fixed gamma vs auto, {results['pair']['name']}")
    fig.tight_layout()
    return _save(plt, fig, out / "gammas.png")


def run_problem(run: Any) -> Optional[str]:
    """What ``size_points`` cannot read in an earlier run's results.json (a file of any origin), or None."""

    def table(value: Any) -> bool:  # {name: {field: number or null}}
        return isinstance(value, dict) and all(
            isinstance(v, dict) and all(x is None or _number(x) for x in v.values()) for v in value.values()
        )

    pair = run.get("pair") if isinstance(run, dict) else None
    if not isinstance(pair, dict) or not isinstance(pair.get("name"), str):
        return "no pair name"
    if not (pair.get("target_parameters") is None or _number(pair["target_parameters"])):
        return "pair.target_parameters is not a number"
    if not isinstance(run.get("ratios") or {}, dict) or not table((run.get("ratios") or {}).get("vs_ar") or {}):
        return "ratios.vs_ar is not a table of numbers"
    if not table(run.get("projection") or {}):
        return "projection is not a table of numbers"
    return None


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def size_points(runs: list[dict]) -> list[dict]:
    """Per earlier run with a sized target: its parameters, and each variant's tok/s over ar's,
    measured and projected (one run's ratios: both sides measured on the same machine then)."""
    points = []
    for r in runs:
        params = r["pair"].get("target_parameters")
        vs_ar = (r.get("ratios") or {}).get("vs_ar") or {}
        if not params or not vs_ar:
            continue
        proj = r.get("projection") or {}
        points.append(
            {
                "name": r["pair"]["name"],
                "parameters": params,
                "standin": r["pair"].get("standin"),
                "x_ar": {m: v.get("tokens_per_s") for m, v in vs_ar.items()},
                "projected_x_ar": {m: p.get("x_ar") for m, p in proj.items()},
            }
        )
    return sorted(points, key=lambda p: p["parameters"])


def size_curve_markdown(runs: list[dict]) -> str:
    points = size_points(runs)
    labels = list(dict.fromkeys(m for p in points for m in p["x_ar"]))
    lines = [
        "# Speed-up over ar by target size",
        "",
        "Each row is one bench run (its own ar as the baseline); stand-ins are marked: the small model's "
        "text at a big model's cost. In brackets: the memory-bound projection (a verify of k rows costs one "
        "row), not a measurement.",
        "",
        "| pair | target parameters | " + " | ".join(labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for p in points:
        name = p["name"] + (" (stand-in)" if p["standin"] else "")
        cells = [f"{_fmt(p['x_ar'].get(m))} [{_fmt(p['projected_x_ar'].get(m))}]" for m in labels]
        lines.append(f"| {name} | {p['parameters'] / 1e9:.2f} B | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_sizes(out: Path, runs: list[dict]) -> Optional[Path]:
    """Each variant's tok/s over ar against the target's parameters (log scale), projections dashed."""
    plt = _pyplot()
    points = size_points(runs)
    if plt is None or not points:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = [m for m in dict.fromkeys(m for p in points for m in p["x_ar"]) if m != "ar"]
    xs = [p["parameters"] for p in points]
    for i, m in enumerate(labels):
        ax.plot(xs, [p["x_ar"].get(m) for p in points], "o-", color=f"C{i}", label=m)
        proj = [p["projected_x_ar"].get(m) for p in points]
        if any(v is not None for v in proj):
            ax.plot(xs, proj, "--", color=f"C{i}", alpha=0.6, label=f"{m} (projected: flat verify)")
    ax.axhline(1.0, color="gray", lw=1)
    ax.set(xscale="log", xlabel="target parameters", ylabel="tok/s over ar", title="Speed-up by target size")
    ax.minorticks_off()  # the log axis's minor labels (3x10^8, 4x10^8, ...) overprint each other
    ax.set_xticks(xs, [f"{x / 1e9:.2g}B" for x in xs])  # the sizes measured
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(plt, fig, out / "sizes.png")
