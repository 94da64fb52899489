"""mtad-edge: multi-token assisted decoding (MTAD) for local LLM inference."""
__version__ = "0.1.0"
