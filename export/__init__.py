"""mtad_edge.export: Hugging Face checkpoints -> quantized target + auxiliary pairs.

Not built yet (tracked in its own issue). The runtime already consumes the manifest schema the
export stage will write: see ``mtad_edge.pairs``.
"""
