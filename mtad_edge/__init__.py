"""mtad-edge: multi-token assisted decoding (MTAD) for local LLM inference.

``from mtad_edge import Engine`` gives the embeddable API (see mtad_edge.engine).
"""

__version__ = "0.1.0"
__all__ = ["Engine", "Response"]


def __getattr__(name):  # lazy: the CLI and light imports need not load the engine
    if name in __all__:
        from mtad_edge import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'mtad_edge' has no attribute {name!r}")
