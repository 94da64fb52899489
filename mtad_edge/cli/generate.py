"""`mtad-edge generate PROMPT`: one completion, streamed to stdout or as one JSON object."""

from __future__ import annotations

import json
import sys

import click

from mtad_edge.cli.options import decode_config, decode_options, errors_as_click, model_options, pair_or_manifest
from mtad_edge.loader import ModelOptions, open_pair
from mtad_edge.pairs import resolve
from mtad_edge.runtime.decoding import Generation
from mtad_edge.textstream import TextStream


def _say(msg: str) -> None:
    click.echo(msg, err=True)


@click.command()
@click.argument("prompt")
@model_options
@decode_options
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user turn in the model's chat template.")
@click.option("--system", help="System message (with --chat).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {text, tokens, stats} on stdout.")
@errors_as_click
def generate(
    prompt,
    pair,
    manifest,
    target,
    aux,
    n_ctx,
    n_threads,
    n_gpu_layers,
    flash_attn,
    backend,
    provider,
    chat,
    system,
    as_json,
    **decode,
):
    """Generate a completion of PROMPT with the target model, drafting with the auxiliary one."""
    cfg = decode_config(**decode)
    pair = pair_or_manifest(pair, manifest)
    if system and not chat:
        raise click.UsageError("--system needs --chat")
    if (target is None) != (aux is None) and cfg.method != "ar" and not pair:
        raise click.UsageError("give both --target and --aux (or --method ar with --target alone)")
    paths = resolve(pair, target, aux, say=_say)
    opts = ModelOptions(
        n_ctx=n_ctx,
        n_threads=n_threads,
        n_gpu_layers=n_gpu_layers,
        flash_attn=flash_attn,
        backend=backend,
        provider=provider,
    )
    with open_pair(paths, cfg, opts) as models:
        text = prompt
        if chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            text = models.render_chat(msgs)
        gen = Generation(models.target, models.aux, models.target.tokenize(text), cfg)
        stream = TextStream(models.target)
        tokens, pieces = [], []
        try:
            for block in gen:
                tokens += block
                piece = stream.push(block)
                pieces.append(piece)
                if not as_json and piece:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        except KeyboardInterrupt:  # keep what was generated; report it, then exit 130
            gen.stats.finish_reason = "interrupted"
        pieces.append(stream.flush())
        if as_json:
            click.echo(json.dumps({"text": "".join(pieces), "tokens": tokens, "stats": gen.stats.to_dict()}))
        else:
            sys.stdout.write(pieces[-1] + "\n")
            _say(gen.stats.summary())
        if gen.stats.finish_reason == "interrupted":
            sys.exit(130)
