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

:data:`STAGES_VALUES` is the same W4A4 pipeline with the activation operand as fp16 values:
its quantization stages write ``e2m1 * e4m3`` (exact in fp16 whatever the model's dtype) and no
codes, and its GEMMs take weights in the K16 layout (re-laid out once, in place of the
canonical codes where the experts allow) and dequantize only those: fewer operand instructions
per weight element (``benchmarks/results/triton-sass-2026-12-01.md``), with a launch table of
its own (``GEMM_VALUES_CONFIGS``; past ``DENSE_FROM`` rows per expert its dense GEMM: the weights
dequantized once per forward into an fp16 scratch of the plan's workspace, then an fp16 x fp16 GEMM,
``GemmConfig.dense_mib``). The default form, ``"auto"``, takes it on 9.x GPUs where H and I
are multiples of 64 (on the H200 faster than the codes, or within 0.5%, at every M of the three
benchmarked layers: ``benchmarks/README.md``, eighth session) and the codes elsewhere;
:func:`operand_form` or ``MOE_FP4_TRITON_OPERAND`` pins either.

:func:`fused_moe` is six kernel launches (routing takes two more when ``M * topk > 256``,
and a GEMM one more when its configuration splits K; the values form's plans take one fewer when
``M * topk <= FUSED_ROUTING_MAX``, 64: the routing and the first quantization in one kernel, and,
with :data:`FUSE_SILU` (off by default), one fewer again: the SiLU-and-mul quantization in the
first GEMM's epilogue, or its split-K reduce's; with :data:`FUSE_TOPK_REDUCE` (on) a plan whose
second GEMM splits K adds the K ranges in the top-k reduce's launch; with :data:`FUSE_SPLIT_K_IN_GEMM` (on)
a split first GEMM adds its own K ranges, and with :data:`FUSE_TOPK_IN_GEMM` (off) the second GEMM takes the
top-k reduce at decode: a decode forward of four launches),
never synchronizes with the host, allocates only the result (unless ``problem.out`` is given) and
is capturable in a CUDA graph once its shape has run eagerly.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import torch

from .._checks import check_precision
from ..buffers import K16Weights, WeightOperand, _swizzle_relayout, _swizzle_restore
from ..format import swizzled_shape
from ..pipeline import BoundStages, PlanBuffers, StageSet, run_cached, with_fused_routing
from ..stages import _values_of
from . import _triton_batch

__all__ = [
    "STAGES",
    "STAGES_VALUES",
    "STAGES_VALUES_W4A16",
    "OPERAND_FORMS",
    "operand_form",
    "stages_for",
    "stages_for_problem",
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


# Whether the values plans put the SiLU-and-mul quantization into the first GEMM's epilogue (where the
# configuration can: ``silu_fusable``). Off: on the H200 the fused form was slower at every M of the
# three layers but three DeepSeek-V3 points inside that layer's run-to-run spread (whole forward, one
# process, benchmarks/fusion_ab.py; Qwen3 M=1 35.6 against 33.1 us, M=256 218.8 against 210.5, Llama-4-Scout
# M=1024 1338.0 against 1303.4: benchmarks/README.md, ninth session): the gate-and-up tile pairs and the
# epilogue's quantization cost the GEMM more than the separate launch, which PDL overlaps, costs the
# forward. Kept, tested byte for byte, for GPUs where it may pay. ``"split"``: only where the GEMM splits K
# (decode), i.e. into its split-K reduce, leaving the GEMM itself as it is: since the twenty-fourth session a
# split GEMM computes natural column tiles and only its reduce pairs gate and up (the A/B above had the
# pairs in that GEMM too); with ``FUSE_SPLIT_K_IN_GEMM`` the split GEMM computes gate/up tiles and its last
# K ranges quantize (no reduce launch). The H200 A/B of the twenty-fourth session (fusion_ab.py, ``silu-split`` against
# ``topk``): Qwen3 M = 1 33.5 -> 33.8 us, Llama-4-Scout M = 1 51.8 -> 52.1, M = 4 106.7 -> 106.5: no gain.
FUSE_SILU: bool | str = False

# Whether a plan whose second GEMM splits K (decode) adds the K ranges in the top-k reduce's launch
# (``grouped_gemm_reduce_launcher``: the same bits, one launch fewer; read when a plan is bound). Of the
# three benchmarked layers on the H200 only Llama-4-Scout's second GEMM splits: at M = 1 and 4, and since
# the twenty-fifth session's long-K rule (``gemm.LONG_K_SPLIT``) at M = 5 to 64 too
# (benchmarks/results/triton-plan-launches-2026-12-05-s25.md). At M = 1 and 4 the H200 A/B
# (benchmarks/fusion_ab.py, whole forward, one process, best of 3 rounds, twenty-fourth session) gave
# 54.3 -> 51.8 us and 108.6 -> 106.7, the outputs equal bit for bit; elsewhere the plans were the same.
FUSE_TOPK_REDUCE = True

# In one launch instead of two, by the GEMM's own programs: the last program to finish a piece of work,
# counted with an atomic counter (zeroed once, reset by that program), does what depends on it, in the order
# the separate launch would, so with the same bits (``FIXUP`` and ``TOPK`` of ``grouped_gemm_kernel``).
# ``FUSE_SPLIT_K_IN_GEMM``: where the first GEMM splits K (decode), its last K range of each tile adds the
# ranges (no ``split_k_reduce`` launch). ``FUSE_TOPK_IN_GEMM``: at ``M * topk <= TOPK_IN_GEMM_MAX``, the second
# GEMM takes the top-k reduce (and its own K ranges' sum where it splits): the last row tile of each column
# tile reduces those columns for every token (no ``moe_reduce`` or ``split_k_topk_reduce`` launch). With
# ``FUSE_SILU = "split"`` as well, a split first GEMM's last K ranges also take the SiLU-and-mul quantization
# (gate/up tiles): a decode forward of three launches. Built and checked in the CPU interpreter and compiled
# for sm_90 in the twenty-sixth session; first timed in the twenty-ninth, on an H100 (the H200 did not come;
# benchmarks/fusion_ab.py, whole forward, one process, best of 3 rounds, every output equal bit for bit to
# ``unfused``'s: tests/results/h100-2026-12-05-s29/): ``split-in-gemm`` against the default plan, M = 1,
# Qwen3 34.5 -> 32.6 us, Llama-4-Scout 56.8 -> 54.2, DeepSeek-V3 115.1 -> 108.3; M = 4, 16, 64 within the
# rounds' 2 % either way. So ``FUSE_SPLIT_K_IN_GEMM`` is on. ``topk-in-gemm`` gained nothing (Qwen3 M = 1
# 34.7, Llama-4-Scout M = 64 393.3 -> 408.0: its last row tile reduces every token's columns serially), nor
# did ``in-gemm-silu`` or ``decode-256`` (DeepSeek-V3 M = 4 316.5 -> 338.6): off. ``benchmarks/fusion_ab.py``
# has them as ``split-in-gemm``, ``topk-in-gemm``, ``in-gemm``, ``in-gemm-silu`` and ``decode-N``. A plan
# reads them when it is bound.
FUSE_SPLIT_K_IN_GEMM = True
FUSE_TOPK_IN_GEMM = False
TOPK_IN_GEMM_MAX = 64


def _no_pin(pinned_config):
    """Whether no GEMM configuration is pinned (``pinned_config``: the kernels' function, bound once)."""
    return lambda: pinned_config() is None


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

    values = False  # the GEMM's launch table: GEMM_CONFIGS (GEMM_VALUES_CONFIGS for activation values)

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

    def _gemm_operands(self, a, w, routing, scratch, config) -> tuple:
        """The arguments of a GEMM launcher up to its output, and after it its configuration (resolved),
        split-K partials and dense-weight scratch (from ``scratch``)."""
        _check_config(config, "GemmConfig")
        tk = kernels()
        cfg = tk.resolve_config(config, a.rows, w.E, self.values, w.N, a.device, w.K)
        numel = tk.partials_numel(cfg, a.rows, w.E, w.N, w.K, a.device)
        partials = scratch("split_k", 4 * numel).view(torch.float32) if numel else None
        nbytes = _dense_scratch_nbytes(tk, cfg, config, a.rows, w, a.device) if self.values else 0  # (codes: refused)
        dense = scratch("dense_weights", nbytes) if nbytes else None
        a_operand, a_scales = self._activations(a)
        return ((a_operand, a_scales, w.packed, w.scales, w.alpha, routing.expert_offsets, routing.blockscale_offsets),
                (cfg, partials, dense))

    def _grouped_gemm(self, a, w, routing, out, scratch, config, silu=None, fixup=False):
        operands, (cfg, partials, dense) = self._gemm_operands(a, w, routing, scratch, config)
        return kernels().grouped_gemm_launcher(*operands, out, cfg, partials, silu, dense, fixup)

    def _gemm_reduce(self, b: PlanBuffers, config, fuse: bool, in_gemm: bool = False):
        """``(gemm, reduce)``: the plan's second GEMM (into ``b.y``) and top-k reduce, with ``fuse`` and
        ``in_gemm`` as ``grouped_gemm_reduce_launcher`` prepares them (one launch fewer where the GEMM splits
        K; with ``in_gemm``, one launch in all)."""
        operands, (cfg, partials, dense) = self._gemm_operands(b.a2, b.w2, b.routing, b.scratch, config)
        return kernels().grouped_gemm_reduce_launcher(*operands, b.y, b.routing.flat_to_slot,
                                                      not b.apply_router_weight_on_input, b.num_tokens, cfg, partials,
                                                      dense, fuse, in_gemm)

    @staticmethod
    def _activations(a):
        """The GEMM's activation operand: packed codes and their grouped scales."""
        return a.packed, a.scales

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

    def _bound_gemm(self, a, w, routing, out, scratch, silu=None, split_only=False):
        """The GEMM of a plan and a ``fused()`` that says whether its last call took the SiLU-and-mul
        quantization: the table's configuration, or the one pinned (:func:`pinned_gemm_config`)
        around the call, each prepared the first time it is used (the table's at once with
        :data:`FUSE_SPLIT_K_IN_GEMM`, whose launch holds counters). ``silu = (values, gs, h_dtype)``:
        where the configuration can (``silu_fusable``; with ``split_only``, only where it also splits K),
        the quantization in the epilogue, writing ``values`` instead of ``out`` (``silu=`` of
        ``grouped_gemm_launcher``)."""
        tk = kernels()
        table = tk.gemm_config(a.rows, w.E, self.values, w.N, a.device, w.K)
        last = [None, None, False]  # the last call's configuration, its launch, whether it fuses (under a lock)
        fixup = FUSE_SPLIT_K_IN_GEMM
        prepared: dict = {}  # configuration -> (launch, fuses): each prepared once (a fixup's counters stay zero)

        def prepare(cfg) -> None:
            if cfg not in prepared:
                fuses = (silu is not None and tk.silu_fusable(cfg, self.values, w.N, w.scales.shape[1])
                         and (not split_only or tk.k_ranges(cfg, a.rows, w.E, w.N, w.K, a.device)[0] > 1))
                prepared[cfg] = (self._grouped_gemm(a, w, routing, silu[0] if fuses else out, scratch, cfg,
                                                    silu[1:] if fuses else None, fixup), fuses)
            last[:] = cfg, *prepared[cfg]

        if fixup:  # now, not at a first call that may be inside a CUDA-graph capture: it zeroes counters
            prepare(table)

        def gemm(stream) -> None:
            pinned = tk.pinned_config()
            cfg = table if pinned is None else pinned
            if cfg is not last[0]:
                prepare(cfg)
            last[1]()

        return gemm, lambda: last[2]

    def _bound_gemm_reduce(self, b: PlanBuffers):
        """The plan's second GEMM and top-k reduce (:meth:`_gemm_reduce`), for the table's configuration or
        the one pinned around the call, each prepared the first time it is used (the table's at once with
        :data:`FUSE_TOPK_IN_GEMM`, whose launch holds counters): ``(gemm2, moe_reduce)``.
        ``gemm2`` launches the GEMM of the call's configuration; ``moe_reduce`` the reduce of the pair whose
        GEMM ran last (a pin that changes between the two calls cannot part them)."""
        tk = kernels()
        a, w = b.a2, b.w2
        table = tk.gemm_config(a.rows, w.E, self.values, w.N, a.device, w.K)
        fuse = FUSE_TOPK_REDUCE
        in_gemm = FUSE_TOPK_IN_GEMM and b.num_tokens * b.topk <= TOPK_IN_GEMM_MAX
        last = [None, None]  # the last call's configuration and its (gemm, reduce) (under a lock)
        launched = [None]  # the pair whose GEMM ran last: its reduce reads that GEMM's partials
        prepared: dict = {}  # configuration -> (gemm, reduce): each prepared once (in-GEMM counters stay zero)

        def prepare(cfg) -> None:
            if cfg not in prepared:
                prepared[cfg] = self._gemm_reduce(b, cfg, fuse, in_gemm)
            last[:] = cfg, prepared[cfg]

        if in_gemm:  # now, not at a first call that may be inside a CUDA-graph capture: it zeroes counters
            prepare(table)

        def current() -> tuple:
            pinned = tk.pinned_config()
            cfg = table if pinned is None else pinned
            if cfg is not last[0]:
                prepare(cfg)
            return last[1]

        def gemm(stream) -> None:
            launched[0] = current()
            launched[0][0]()

        def reduce(topk_weights, out, stream) -> None:
            (launched[0] or current())[1](topk_weights, out)

        return gemm, reduce

    def _bound_gemm1(self, b: PlanBuffers) -> tuple:
        """The plan's first GEMM and SiLU-and-mul quantization: ``(gemm1, silu_mul_quantize)``."""
        silu = self._silu_mul_quantize(b.h, b.gs2, b.routing, b.a2, None)
        return self._bound_gemm(b.a1, b.w13, b.routing, b.h, b.scratch)[0], lambda stream: silu()

    def bind(self, b: PlanBuffers) -> BoundStages:
        """A plan's launches: these methods' launches prepared for the plan's buffers. Where the second GEMM
        splits K (decode), its K ranges' sum and the top-k reduce are one launch
        (``grouped_gemm_reduce_launcher``, with :data:`FUSE_TOPK_REDUCE`), writing the same output; ``y``
        is then not written. With :data:`FUSE_SPLIT_K_IN_GEMM` / :data:`FUSE_TOPK_IN_GEMM` the GEMMs' own
        launches take those reduces (``y`` written, no reduce launched after the second GEMM)."""
        route = self._routing(b.num_tokens * b.topk, b.routing, b.scratch)
        quantize = self._quantize_rows(b.num_tokens, b.a1.K, b.gs13, b.routing, True, b.apply_router_weight_on_input,
                                       b.a1, None)
        gemm1, silu_mul_quantize = self._bound_gemm1(b)
        gemm2, reduce = self._bound_gemm_reduce(b)
        runner = _triton_batch.runner() if b.device.type == "cuda" else None
        return BoundStages(
            routing=lambda topk_ids, stream: route(topk_ids),
            quantize_rows=lambda x, row_scale, stream: quantize(x, row_scale),
            gemm1=gemm1,
            silu_mul_quantize=silu_mul_quantize,
            gemm2=gemm2,
            moe_reduce=reduce,
            # (replayed only while no GEMM configuration is pinned: the bound GEMMs read the pin per call)
            batch=None if runner is None else kernels().LaunchBatch(runner, steady=_no_pin(kernels().pinned_config)),
        )


def _dense_scratch_nbytes(tk, cfg, config, rows, w, device) -> int:
    """Bytes of the dense GEMM's weight scratch (0: ``cfg`` is not dense) for this GEMM of a layer and the
    other one, gate/up ``[E, 2I, H]`` (``w.S == 2``) and down ``[E, H, I]``, on the same rows (the other's
    configuration: ``config``, else the pinned or the table's): the larger of the two, so that the layer's
    two GEMMs, which run in turn, take one buffer (a workspace keeps every buffer it hands out). 0 when
    this GEMM's own configuration is not dense."""
    own = tk.dense_nbytes(cfg, rows, w.E, w.N, w.K, device)
    if not own:
        return 0
    n, k = (w.K, w.N // 2) if w.S == 2 else (2 * w.K, w.N)
    return max(own, tk.dense_nbytes(config, rows, w.E, n, k, device))


class _ValuesKernels(_Kernels):
    """:class:`_Kernels` for :data:`STAGES_VALUES`: the quantization stages write the fp16 values of the
    NVFP4 rows (no codes), and the GEMM multiplies them with K16-layout weights dequantized in registers."""

    values = True  # the GEMM's launch table: GEMM_VALUES_CONFIGS
    raw = False  # the row stages write the 16-bit rows unquantized (w4a16)

    def _quantize_rows(self, x_rows, k, gs, routing, gather, has_row_scale, out, config):
        _check_config(config, "QuantConfig")
        return kernels().quantize_rows_values_launcher(x_rows, k, gs, routing.expert_offsets,
                                                       routing.slot_to_flat if gather else None, has_row_scale,
                                                       out.values, config, self.raw)

    def _silu_mul_quantize(self, h, gs, routing, out, config):
        _check_config(config, "QuantConfig")
        return kernels().silu_mul_quantize_values_launcher(h, gs, routing.expert_offsets, out.values, config,
                                                           self.raw)

    @staticmethod
    def _activations(a):
        """The fp16 values (no scales: the GEMM takes values and K16 weights)."""
        return a.values, None

    def _bound_gemm1(self, b: PlanBuffers) -> tuple:
        """:meth:`_Kernels._bound_gemm1`, with :data:`FUSE_SILU` the SiLU-and-mul quantization in the first GEMM
        where its configuration takes it (the quantization's launch then skipped)."""
        gemm1, fused_silu = self._bound_gemm(b.a1, b.w13, b.routing, b.h, b.scratch,
                                             (b.a2.values, b.gs2, b.h.dtype) if FUSE_SILU else None,
                                             FUSE_SILU == "split")
        silu = self._silu_mul_quantize(b.h, b.gs2, b.routing, b.a2, None)

        def silu_mul_quantize(stream) -> None:
            if not fused_silu():
                silu()

        return gemm1, silu_mul_quantize

    def bind(self, b: PlanBuffers) -> BoundStages:
        """:meth:`_Kernels.bind`, with fewer launches: at decode (``M * topk <= FUSED_ROUTING_MAX``) the
        routing and the first quantization in one launch (``routing_quantize_values_launcher``), and with
        :data:`FUSE_SILU` the SiLU-and-mul quantization in the first GEMM's epilogue where its configuration
        can take it (``"split"``: only where it splits K; :meth:`_bound_gemm`), writing the same bytes as the
        launches they replace."""
        bound = super().bind(b)
        r = b.routing
        fused = kernels().routing_quantize_values_launcher(
            b.num_tokens, b.a1.K, b.gs13, r.expert_offsets, r.blockscale_offsets, r.slot_to_flat, r.flat_to_slot,
            b.apply_router_weight_on_input, b.a1.values, raw=self.raw)
        if fused is None:
            return bound
        return with_fused_routing(bound, lambda topk_ids, x, row_scale, stream: fused(topk_ids, x, row_scale))


class _ValuesW4A16Kernels(_ValuesKernels):
    """:class:`_ValuesKernels` for :data:`STAGES_VALUES_W4A16` (``precision="w4a16"``): the row stages write
    the routed rows and the SiLU-and-mul product unquantized, in the model's dtype (the quantization kernels'
    ``RAW`` form: what :func:`moe_fp4.stages.w4a16_rows` and :func:`moe_fp4.stages.w4a16_silu_mul` write), and
    the values GEMM multiplies those rows (bf16 rows with the weight tiles converted to bf16, exactly) with the
    W4A16 alphas. The plans fuse as W4A4's do (the routing with the first row stage at decode, the reduces in
    the GEMMs where switched on) but for the SiLU-and-mul quantization in the first GEMM, which quantizes."""

    raw = True

    def quantize_rows(self, x, gs, routing, gather, row_scale, out, config) -> None:
        _values_of(out, x)  # (the values hold the rows themselves: the rows' dtype)
        super().quantize_rows(x, gs, routing, gather, row_scale, out, config)

    def silu_mul_quantize(self, h, gs, routing, out, config) -> None:
        _values_of(out, h)
        super().silu_mul_quantize(h, gs, routing, out, config)

    def _bound_gemm1(self, b: PlanBuffers) -> tuple:
        return _Kernels._bound_gemm1(self, b)


def _k16_relayout(codes, scales, out_codes, out_scales) -> None:
    """:meth:`NvFp4Experts.in_layout`'s ``relayout`` for :data:`STAGES_VALUES`: the codes in the K16
    layout (expert by expert, to bound the temporaries), the scales swizzled as :data:`STAGES` has them."""
    _k16_experts(codes, out_codes)
    _swizzle_relayout(codes, scales, None, out_scales)


def _k16_experts(codes, out):
    """``out[e] = k16_codes(codes[e])`` expert by expert (temporaries of one expert's size); returns ``out``."""
    for e in range(codes.shape[0]):
        out[e] = kernels().k16_codes(codes[e])
    return out


def _k16_restore(codes, scales):
    codes, scales = _swizzle_restore(codes, scales)
    return kernels().k16_restore(codes), scales


def _prepare_k16_w4a16(experts) -> tuple[K16Weights, K16Weights]:
    """The weights of :data:`STAGES_VALUES_W4A16`: :data:`STAGES_VALUES`' (the same codes and scales, one
    copy for both precisions) with the W4A16 alphas."""
    w13, w2 = STAGES_VALUES.weights(experts)
    alpha13, alpha2 = experts.alphas("w4a16")
    return (dataclasses.replace(w13, alpha=alpha13.contiguous()),
            dataclasses.replace(w2, alpha=alpha2.reshape(-1, 1).contiguous()))


def _prepare_k16(experts) -> tuple[K16Weights, K16Weights]:
    """The weights of :data:`STAGES_VALUES`: in place of the canonical ones where
    :meth:`~moe_fp4.NvFp4Experts.in_layout` allows and the swizzled scales need no padding (one
    resident copy), else a copy; the W4A4 alphas."""
    alpha13, alpha2 = experts.alphas()
    E, H, I = experts.sizes()  # noqa: E741
    if H % 64 or I % 64:
        raise ValueError(f"experts: the K16 layout needs the hidden and intermediate sizes to be multiples of 64, "
                         f"got H = {H}, I = {I}")
    if swizzled_shape(I, H // 16) == (I, H // 16) and swizzled_shape(H, I // 16) == (H, I // 16):
        w13, s13, w2, s2 = experts.in_layout("triton-k16", _k16_relayout, _k16_restore)
        return (K16Weights(w13, s13.view(E, 2, I, H // 16), alpha13.contiguous()),
                K16Weights(w2, s2.view(E, 1, H, I // 16), alpha2.reshape(-1, 1).contiguous()))
    w13, w2 = WeightOperand.build(experts.w13, experts.w13_scale, alpha13), \
        WeightOperand.build(experts.w2, experts.w2_scale, alpha2.reshape(-1, 1))
    return (K16Weights(_k16_experts(w13.packed, torch.empty_like(w13.packed)), w13.scales, w13.alpha),
            K16Weights(_k16_experts(w2.packed, torch.empty_like(w2.packed)), w2.scales, w2.alpha))


STAGES = StageSet.from_kernels("triton", _Kernels())
# W4A4 with the activation operand as fp16 values (whatever the model's dtype: fp16 holds every
# NVFP4 value exactly), so the GEMM dequantizes only the weights (issue #11). Needs H and I
# multiples of 64. The default on 9.x GPUs (:func:`operand_form` "auto").
STAGES_VALUES = StageSet.from_kernels("triton-values", _ValuesKernels(), weight_types=(K16Weights,),
                                      activation_values=True, activation_codes=False, values_dtype=torch.float16,
                                      prepare_weights=_prepare_k16, weights_key="triton-k16")
# precision="w4a16": the values GEMM on the rows themselves (bf16 or fp16, the model's dtype), not quantized;
# the weights' alphas only (1 / gs_w). On every GPU the backend serves (off Hopper with the values GEMM's
# portable table, GEMM_VALUES_PORTABLE_CONFIGS: compiled for sm_80, sm_100 and sm_120, never run there) and the CPU
# interpreter; H and I multiples of 64.
STAGES_VALUES_W4A16 = StageSet.from_kernels("triton-values-w4a16", _ValuesW4A16Kernels(), weight_types=(K16Weights,),
                                            activation_values=True, activation_codes=False, precision="w4a16",
                                            prepare_weights=_prepare_k16_w4a16,
                                            weights_key="triton-k16-w4a16")

routing = STAGES.routing
quantize_rows = STAGES.quantize_rows
silu_mul_quantize = STAGES.silu_mul_quantize
grouped_gemm = STAGES.grouped_gemm
moe_reduce = STAGES.moe_reduce


OPERAND_FORMS = ("auto", "codes", "values")
_OPERAND: contextvars.ContextVar[str | None] = contextvars.ContextVar("moe_fp4_triton_operand", default=None)


@contextlib.contextmanager
def operand_form(form: str) -> Iterator[None]:
    """Within the block, :func:`fused_moe` runs with the activation operand ``form``: ``"codes"``
    (:data:`STAGES`: the GEMMs dequantize packed NVFP4 activations), ``"values"``
    (:data:`STAGES_VALUES`: fp16 values, only the weights dequantized; H and I multiples of 64,
    compute capability 9.x or the CPU interpreter) or ``"auto"``: values on a 9.x GPU where H and
    I allow them (faster there, or within 0.5%, at every M measured: ``benchmarks/README.md``), codes
    elsewhere.
    Outside any block the form is ``$MOE_FP4_TRITON_OPERAND``, else ``"auto"``. Both compute
    W4A4 (the same products; the GEMMs sum them in another order)."""
    token = _OPERAND.set(_check_form("form", form))
    try:
        yield
    finally:
        _OPERAND.reset(token)


def _check_form(name: str, form: object) -> str:
    if form not in OPERAND_FORMS:
        raise ValueError(f"{name}: expected one of {OPERAND_FORMS}, got {form!r}")
    return form


@functools.cache
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def _form() -> str:
    form = _OPERAND.get()
    if form is None:
        form = _check_form("MOE_FP4_TRITON_OPERAND", os.environ.get("MOE_FP4_TRITON_OPERAND") or "auto")
    return form


def _values_device(device: torch.device) -> bool:
    """Whether ``"auto"`` picks the values operand on ``device`` (a 9.x GPU)."""
    return device.type == "cuda" and _is_sm90(device)


def stages_for(device: torch.device, precision: str = "w4a4") -> StageSet:
    """The stage set of the current :func:`operand_form` on ``device`` (``"auto"``: as for a layer whose
    H and I are multiples of 64; ``device`` and ``precision``: the signature the cutlass backend's
    ``stages_for`` has; ``"w4a16"``: :data:`STAGES_VALUES_W4A16`, on the values operand only)."""
    form = _form()
    if check_precision(precision) == "w4a16":
        _check_w4a16(form)
        return STAGES_VALUES_W4A16
    return STAGES_VALUES if form == "values" or (form == "auto" and _values_device(device)) else STAGES


def layer_unserved(precision: str, hidden_size: int, intermediate_size: int) -> str | None:
    """Why this backend cannot compute ``precision`` for a layer of these sizes on a device where it computes
    it (None: it can; the registry's :func:`~moe_fp4.backends.registry.layer_unserved`, whose answers are
    cached per layer, so this depends on the sizes alone). W4A4: always (the codes operand takes any sizes).
    W4A16: not for sizes that are not multiples of 64 (the K16 weight layout); ``backend="auto"`` then takes
    the next backend of the device's order. (A pinned codes form refuses W4A16 when the stages are chosen:
    :func:`stages_for_problem`.)"""
    if precision != "w4a16":
        return None
    if hidden_size % 64 or intermediate_size % 64:
        return (f"the K16 weight layout needs the hidden and intermediate sizes to be multiples of 64, got "
                f"H = {hidden_size}, I = {intermediate_size}")
    return None


def _check_w4a16(form: str) -> None:
    """ValueError where ``precision="w4a16"`` cannot run: it multiplies the rows on the values operand's GEMM
    (on Hopper with its own table, elsewhere with :data:`GEMM_VALUES_PORTABLE_CONFIGS`), so not with the codes
    form pinned."""
    if form == "codes":
        raise ValueError("precision: the Triton backend computes 'w4a16' on its values operand (16-bit rows), "
                         "but operand_form 'codes' (NVFP4 activation codes) is pinned")


def stages_for_problem(problem) -> StageSet:
    """The stage set :func:`fused_moe` runs ``problem`` with (:func:`operand_form`); a ValueError
    where the form asked for cannot run. ``problem.precision`` ``"w4a16"``: :data:`STAGES_VALUES_W4A16`, where
    the values operand runs."""
    form = _form()
    _, H, I = problem.experts.sizes()  # noqa: E741
    device = problem.hidden_states.device
    if problem.precision == "w4a16":
        _check_w4a16(form)
        why = layer_unserved("w4a16", H, I)
        if why is not None:
            raise ValueError(f"experts: the Triton backend computes 'w4a16' on its values operand: {why}")
        return STAGES_VALUES_W4A16
    if form == "codes":
        return STAGES
    if form == "auto":
        return STAGES_VALUES if _values_device(device) and H % 64 == 0 and I % 64 == 0 else STAGES
    if H % 64 or I % 64:
        raise ValueError(f"experts: the Triton values operand (operand_form 'values') needs the hidden and "
                         f"intermediate sizes to be multiples of 64 (the K16 weight layout), got H = {H}, I = {I}")
    if device.type == "cuda" and not _is_sm90(device):
        raise ValueError(f"hidden_states: the Triton values operand (operand_form 'values') is built and checked "
                         f"for compute capability 9.x (wgmma; its 64x128 tile spills on sm_80), not {device}")
    return STAGES_VALUES


def pinned_gemm_config(config):
    """Within the block, the GEMMs of :func:`fused_moe` run with ``config`` (a ``GemmConfig``), not the table's."""
    return kernels().pinned_gemm_config(config)


def fused_moe(problem) -> torch.Tensor:
    """The MoE forward of ``moe_fp4.fused_moe`` (``problem`` is a validated ``MoEProblem``).

    Triton launches on the current device: the problem's device is made current for the call
    when it is not (tensors on ``cuda:1`` with ``cuda:0`` current, as under a ``device_map``)."""
    x = problem.hidden_states
    stages = stages_for_problem(problem)
    if x.is_cuda and torch._C._cuda_getDevice() != x.get_device():  # (current_device() without its lazy-init check)
        with torch.cuda.device(x.device):
            return run_cached(stages, problem)
    return run_cached(stages, problem)
