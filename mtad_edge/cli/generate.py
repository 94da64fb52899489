"""`mtad-edge generate PROMPT`: one answer, streamed to stdout or as one JSON object.

PROMPT is a user's message in the model's chat template where the model has one (as llama-cli
and `ollama run` do), else plain text to continue; --raw continues it as plain text always."""

from __future__ import annotations

import json
import sys
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
from mtad_edge.signals import interrupts


@click.command()
@click.argument("prompt")
@model_options
@decode_options
@click.option("--raw", is_flag=True, help="Continue PROMPT as plain text instead of answering it as a chat message.")
@click.option(
    "--chat", is_flag=True, help="Answer PROMPT as a chat message (the default where the model has a template)."
)
@click.option("--system", help="A system message before PROMPT.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {text, tokens, stats}.")
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
    interrupts.hold()  # a signal never cuts the load, the output or the freeing of the models...
    with model.engine(cfg, [cfg.method], given=given(decode)) as engine:
        if interrupts.code:  # ... a signal during the load ends the command once it is loaded
            sys.exit(interrupts.code)
        as_chat = not raw and (chat or system is not None or engine.has_chat_template)
        if not raw and not as_chat:
            click.echo("note: the model has no chat template: continuing PROMPT as plain text", err=True)
        if as_chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            response = engine.chat(msgs)
        else:
            response = engine.generate(prompt, parse_special=parse_special)
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
            out = {"text": response.text_so_far(), "tokens": response.tokens, "stats": response.stats.to_dict()}
            write_out(json.dumps(out) + "\n")
        else:
            write_out("\n")
            click.echo(response.stats.summary(), err=True)
    interrupts.hard_exit = True  # output written, models freed: see signals.Interrupts.finish
    if response.finish_reason == CANCELLED:
        sys.exit(interrupts.code or 130)
