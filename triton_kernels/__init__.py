"""moe_fp4's Triton kernels: the NVFP4 MoE pipeline, stage for stage.

Installed as ``moe_fp4.triton_kernels`` (never as top-level ``triton_kernels``, which is
OpenAI's package); ``moe_fp4.backends.triton`` imports it and is the one place that joins
it to the rest of moe_fp4. It imports only triton and torch. Each public op is one module
(``routing``, ``quantize``, ``gemm``, ``reduce``) whose wrapper picks a launch configuration
and launches into output buffers the caller passes; the ``@triton.jit`` bodies live in the
``*_details`` subpackages and see only pointers, sizes and constexprs. The wrappers do not
validate their arguments: the caller does.

The kernels are created for Triton's CPU interpreter when ``TRITON_INTERPRET=1`` is set
at import (:data:`INTERPRET`), otherwise for the GPU.
"""

from ._common import INTERPRET, LaunchBatch
from .gemm import (
    DENSE_FROM,
    DEQUANT_MODES,
    GEMM_CONFIGS,
    GEMM_CONFIGS_SM100,
    GEMM_VALUES_CONFIGS,
    GEMM_VALUES_PORTABLE_CONFIGS,
    GEMM_VALUES_TILES,
    K16_SHIFTS,
    NARROW_BELOW,
    PORTABLE_SHARED_BYTES,
    VALUES_LONG_K_MAX_ROWS,
    VALUES_LONG_K_MIN,
    GemmConfig,
    dense_experts,
    dense_nbytes,
    gemm_config,
    grouped_gemm,
    grouped_gemm_launcher,
    grouped_gemm_reduce_launcher,
    k16_codes,
    k16_restore,
    k_ranges,
    partials_numel,
    pinned_config,
    pinned_gemm_config,
    resolve_config,
    silu_fusable,
    split_k_for,
)
from .quantize import (
    FUSED_ROUTING_MAX,
    QUANT_CONFIGS,
    QUANT_SILU_VALUES_CONFIGS,
    QUANT_VALUES_CONFIGS,
    QuantConfig,
    quant_config,
    quantize_rows,
    quantize_rows_launcher,
    quantize_rows_values_launcher,
    routing_quantize_values_launcher,
    silu_mul_quantize,
    silu_mul_quantize_launcher,
    silu_mul_quantize_values_launcher,
)
from .reduce import moe_reduce, moe_reduce_launcher
from .routing import routing, routing_launcher, routing_scratch_numel

__all__ = [
    "DENSE_FROM",
    "DEQUANT_MODES",
    "GEMM_CONFIGS",
    "GEMM_CONFIGS_SM100",
    "GEMM_VALUES_CONFIGS",
    "GEMM_VALUES_PORTABLE_CONFIGS",
    "GEMM_VALUES_TILES",
    "NARROW_BELOW",
    "PORTABLE_SHARED_BYTES",
    "VALUES_LONG_K_MAX_ROWS",
    "VALUES_LONG_K_MIN",
    "GemmConfig",
    "INTERPRET",
    "K16_SHIFTS",
    "LaunchBatch",
    "QUANT_CONFIGS",
    "QUANT_SILU_VALUES_CONFIGS",
    "QUANT_VALUES_CONFIGS",
    "QuantConfig",
    "dense_experts",
    "dense_nbytes",
    "gemm_config",
    "grouped_gemm",
    "grouped_gemm_launcher",
    "grouped_gemm_reduce_launcher",
    "k_ranges",
    "k16_codes",
    "k16_restore",
    "moe_reduce",
    "moe_reduce_launcher",
    "partials_numel",
    "pinned_config",
    "pinned_gemm_config",
    "quant_config",
    "quantize_rows",
    "quantize_rows_launcher",
    "quantize_rows_values_launcher",
    "routing_quantize_values_launcher",
    "FUSED_ROUTING_MAX",
    "resolve_config",
    "routing",
    "routing_launcher",
    "routing_scratch_numel",
    "silu_mul_quantize",
    "silu_mul_quantize_launcher",
    "silu_mul_quantize_values_launcher",
    "split_k_for",
    "silu_fusable",
]
