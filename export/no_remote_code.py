"""Run a module as a script (``python -m mtad_edge.export.no_remote_code MODULE ARGS...``) with a
model folder's own Python code refused by transformers.

llama.cpp's converter asks transformers for ``trust_remote_code=True`` when it reads some
tokenizers (Qwen's, HybridDNA's, GLM's, ...): a folder whose tokenizer_config.json names such a
class and an ``auto_map`` then has its own .py files imported. A model folder is untrusted input
and never runs code: here every such request is answered as ``trust_remote_code=False``, so a
class transformers knows is used as is, and a folder that needs its own code is refused (a
ValueError of ours, the converter's last line).
"""

from __future__ import annotations

import runpy
import sys
from typing import Any


def refuse_remote_code() -> None:
    """Make transformers resolve every ``trust_remote_code`` to False, in its auto classes already
    imported and in those imported later (they import the function by name)."""
    import transformers.dynamic_module_utils as dynamic

    def never(trust_remote_code: Any, model_name: Any, has_local_code: bool, has_remote_code: bool, *a: Any, **k: Any):
        if has_remote_code and not has_local_code:
            raise ValueError(f"{model_name} needs its own Python code (an auto_map): a model folder never runs code")
        return False

    def refuse(class_reference: Any, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"{class_reference}: a model folder's own code is never run")

    replacements: dict[str, tuple[Any, Any]] = {
        "resolve_trust_remote_code": (dynamic.resolve_trust_remote_code, never),
        "get_class_from_dynamic_module": (dynamic.get_class_from_dynamic_module, refuse),
    }
    for name, module in list(sys.modules.items()):
        if name.startswith("transformers"):
            for attr, (old, new) in replacements.items():
                if getattr(module, attr, None) is old:
                    setattr(module, attr, new)


def main() -> None:
    module, *args = sys.argv[1:]
    refuse_remote_code()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
