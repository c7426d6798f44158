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

from ..pipeline import BoundStages, PlanBuffers, StageSet, run_cached
from . import _triton_batch

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
    """The Triton kernels as :class:`~moe_fp4.pipeline.StageKernels`.

    Each stage has one method that prepares its launches (the ``*_launcher`` functions of the
    kernels' modules) for the stage's buffers: the stage methods launch at once, :meth:`bind`
    keeps the launches for a plan. A plan's launches run in one call of the CUDA library where it
    is available (:mod:`moe_fp4.backends._triton_batch`), else through Triton's launcher; both
    take the current stream.
    """

    def _routing(self, n, out, scratch):
        """Free: ``topk_ids``."""
        tk = kernels()
        numel = tk.routing_scratch_numel(n, out.num_experts)
        buf = scratch("routing", 4 * numel).view(torch.int32) if numel else None
        return tk.routing_launcher(n, out.expert_offsets, out.blockscale_offsets, out.slot_to_flat, out.flat_to_slot,
                                   buf)

    def _quantize_rows(self, x_rows, k, gs, routing, gather, has_row_scale, out, config):
        """Rows ``x [x_rows, k]``. Free: ``x``, ``row_scale``."""
        _check_config(config, "QuantConfig")
        _no_values(out)
        return kernels().quantize_rows_launcher(x_rows, k, gs, routing.expert_offsets, routing.blockscale_offsets,
                                                routing.slot_to_flat if gather else None, has_row_scale, out.packed,
                                                out.scales, config)

    def _silu_mul_quantize(self, h, gs, routing, out, config):
        _check_config(config, "QuantConfig")
        _no_values(out)
        return kernels().silu_mul_quantize_launcher(h, gs, routing.expert_offsets, routing.blockscale_offsets,
                                                    out.packed, out.scales, config)

    def _grouped_gemm(self, a, w, routing, out, scratch, config):
        _check_config(config, "GemmConfig")
        tk = kernels()
        cfg = tk.resolve_config(config, a.rows, w.E)
        numel = tk.partials_numel(cfg, a.rows, w.E, w.N, w.K, a.device)
        partials = scratch("split_k", 4 * numel).view(torch.float32) if numel else None
        return tk.grouped_gemm_launcher(a.packed, a.scales, w.packed, w.scales, w.alpha, routing.expert_offsets,
                                        routing.blockscale_offsets, out, cfg, partials)

    def routing(self, topk_ids, out, scratch) -> None:
        self._routing(topk_ids.numel(), out, scratch)(topk_ids)

    def quantize_rows(self, x, gs, routing, gather, row_scale, out, config) -> None:
        self._quantize_rows(x.shape[0], x.shape[1], gs, routing, gather, row_scale is not None, out, config)(
            x, row_scale)

    def silu_mul_quantize(self, h, gs, routing, out, config) -> None:
        self._silu_mul_quantize(h, gs, routing, out, config)()

    def grouped_gemm(self, a, w, routing, out, scratch, config) -> None:
        self._grouped_gemm(a, w, routing, out, scratch, config)()

    def moe_reduce(self, y, routing, topk_weights, out) -> None:
        kernels().moe_reduce(y, routing.flat_to_slot, topk_weights, out)

    def _bound_gemm(self, a, w, routing, out, scratch):
        """The GEMM of a plan: the table's configuration, or the one pinned (:func:`pinned_gemm_config`)
        around the call, each prepared the first time it is used."""
        tk = kernels()
        table = tk.gemm_config(a.rows, w.E)
        last = [None, None]  # the configuration of the last call and its launch (plans run under a lock)

        def gemm(stream) -> None:
            pinned = tk.pinned_config()
            cfg = table if pinned is None else pinned
            if cfg is not last[0]:
                last[:] = cfg, self._grouped_gemm(a, w, routing, out, scratch, cfg)
            last[1]()

        return gemm

    def bind(self, b: PlanBuffers) -> BoundStages:
        """A plan's launches: these methods' launches prepared for the plan's buffers."""
        route = self._routing(b.num_tokens * b.topk, b.routing, b.scratch)
        quantize = self._quantize_rows(b.num_tokens, b.a1.K, b.gs13, b.routing, True, b.apply_router_weight_on_input,
                                       b.a1, None)
        silu = self._silu_mul_quantize(b.h, b.gs2, b.routing, b.a2, None)
        reduce = kernels().moe_reduce_launcher(b.y, b.routing.flat_to_slot, not b.apply_router_weight_on_input,
                                               b.num_tokens, b.y.shape[1])
        runner = _triton_batch.runner() if b.device.type == "cuda" else None
        return BoundStages(
            routing=lambda topk_ids, stream: route(topk_ids),
            quantize_rows=lambda x, row_scale, stream: quantize(x, row_scale),
            gemm1=self._bound_gemm(b.a1, b.w13, b.routing, b.h, b.scratch),
            silu_mul_quantize=lambda stream: silu(),
            gemm2=self._bound_gemm(b.a2, b.w2, b.routing, b.y, b.scratch),
            moe_reduce=lambda topk_weights, out, stream: reduce(topk_weights, out),
            batch=None if runner is None else kernels().LaunchBatch(runner),
        )


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
    """The MoE forward of ``moe_fp4.fused_moe`` (``problem`` is a validated ``MoEProblem``).

    Triton launches on the current device: the problem's device is made current for the call
    when it is not (tensors on ``cuda:1`` with ``cuda:0`` current, as under a ``device_map``)."""
    x = problem.hidden_states
    if x.is_cuda and torch.cuda.current_device() != x.get_device():
        with torch.cuda.device(x.device):
            return run_cached(STAGES, problem)
    return run_cached(STAGES, problem)
