"""`mtad-edge generate PROMPT`: one completion, streamed to stdout or as one JSON object."""

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
    model_options,
    write_out,
)
from mtad_edge.signals import interrupts


@click.command()
@click.argument("prompt")
@model_options
@decode_options
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user turn in the model's chat template.")
@click.option("--system", help="System message (with --chat).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {text, tokens, stats} on stdout.")
@click.option(
    "--parse-special/--no-parse-special",
    default=True,
    show_default=True,
    help="Special tokens written in a raw PROMPT (<|im_start|>) become control tokens; --chat keeps the "
    "messages' text as text whatever it holds.",
)
@errors_as_click
def generate(
    prompt: str,
    model: ModelChoice,
    chat: bool,
    system: Optional[str],
    as_json: bool,
    parse_special: bool,
    **decode: Any,
) -> None:
    """Generate a completion of PROMPT with the target model, drafting with the auxiliary one."""
    cfg = decode_config(**decode)
    if system and not chat:
        raise click.UsageError("--system needs --chat")
    interrupts.hold()  # a signal never cuts the load, the output or the freeing of the models...
    with model.engine(cfg, [cfg.method]) as engine:
        if interrupts.code:  # ... a signal during the load ends the command once it is loaded
            sys.exit(interrupts.code)
        if chat:
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
    if response.finish_reason == "interrupted":
        sys.exit(interrupts.code or 130)
