"""moe_fp4's Triton kernels: the NVFP4 MoE pipeline, stage for stage (``moe_fp4.stages``).

Installed as ``moe_fp4.triton_kernels``; load it with ``moe_fp4._kernels.load_triton_kernels()``.
Each public op is one module (``routing``, ``quantize``, ``gemm``, ``reduce``) whose wrapper
allocates, picks a launch configuration and launches; the ``@triton.jit`` bodies live in
the ``*_details`` subpackages and see only pointers, sizes and constexprs. The wrappers do
not validate their arguments: ``moe_fp4.backends.triton`` does.
"""

from ._common import INTERPRET
from .gemm import DEQUANT_MODES, GEMM_CONFIGS, GemmConfig, gemm_config, grouped_gemm, partials_numel, split_k_for
from .quantize import QUANT_CONFIGS, QuantConfig, quant_config, quantize_rows, quantized_buffers, silu_mul_quantize
from .reduce import moe_reduce
from .routing import routing, routing_buffers, routing_scratch_shape

__all__ = [
    "DEQUANT_MODES",
    "GEMM_CONFIGS",
    "GemmConfig",
    "INTERPRET",
    "QUANT_CONFIGS",
    "QuantConfig",
    "gemm_config",
    "grouped_gemm",
    "moe_reduce",
    "partials_numel",
    "quant_config",
    "quantize_rows",
    "routing",
    "routing_buffers",
    "routing_scratch_shape",
    "quantized_buffers",
    "silu_mul_quantize",
    "split_k_for",
]
