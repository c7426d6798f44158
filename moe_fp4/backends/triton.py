"""The ``triton`` backend: the pipeline's stages on the Triton kernels of ``moe_fp4.triton_kernels``.

It serves every CUDA GPU Triton supports from SM80 on (Hopper above all, which has no FP4
tensor cores: both operands are turned in registers into fp16 ``e2m1 * e4m3 * 2^-7``,
exactly, and multiplied with float32 accumulation), and the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``), which runs the same kernels on the same fp16
operands (its float32 product of them is exact) without inline assembly.

This module is the one place that joins ``triton_kernels/`` (which imports only triton
and torch) to moe_fp4: :data:`STAGES` wraps the kernels in the checked stage functions of
:mod:`moe_fp4.pipeline` (also exported here by name: ``routing``, ``quantize_rows``, ...).
The kernels are imported on first use, so that ``TRITON_INTERPRET`` can be set first.
``config=`` on ``quantize_rows`` / ``grouped_gemm`` pins a ``QuantConfig`` / ``GemmConfig``;
:func:`pinned_gemm_config` pins one for the GEMMs of :func:`fused_moe`.

:func:`fused_moe` is six kernel launches (routing takes two more when ``M * topk > 256``,
and a GEMM one more when its configuration splits K), never synchronizes with the host,
allocates only the result (unless ``problem.out`` is given) and is capturable in a CUDA
graph once its shape has run eagerly.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import torch

from ..pipeline import StageSet, cached_workspace, run_pipeline

__all__ = [
    "STAGES",
    "why_unavailable",
    "fused_moe",
    "kernels",
    "pinned_gemm_config",
    "routing",
    "quantize_rows",
    "silu_mul_quantize",
    "grouped_gemm",
    "moe_reduce",
]

_KERNELS = "moe_fp4.triton_kernels"


def kernels() -> ModuleType:
    """``moe_fp4.triton_kernels`` (importing it imports triton and creates the jit functions)."""
    from .. import triton_kernels

    return triton_kernels


def why_unavailable(device: torch.device, capability: tuple[int, int] | None) -> str | None:
    """None when the Triton kernels can run on ``device``, otherwise why not."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    loaded = sys.modules.get(_KERNELS)
    if loaded is not None and loaded.INTERPRET != interpreted:
        mode = "Triton's CPU interpreter" if loaded.INTERPRET else "the GPU compiler"
        return f"its kernels were already created for {mode}; TRITON_INTERPRET changed after they were imported"
    if device.type == "cuda":
        if capability is None or capability < (8, 0):
            return f"needs compute capability 8.0 or newer (bf16 tensor cores), this device has {capability}"
        return None
    if device.type == "cpu":
        if not interpreted:
            return "runs on CPU only in Triton's interpreter: set TRITON_INTERPRET=1 before moe_fp4 imports its kernels"
        return None
    return f"runs on cuda devices (or cpu with TRITON_INTERPRET=1), not {device.type}"


def _check_config(config: object, kind: str) -> None:
    cls = getattr(kernels(), kind)
    if config is not None and not isinstance(config, cls):
        raise TypeError(f"config: expected a {kind}, got {type(config).__name__}")


def _no_values(out) -> None:
    if out.values is not None:
        raise ValueError("out: the Triton quantization stages write packed codes and scales, not values; "
                         "pass a Quantized without values")


class _Kernels:
    """The Triton kernels as :class:`~moe_fp4.pipeline.StageKernels`."""

    def routing(self, topk_ids, out, scratch) -> None:
        tk = kernels()
        numel = tk.routing_scratch_numel(out.num_slots, out.num_experts)
        buf = scratch("routing", 4 * numel).view(torch.int32) if numel else None
        tk.routing(topk_ids, out.expert_offsets, out.blockscale_offsets, out.slot_to_flat, out.flat_to_slot, buf)

    def quantize_rows(self, x, gs, routing, gather, row_scale, out, config) -> None:
        _check_config(config, "QuantConfig")
        _no_values(out)
        kernels().quantize_rows(x, gs, routing.expert_offsets, routing.blockscale_offsets,
                                routing.slot_to_flat if gather else None, row_scale, out.packed, out.scales, config)

    def silu_mul_quantize(self, h, gs, routing, out, config) -> None:
        _check_config(config, "QuantConfig")
        _no_values(out)
        kernels().silu_mul_quantize(h, gs, routing.expert_offsets, routing.blockscale_offsets, out.packed,
                                    out.scales, config)

    def grouped_gemm(self, a, w, routing, out, scratch, config) -> None:
        _check_config(config, "GemmConfig")
        tk = kernels()
        numel = tk.partials_numel(config, a.rows, w.E, w.N, w.K, a.device)
        partials = scratch("split_k", 4 * numel).view(torch.float32) if numel else None
        tk.grouped_gemm(a.packed, a.scales, w.packed, w.scales, w.alpha, routing.expert_offsets,
                        routing.blockscale_offsets, out, config, partials)

    def moe_reduce(self, y, routing, topk_weights, out) -> None:
        kernels().moe_reduce(y, routing.flat_to_slot, topk_weights, out)


STAGES = StageSet.from_kernels("triton", _Kernels())

routing = STAGES.routing
quantize_rows = STAGES.quantize_rows
silu_mul_quantize = STAGES.silu_mul_quantize
grouped_gemm = STAGES.grouped_gemm
moe_reduce = STAGES.moe_reduce


def pinned_gemm_config(config):
    """Within the block, the GEMMs of :func:`fused_moe` run with ``config`` (a ``GemmConfig``), not the table's."""
    return kernels().pinned_gemm_config(config)


def fused_moe(problem) -> torch.Tensor:
    """The MoE forward of ``moe_fp4.fused_moe`` (``problem`` is a validated ``MoEProblem``)."""
    return run_pipeline(STAGES, problem, cached_workspace(STAGES, problem))
