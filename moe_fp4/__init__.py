"""moe_fp4: fused NVFP4 Mixture-of-Experts kernels (CUTLASS on Blackwell, Triton elsewhere).

Public API::

    from moe_fp4 import NvFp4Experts, fused_moe
    experts = NvFp4Experts.quantize(w13, w2, a13_gs=..., a2_gs=...)
    out = fused_moe(x, experts, topk_weights, topk_ids)        # backend="auto"
    experts = load_experts("path/to/checkpoint", layer=0)     # compressed-tensors or ModelOpt
"""

from .backends.registry import (
    available_backends,
    backend_status,
    explain_backend,
)
from .checkpoint import list_moe_layers, load_experts, load_moe_block
from .errors import BackendUnavailableError
from .experts import NvFp4Experts
from .format import (
    dequantize_nvfp4,
    global_scale_for,
    quantize_nvfp4,
    swizzle_scales,
    swizzle_scales_grouped,
    unswizzle_scales,
    unswizzle_scales_grouped,
)
from .moe import fused_moe
from .nn import FusedMoE, SparseMoeBlock

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "FusedMoE",
    "NvFp4Experts",
    "SparseMoeBlock",
    "available_backends",
    "backend_status",
    "dequantize_nvfp4",
    "explain_backend",
    "fused_moe",
    "global_scale_for",
    "list_moe_layers",
    "load_experts",
    "load_moe_block",
    "quantize_nvfp4",
    "swizzle_scales",
    "swizzle_scales_grouped",
    "unswizzle_scales",
    "unswizzle_scales_grouped",
]
