"""mtad_edge.runtime: backends and decoders. Installed as ``mtad_edge.runtime``.

Heavy backends are imported lazily: ``from mtad_edge.runtime.llama_cpp_backend import LlamaCppBackend``.
"""

from .backend import Backend, Batch, VocabInfo
from .config import DecodeConfig
from .decoding import Generation, Stats, generate_tokens
from .errors import ContextOverflowError, IncompatiblePairError, ModelLoadError, MtadEdgeError, OptionError
from .sampling import SamplingConfig

__all__ = [
    "Backend",
    "Batch",
    "VocabInfo",
    "DecodeConfig",
    "Generation",
    "Stats",
    "generate_tokens",
    "ContextOverflowError",
    "IncompatiblePairError",
    "ModelLoadError",
    "MtadEdgeError",
    "OptionError",
    "SamplingConfig",
]
