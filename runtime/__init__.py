"""mtad_edge.runtime: backends and decoders. Installed as ``mtad_edge.runtime``.

Heavy backends are imported lazily: ``from mtad_edge.runtime.backends.llama_cpp_backend import LlamaCppBackend``.
"""

from .backend import Backend, Batch, VocabInfo
from .config import DecodeConfig, SamplingConfig
from .decoding import Generation, Stats
from .errors import ContextOverflowError, IncompatiblePairError, ModelLoadError, MtadEdgeError, OptionError

__all__ = [
    "Backend",
    "Batch",
    "VocabInfo",
    "DecodeConfig",
    "Generation",
    "Stats",
    "ContextOverflowError",
    "IncompatiblePairError",
    "ModelLoadError",
    "MtadEdgeError",
    "OptionError",
    "SamplingConfig",
]
