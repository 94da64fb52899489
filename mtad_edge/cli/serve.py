"""`mtad-edge serve`: an OpenAI-compatible local HTTP server on the pair."""

from __future__ import annotations

import click

from mtad_edge.cli.options import errors_as_click, method_option, model_options, pair_or_manifest, sampling_options


@click.command()
@model_options
@method_option
@sampling_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--api-key", envvar="MTAD_EDGE_API_KEY", help="Require 'Authorization: Bearer KEY' (env MTAD_EDGE_API_KEY)."
)
@click.option(
    "--queue-size",
    type=click.IntRange(min=0),
    default=8,
    show_default=True,
    help="Requests that may wait while one runs; more get 429.",
)
@click.option(
    "--max-body",
    type=click.IntRange(min=1024),
    default=1 << 20,
    show_default=True,
    help="Largest request body in bytes (413 above).",
)
@click.option("--model-name", help="The model id clients see (default: the pair's name).")
@errors_as_click
def serve(
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
    host,
    port,
    api_key,
    queue_size,
    max_body,
    model_name,
    method,
    **sampling,
):
    """Serve /v1/chat/completions, /v1/completions and /v1/models (streaming and not)."""
    import uvicorn

    from mtad_edge.engine import Engine
    from mtad_edge.server.app import create_app

    name = pair_or_manifest(pair, manifest)
    engine = Engine.load(
        name,
        target=target,
        aux=aux,
        method=method,
        n_ctx=n_ctx,
        threads=n_threads,
        n_gpu_layers=n_gpu_layers,
        flash_attn=flash_attn,
        backend=backend,
        provider=provider,
        **sampling,
    )
    model_name = model_name or name or (target and click.format_filename(target)) or "smollm2-135m"
    app = create_app(engine, model_name, api_key=api_key, queue_size=queue_size, max_body=max_body)
    click.echo(f"mtad-edge serving {model_name} on http://{host}:{port}/v1 (method {method})", err=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        engine.close()
