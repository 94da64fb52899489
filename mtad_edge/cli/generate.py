"""`mtad-edge generate PROMPT`: one answer, streamed to stdout or as one JSON object.

PROMPT is a user's message in the model's chat template where the model has one (as llama-cli
and `ollama run` do), else plain text to continue; --raw continues it as plain text always."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import click

from mtad_edge.cli.options import (
    ModelChoice,
    decode_config,
    decode_options,
    errors_as_click,
    given,
    model_options,
    write_out,
)
from mtad_edge.engine import CANCELLED, check_text
from mtad_edge.runtime.errors import MtadEdgeError, json_problem
from mtad_edge.runtime.text.constraint import Grammar
from mtad_edge.signals import interrupts
from mtad_edge.store import os_error


def read_constraint(json_schema: Optional[str], grammar: Optional[str], regex: Optional[str]) -> Optional[Grammar]:
    """The answer's grammar from --json-schema (a file, or the schema's text), --grammar (a file:
    Lark where it ends .lark, else GBNF, or Lark where its text says so) or --regex; one at most.
    Read before the model loads: a bad one is a one-line error at once."""
    given = [f for f, v in (("--json-schema", json_schema), ("--grammar", grammar), ("--regex", regex)) if v]
    if len(given) > 1:
        raise click.UsageError(f"give one of {' and '.join(given)}")
    if regex:
        return Grammar.regex(regex)
    if grammar:
        text = _read(Path(grammar), "--grammar")
        return Grammar.lark(text) if grammar.endswith(".lark") else Grammar.gbnf(text)
    if json_schema:
        inline = json_schema.lstrip().startswith("{")
        text = json_schema if inline else _read(Path(json_schema), "--json-schema")
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as e:
            where = "the schema" if inline else json_schema
            raise MtadEdgeError(f"--json-schema: {where} is not JSON ({json_problem(e)})") from None
        if not isinstance(schema, dict):
            raise MtadEdgeError("--json-schema: a JSON schema is an object ({...})")
        return Grammar.json_schema(text, strict=False)
    return None


def _read(path: Path, flag: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise MtadEdgeError(f"{flag}: cannot read {path}: {os_error(e)}") from None
    except UnicodeDecodeError:
        raise MtadEdgeError(f"{flag}: {path} is not UTF-8 text") from None


@click.command()
@click.argument("prompt")
@model_options
@decode_options
@click.option("--raw", is_flag=True, help="Continue PROMPT as plain text instead of answering it as a chat message.")
@click.option(
    "--chat", is_flag=True, help="Answer PROMPT as a chat message (the default where the model has a template)."
)
@click.option("--system", help="A system message before PROMPT.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {text, tokens, finish_reason, stats}.")
@click.option(
    "--json-schema",
    metavar="FILE|JSON",
    help="The answer follows this JSON schema: a file, or the schema itself ('{...}').",
)
@click.option(
    "--grammar",
    metavar="FILE",
    help="The answer follows this grammar: GBNF, or Lark for a .lark file (docs/structured-output.md).",
)
@click.option("--regex", metavar="PATTERN", help="The answer matches this regular expression.")
@click.option(
    "--parse-special/--no-parse-special",
    default=True,
    show_default=True,
    hidden=True,
    help="With --raw: special tokens written in PROMPT (<|im_start|>) become control tokens. A chat "
    "message's text stays text whatever it holds.",
)
@errors_as_click
def generate(
    prompt: str,
    model: ModelChoice,
    raw: bool,
    chat: bool,
    system: Optional[str],
    as_json: bool,
    json_schema: Optional[str],
    grammar: Optional[str],
    regex: Optional[str],
    parse_special: bool,
    **decode: Any,
) -> None:
    """Answer PROMPT: the target model writes, the aux model drafts for it.

    \b
    mtad-edge "Explain beam search in one paragraph."
    mtad-edge generate --raw --temperature 0 "The capital of France is"
    mtad-edge generate --json --seed 1 "Hi"     (one JSON object, repeatable)

    Every option: --help-all; what each does, in full: docs/cli.md."""
    cfg = decode_config(**decode)
    if raw and chat:
        raise click.UsageError("give --raw or --chat, not both")
    if system and raw:
        raise click.UsageError("--system needs a chat: leave out --raw")
    check_text(prompt, "prompt")  # before the load: a command line's undecodable bytes
    constraint = read_constraint(json_schema, grammar, regex)
    interrupts.hold()  # a signal never cuts the load, the output or the freeing of the models...
    with model.engine(cfg, [cfg.method], given=given(decode)) as engine:
        if interrupts.code:  # ... a signal during the load ends the command once it is loaded
            sys.exit(interrupts.code)
        as_chat = not raw and (chat or system is not None or engine.has_chat_template)
        if not raw and not as_chat:
            click.echo("note: the model has no chat template: continuing PROMPT as plain text", err=True)
        if as_chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            response = engine.chat(msgs, constraint=constraint)
        else:
            response = engine.generate(prompt, parse_special=parse_special, constraint=constraint)
        if response.stats.auto and not as_json:  # method auto: what it chose for this pair, in one line
            click.echo(f"method auto: {response.stats.auto}", err=True)
        try:
            with interrupts.stopping(response.cancel):  # ... and one during the run stops it at the next step
                for piece in response:
                    if not as_json:
                        write_out(piece)
        except KeyboardInterrupt:  # Python's own Ctrl-C, where the console script's handling is not installed
            response.interrupted()
        if interrupts.code:
            response.interrupted()  # what was generated is kept and reported
        if as_json:
            out = {
                "text": response.text_so_far(),
                "tokens": response.tokens,
                "finish_reason": response.finish_reason,
                "stats": response.stats.to_dict(),
            }
            write_out(json.dumps(out) + "\n")
        else:
            write_out("\n")
            click.echo(response.stats.summary(), err=True)
    interrupts.hard_exit = True  # output written, models freed: see signals.Interrupts.finish
    if response.finish_reason == CANCELLED:
        sys.exit(interrupts.code or 130)
