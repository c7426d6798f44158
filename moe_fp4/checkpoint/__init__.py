"""Checkpoint loading: NVFP4 MoE layers of compressed-tensors and ModelOpt checkpoints.

    from moe_fp4 import list_moe_layers, load_experts, load_moe_block
    for layer in list_moe_layers("Qwen3-30B-A3B-NVFP4"):
        block = load_moe_block("Qwen3-30B-A3B-NVFP4", layer, device="cuda")
        out = block(hidden_states)            # router (softmax, top-k, renormalise) + fused_moe

:class:`Checkpoint` indexes a folder once (config, format, tensor headers) and loads any
layer; :mod:`.loader` states the scale conventions. :func:`.verify.verify_checkpoint` (on the
command line ``moe-fp4 verify PATH``) checks every MoE layer on every available backend.
"""

from .formats import MoEConfig, QuantFormat
from .loader import Checkpoint, MoEBlock, list_moe_layers, load_experts, load_moe_block, load_router
from .router import Router, route

__all__ = [
    "Checkpoint",
    "MoEBlock",
    "MoEConfig",
    "QuantFormat",
    "Router",
    "list_moe_layers",
    "load_experts",
    "load_moe_block",
    "load_router",
    "route",
]
