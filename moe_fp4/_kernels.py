"""Import of the Triton kernels package under its installed name, ``moe_fp4.triton_kernels``.

Installed, the top-level folder ``triton_kernels/`` lives at ``moe_fp4/triton_kernels`` (the
name ``triton_kernels`` belongs to OpenAI's package, which vLLM imports). Run from a source
tree (``PYTHONPATH=.``), the folder is loaded under that same name, never as a top-level
module.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

NAME = "moe_fp4.triton_kernels"


def load_triton_kernels() -> ModuleType:
    """Return ``moe_fp4.triton_kernels`` (this imports triton)."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    try:
        return importlib.import_module(NAME)
    except ModuleNotFoundError as exc:
        if exc.name != NAME:
            raise
    src = Path(__file__).resolve().parent.parent / "triton_kernels"
    init = src / "__init__.py"
    if not init.is_file():
        raise ImportError(f"moe_fp4's Triton kernels are missing: neither {NAME} nor {src} exists")
    spec = importlib.util.spec_from_file_location(NAME, init, submodule_search_locations=[str(src)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[NAME]
        raise
    return mod
