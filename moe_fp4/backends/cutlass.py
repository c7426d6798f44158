"""The ``cutlass`` backend: CUDA pipeline kernels and NVFP4 grouped GEMMs of ``libmoe_fp4_cuda.so``.

Everything runs in the library (:mod:`moe_fp4._native`, loaded on first use); :data:`STAGES`
wraps its entries in the checked stage functions of :mod:`moe_fp4.pipeline` (also exported
here by name), so each stage can be compared with the torch reference
(:mod:`moe_fp4.stages`) and with the Triton backend's stage of the same name:

* ``routing``, ``quantize_rows``, ``silu_mul_quantize``, ``moe_reduce``: on any GPU from
  SM90 (sm_90a, sm_100a and sm_120f SASS, compute_90 PTX elsewhere). On CPU tensors the
  three element-wise ones run the library's host oracle, the very same kernel body executed
  serially on the host (a test path; ``routing`` has none). ``moe_reduce`` may also write
  float32.
* ``grouped_gemm``: the CUTLASS NVFP4 grouped GEMMs for SM100 (sm_100a) and SM120/SM121
  (sm_120f); elsewhere it raises :class:`~moe_fp4.errors.BackendUnavailableError` saying why.
* :data:`STAGES_SM90`: the same pipeline kernels with the library's own sm_90a GEMM (H100,
  H200): Hopper has no FP4 tensor cores, so the quantization stages also write the rows'
  exact 16-bit values (``Quantized.values``) and the GEMM multiplies them with the weights,
  which it dequantizes in registers from a layout prepared once per experts
  (:func:`sm90_weights`, the same byte sizes as the NVFP4 weights).
* :data:`STAGES_SM90_W4A16`: ``precision="w4a16"`` on the same sm_90a GEMM, which takes 16-bit
  activations anyway: the row stages are the same kernels with no global scale (ABI 9), which
  write the rows unquantized into ``Quantized.values`` (what :func:`moe_fp4.stages.w4a16_rows`
  and :func:`moe_fp4.stages.w4a16_silu_mul` write), routing fused with the first at decode as
  for W4A4; the GEMMs run on the same prepared weights with alpha ``1/gs_w``
  (:func:`_prepare_sm90_w4a16`). On Blackwell the
  block-scaled FP4 tensor-core GEMM needs FP4 activations: no W4A16 there.

:func:`fused_moe` runs :func:`~moe_fp4.pipeline.run_pipeline` on a cached workspace
(:func:`~moe_fp4.pipeline.run_cached`); it never synchronizes with the host.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from .. import _native
from .._checks import check_precision, check_same_device, check_tensor
from ..buffers import Sm90Weights
from ..pipeline import BoundStages, PlanBuffers, StageSet, run_cached, stream_handle, with_fused_routing

__all__ = [
    "STAGES",
    "STAGES_SM90",
    "STAGES_SM90_W4A16",
    "FUSED_ROUTING_MAX",
    "sm90_weights",
    "sm90_restore",
    "stages_for",
    "why_unavailable",
    "library_summary",
    "fused_moe",
    "routing",
    "quantize_rows",
    "silu_mul_quantize",
    "grouped_gemm",
    "moe_reduce",
]

_ROW_DTYPES = {torch.bfloat16: _native.BF16, torch.float16: _native.FP16}
# Slots (M * topk) up to which a W4A4 plan on sm_90a routes and quantizes in one launch (at most
# _native.ROUTING_QUANTIZE_MAX_SLOTS, the kernel's limit). The fused kernel lets the first GEMM start
# only when it ends (the GEMM reads the routing before its own wait), where the quantization kernel
# let it start early. Measured on the H200 in one process, fused against two launches, whole forward
# µs (benchmarks/fusion_ab.py --backend cutlass, tests/results/h200-2026-12-04-s19/call2-3): faster
# at 19 of 21 decode shapes, e.g. Qwen3-30B-A3B M = 1 33.8 -> 32.0, M = 32 (256 slots) 142.6 -> 137.6,
# DeepSeek-V3 M = 1 112.3 -> 98.8, Llama-4-Scout M = 128 444.0 -> 409.5 (its first GEMM runs faster
# when it starts after the fused kernel than when it starts early, during the quantization);
# slower at Llama-4-Scout M = 8 (201.2 -> 208.2) and M = 16 (289.2 -> 300.7), where it is the
# reverse (benchmarks/README.md, nineteenth session).
FUSED_ROUTING_MAX = 256
# A plan on sm_90a runs the first GEMM with SiLU-and-mul (and, W4A4, the second quantization) in its
# epilogue (moe_fp4_sm90_gemm_silu) where the GEMM takes the 8-token tile: one launch and one round
# trip of the [slots, 2I] product fewer, the same bits (the layout interleaves w13's gate and up rows
# so that the epilogue tile holds both values of a column). The library builds that epilogue into the
# 8-token tile's kernels, which its heuristic takes up to 4 rows per expert (the header's contract of
# moe_fp4_sm90_gemm_tile_tokens; tests/test_native.py checks that the two agree), so the second GEMM
# runs the same kernel. Measured on the H100 (benchmarks/fusion_ab.py, tests/results/h100-2026-12-06-s32,
# whole forward, µs, the plain kernels' unfused forward -> fused in the kernel both GEMMs share):
# faster at 1-4 rows per expert (Qwen3-30B-A3B M = 1 33.8 -> 32.0, M = 16 124.3 -> 120.3, M = 64
# 169.0 -> 165.8; DeepSeek-V3 M = 1-128 but 4; Llama-4-Scout M = 1 and 8-64), level at Qwen3 M = 2, slower
# at Llama-4-Scout M = 2 and 4 (91.0 -> 93.8, 117.6 -> 125.1); at 8-16 rows (the 16- and 32-token
# tiles) slower (Qwen3 M = 256 186.3 -> 198.8), so those tiles hold no fused epilogue. Where the second GEMM's
# plan splits K through its workspace (Llama-4-Scout M = 2 to 4 on the three layers) it runs a kernel other
# than the plain fused one, and the fusion lost there (tests/results/h100-2026-12-06-s34, call s34a, best of two
# rounds, unfused -> fused: M = 2 91.0 -> 92.4, M = 4 118.5 -> 125.7), so from session 34 those plans ran
# unfused; the library now runs such a fused first GEMM in the second GEMM's kernel (launch_small in
# gemm_sm90.cu), and the fusion gains there too (tests/results/h100-2026-12-06-s36, call s36b, two rounds,
# unfused -> fused: M = 2 90.8 / 90.8 -> 86.1 / 86.4 µs, M = 4 118.9 / 118.6 -> 112.7 / 113.2).
FUSE_SILU = True
SILU_MAX_ROWS_PER_EXPERT = 4
# The token-tile widths of the sm_90a grouped GEMM (csrc/gemm_sm90.cu, dispatch), for a stage's `config`.
SM90_TILE_TOKENS = (8, 16, 32, 48, 64, 80, 96, 112, 128)
_OUT_DTYPES = {**_ROW_DTYPES, torch.float32: _native.FP32}


def why_unavailable(device: torch.device, capability: tuple[int, int] | None) -> str | None:
    """None when the library loads and holds grouped-GEMM code for ``capability``, else why not."""
    try:
        lib = _native.library()
    except _native.LibraryUnavailable as exc:
        return str(exc)
    if device.type != "cuda" or capability is None:
        return "runs on CUDA devices only"
    return lib.serves(_native.GEMM, capability)


def library_summary() -> str:
    """What ``moe-fp4 info`` prints about the CUDA library: its path and what it was built for."""
    try:
        lib = _native.library()
    except _native.LibraryUnavailable as exc:
        return f"CUDA library: unavailable: {exc}"
    gemms = lib.archs(_native.GEMM)
    return "\n".join(
        [
            f"CUDA library: {lib.path} (ABI {_native.ABI_VERSION})",
            "  pipeline kernels (routing, quantization, SiLU-mul, reduce): " + ", ".join(lib.archs(_native.PIPELINE)),
            "  NVFP4 grouped GEMMs: " + (", ".join(gemms) if gemms else "none (built without SM100/SM120 targets)"),
        ]
    )


# --------------------------------------------------------------------------- helpers


def _device(device: torch.device) -> int:
    """The library's ``device`` argument for a call on ``device``: its CUDA ordinal, or HOST (the host oracle)."""
    if device.type == "cuda":
        return device.index
    if device.type == "cpu":
        return _native.HOST
    raise ValueError(f"{device}: expected a CUDA or CPU tensor")


def _require_cuda(name: str, t: torch.Tensor, why: str) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor ({why}), got one on {t.device}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None or t.numel() == 0 else t.data_ptr()


def _no_config(config: object) -> None:
    if config is not None:
        raise TypeError(f"config: the cutlass stages take no launch configuration, got {type(config).__name__}")


class _Kernels:
    """The library's entries as :class:`~moe_fp4.pipeline.StageKernels`.

    Each stage has one method that binds its entry (:meth:`~moe_fp4._native.NativeLibrary.bind`,
    arguments named as in the header) to everything but the pointers that change per forward
    and the stream: the stage methods call it at once, :meth:`bind` keeps it for a plan. A
    scratch buffer is held by its bound entry (a stage call without a workspace allocates one
    that nothing else holds: freed before the launch, the kernel would write freed memory, as
    compute-sanitizer's memcheck found with the caching allocator off).
    """

    codes = True  # the quantization kernels write packed codes and swizzled scales (the FP4 GEMM's operand)
    quantizes = True  # False: the row stages write the rows unquantized (W4A16; the kernels then take no gs)

    def _gs(self, gs: torch.Tensor) -> int | None:
        """The row stages' ``gs`` argument: the global scales, or NULL for the unquantized W4A16 rows."""
        return _ptr(gs) if self.quantizes else None

    def _outputs(self, out) -> dict[str, int | None]:
        """The quantization kernels' output pointers: values when allocated; codes and scales if :attr:`codes`
        (without them the kernel runs over the slots alone, not over every padded scale row)."""
        return dict(packed=_ptr(out.packed) if self.codes else None, scales=_ptr(out.scales) if self.codes else None,
                    scale_rows=out.scales.shape[0], values=_ptr(out.values))

    # ------------------------------------------------------------------ entries, bound

    def _routing(self, out, scratch) -> _native.BoundEntry:
        """Free: ``topk_ids``, ``stream``."""
        lib = _native.library()
        n, E = out.num_slots, out.num_experts
        ws = scratch("routing", lib.size_query("moe_fp4_routing_workspace_size", num_slots=n, num_experts=E))
        return lib.bind(
            "moe_fp4_routing", num_slots=n, num_experts=E,
            expert_offsets=_ptr(out.expert_offsets), blockscale_offsets=_ptr(out.blockscale_offsets),
            slot_to_flat=_ptr(out.slot_to_flat), flat_to_slot=_ptr(out.flat_to_slot),
            workspace=_ptr(ws), workspace_bytes=ws.numel(), device=_device(out.device), _keep=(ws,),
        )

    def _quantize_rows(self, x_rows: int, k: int, dtype: torch.dtype, gs, routing, gather: bool,
                       out) -> _native.BoundEntry:
        """Rows ``x [x_rows, k]`` of ``dtype``. Free: ``x``, ``row_scale``, ``stream``."""
        n = routing.num_slots
        return _native.library().bind(
            "moe_fp4_quantize_rows", x_dtype=_ROW_DTYPES[dtype], x_rows=x_rows, k=k,
            slot_to_flat=_ptr(routing.slot_to_flat) if gather else None,
            topk=n // x_rows if gather and x_rows else 1,
            num_slots=n, gs=self._gs(gs), expert_offsets=_ptr(routing.expert_offsets),
            blockscale_offsets=_ptr(routing.blockscale_offsets), num_experts=routing.num_experts,
            **self._outputs(out), device=_device(out.device),
        )

    def _silu_mul_quantize(self, h, gs, routing, out, config) -> _native.BoundEntry:
        """Free: ``stream``."""
        _no_config(config)
        return _native.library().bind(
            "moe_fp4_silu_mul_quantize", h=_ptr(h), h_dtype=_ROW_DTYPES[h.dtype], num_slots=h.shape[0],
            inter=h.shape[1] // 2, gs=self._gs(gs), expert_offsets=_ptr(routing.expert_offsets),
            blockscale_offsets=_ptr(routing.blockscale_offsets), num_experts=routing.num_experts,
            **self._outputs(out), device=_device(h.device),
        )

    def _grouped_gemm(self, a, w, routing, out, scratch, config) -> _native.BoundEntry:
        """Free: ``stream``."""
        _no_config(config)
        if w.S not in (1, 2):
            raise ValueError(f"w: expected 1 (w2) or 2 (w13: gate, up) sections in the CUTLASS GEMM, got {w.S} "
                             f"(scales of shape {list(w.scales.shape)})")
        _require_cuda("a", a.packed, "the grouped GEMM runs on SM100/SM120 GPUs")
        lib = _native.library()
        device = _device(a.packed.device)
        dtype = _ROW_DTYPES[out.dtype]
        ws = scratch("gemm", lib.size_query("moe_fp4_grouped_gemm_workspace_size", num_experts=w.E, sections=w.S,
                                            out_dtype=dtype, device=device))
        return lib.bind(
            "moe_fp4_grouped_gemm", a=_ptr(a.packed), a_scales=_ptr(a.scales), a_rows=a.rows,
            a_scale_rows=a.scales.shape[0], b=_ptr(w.packed), b_scales=_ptr(w.scales), alpha=_ptr(w.alpha),
            num_experts=w.E, sections=w.S, n=w.N, k=w.K, expert_offsets=_ptr(routing.expert_offsets),
            blockscale_offsets=_ptr(routing.blockscale_offsets), out=_ptr(out), out_dtype=dtype,
            workspace=_ptr(ws), workspace_bytes=ws.numel(), device=device, _keep=(ws,),
        )

    def _moe_reduce(self, y, routing, num_tokens: int, out_dtype: torch.dtype) -> _native.BoundEntry:
        """Into ``out [num_tokens, H]`` of ``out_dtype``. Free: ``topk_weights``, ``out``, ``stream``."""
        return _native.library().bind(
            "moe_fp4_moe_reduce", y=_ptr(y), y_dtype=_ROW_DTYPES[y.dtype], y_rows=y.shape[0], hidden=y.shape[1],
            flat_to_slot=_ptr(routing.flat_to_slot), num_tokens=num_tokens, topk=routing.num_slots // num_tokens,
            out_dtype=_OUT_DTYPES[out_dtype], device=_device(y.device),
        )

    # ------------------------------------------------------------------ StageKernels

    def routing(self, topk_ids, out, scratch) -> None:
        _require_cuda("topk_ids", topk_ids, "routing runs on the GPU; stages.routing is the CPU reference")
        self._routing(out, scratch)(_ptr(topk_ids), stream_handle(topk_ids.device))

    def quantize_rows(self, x, gs, routing, gather, row_scale, out, config) -> None:
        _no_config(config)
        entry = self._quantize_rows(x.shape[0], x.shape[1], x.dtype, gs, routing, gather, out)
        entry(_ptr(x), _ptr(row_scale), stream_handle(x.device))

    def silu_mul_quantize(self, h, gs, routing, out, config) -> None:
        self._silu_mul_quantize(h, gs, routing, out, config)(stream_handle(h.device))

    def grouped_gemm(self, a, w, routing, out, scratch, config) -> None:
        self._grouped_gemm(a, w, routing, out, scratch, config)(stream_handle(a.device))

    def moe_reduce(self, y, routing, topk_weights, out) -> None:
        self._moe_reduce(y, routing, out.shape[0], out.dtype)(_ptr(topk_weights), _ptr(out), stream_handle(y.device))

    def bind(self, b: PlanBuffers) -> BoundStages:
        """A plan's launches: these entries bound to the plan's buffers (what the methods above pass)."""
        route = self._routing(b.routing, b.scratch)
        quantize = self._quantize_rows(b.num_tokens, b.a1.K, b.dtype, b.gs13, b.routing, True, b.a1)
        reduce = self._moe_reduce(b.y, b.routing, b.num_tokens, b.dtype)
        return BoundStages(
            routing=lambda topk_ids, stream: route(topk_ids.data_ptr(), stream),
            quantize_rows=lambda x, row_scale, stream: quantize(x.data_ptr(), _ptr(row_scale), stream),
            gemm1=self._grouped_gemm(b.a1, b.w13, b.routing, b.h, b.scratch, None),
            silu_mul_quantize=self._silu_mul_quantize(b.h, b.gs2, b.routing, b.a2, None),
            gemm2=self._grouped_gemm(b.a2, b.w2, b.routing, b.y, b.scratch, None),
            moe_reduce=lambda topk_weights, out, stream: reduce(_ptr(topk_weights), out.data_ptr(), stream),
        )


class _Sm90Kernels(_Kernels):
    """The same pipeline kernels with the sm_90a GEMM, which multiplies the activations' exact 16-bit values
    (so the quantization kernels write those values only). A plan of at most :data:`FUSED_ROUTING_MAX` slots
    routes and quantizes in one launch (``moe_fp4_routing_quantize_values``, the same bytes as the two)."""

    codes = False
    fuses_routing = True

    def bind(self, b: PlanBuffers) -> BoundStages:
        bound = super().bind(b)
        r = b.routing
        if fuses_silu(r.num_slots, r.num_experts):
            bound = bound._replace(gemm1=self._gemm1_silu(b.a1, b.w13, b.gs2, r, b.a2), silu_mul_quantize=_nothing)
        if not self.fuses_routing or not 0 < r.num_slots <= FUSED_ROUTING_MAX:
            return bound
        fused = _native.library().bind(
            "moe_fp4_routing_quantize_values", x_dtype=_ROW_DTYPES[b.dtype], x_rows=b.num_tokens, k=b.a1.K,
            topk=b.topk, gs=self._gs(b.gs13), num_experts=r.num_experts, expert_offsets=_ptr(r.expert_offsets),
            blockscale_offsets=_ptr(r.blockscale_offsets), slot_to_flat=_ptr(r.slot_to_flat),
            flat_to_slot=_ptr(r.flat_to_slot), values=_ptr(b.a1.values), device=_device(b.device),
        )
        return with_fused_routing(
            bound, lambda topk_ids, x, row_scale, stream: fused(topk_ids.data_ptr(), x.data_ptr(), _ptr(row_scale),
                                                                 stream))

    def _quantize_rows(self, x_rows: int, k: int, dtype: torch.dtype, gs, routing, gather: bool,
                       out) -> _native.BoundEntry:
        """The gathered rows in token order (``moe_fp4_quantize_values_by_token``: each row of ``x`` read once for
        its topk slots, where the slot-order kernel reads it once per slot; the same bytes) where
        :func:`quantizes_by_token`, else in slot order. Free: ``x``, ``row_scale``, ``stream``."""
        n = routing.num_slots
        if not (gather and quantizes_by_token(x_rows, k, n // x_rows if x_rows else 1, out.values.device)):
            return super()._quantize_rows(x_rows, k, dtype, gs, routing, gather, out)
        return self._quantize_rows_by_token(x_rows, k, dtype, gs, routing, gather, out)

    def _quantize_rows_by_token(self, x_rows: int, k: int, dtype: torch.dtype, gs, routing, gather: bool,
                                out) -> _native.BoundEntry:
        """``moe_fp4_quantize_values_by_token`` bound (``gather``: always True here). Free: ``x``, ``row_scale``,
        ``stream``."""
        n = routing.num_slots
        return _native.library().bind(
            "moe_fp4_quantize_values_by_token", x_dtype=_ROW_DTYPES[dtype], x_rows=x_rows, k=k,
            flat_to_slot=_ptr(routing.flat_to_slot), topk=n // x_rows if x_rows else 1, num_slots=n,
            gs=self._gs(gs), expert_offsets=_ptr(routing.expert_offsets), num_experts=routing.num_experts,
            values=_ptr(out.values), device=_device(out.device),
        )

    def _grouped_gemm(self, a, w, routing, out, scratch, config) -> _native.BoundEntry:
        """The GEMM gets a zeroed workspace of its own where its plan splits K through one (GS:
        ``moe_fp4_sm90_grouped_gemm_ws``). Its tile counters are state, zero between calls, so it is not the
        plan's scratch (tests poison that between calls): a plan's bound entry keeps it, a direct stage call's
        is allocated for the call, so both run the plan's split (the same bits: the tail split has no cluster of
        the same grouping to fall back on)."""
        tile = 0 if config is None else config
        if not isinstance(tile, int) or isinstance(tile, bool) or tile not in (0, *SM90_TILE_TOKENS):
            raise TypeError(f"config: expected None or a token-tile width {', '.join(map(str, SM90_TILE_TOKENS))}, "
                            f"got {config!r}")
        return _native.library().bind(
            "moe_fp4_sm90_grouped_gemm_ws", sections=w.S, out=_ptr(out), tile_tokens=tile,
            **_sm90_gemm_args(a, w, routing, tile),
        )

    def grouped_gemm(self, a, w, routing, out, scratch, config) -> None:
        self._grouped_gemm(a, w, routing, out, scratch, config)(stream_handle(a.device))

    def _gemm1_silu(self, a, w, gs, routing, out, config=None) -> _native.BoundEntry:
        """The first GEMM with SiLU-and-mul (W4A4: and the second quantization) in its epilogue
        (``moe_fp4_sm90_gemm_silu``): ``a`` (Quantized, values) times ``w`` (w13's Sm90Weights) into ``out``
        (Quantized, values ``[rows, I]``, the second GEMM's operand), ``gs`` the second quantization's global
        scales (ignored by W4A16). ``config``: None, or ``(tile_tokens, slices, cta_splits)`` forced (0 = the
        heuristic's). The workspace as :meth:`_grouped_gemm`'s. Free: ``stream``."""
        tile, slices, splits = (0, 0, 0) if config is None else config
        return _native.library().bind(
            "moe_fp4_sm90_gemm_silu", gs=self._gs(gs), values=_ptr(out.values), tile_tokens=tile, slices=slices,
            cta_splits=splits, gs_splits=0, **_sm90_gemm_args(a, w, routing, tile),
        )

    def gemm1_silu(self, a, w, gs, routing, out, config=None) -> None:
        """The fused launch as a stage call (for tests), with a workspace allocated for the call."""
        self._gemm1_silu(a, w, gs, routing, out, config)(stream_handle(a.values.device))


def _sm90_gemm_args(a, w, routing, tile: int) -> dict:
    """The arguments the sm_90a GEMM entries share: the operands, the expert offsets, the device and a zeroed
    workspace where the plan splits K through one (kept by the bound entry: a plan's, bound once, or a stage
    call's, allocated for the call)."""
    _require_cuda("a", a.values, "the sm_90a grouped GEMM runs on H100/H200 GPUs")
    dev = a.values.device
    nbytes = 0
    if a.rows > 0:
        nbytes = _native.library().size_query("moe_fp4_sm90_gemm_workspace_size", a_rows=a.rows, num_experts=w.E,
                                              n=w.N, k=w.K, tile_tokens=tile, sm_count=_sm_count(dev))
    ws = torch.zeros(nbytes, dtype=torch.uint8, device=dev) if nbytes else None
    return dict(a=_ptr(a.values), a_dtype=_ROW_DTYPES[a.values.dtype], a_rows=a.rows, k=w.K, w=_ptr(w.packed),
                w_scales=_ptr(w.scales), alpha=_ptr(w.alpha), num_experts=w.E, n=w.N,
                expert_offsets=_ptr(routing.expert_offsets), workspace=_ptr(ws), workspace_bytes=nbytes,
                device=_device(dev), _keep=(ws,) if ws is not None else ())


def quantizes_by_token(x_rows: int, k: int, topk: int, device: torch.device) -> bool:
    """Whether the sm_90a row stage gathers ``x [x_rows, k]`` into its ``topk`` slots per row in token order
    (``moe_fp4_quantize_values_by_token``) rather than per slot: for topk > 1 from one unit (row, 16-value
    block) per resident thread of the GPU, 2048 per SM, on. In slot order each slot reads its row again, and
    past the L2 those reads go to DRAM: at Qwen3-30B-A3B M = 16384 on the H100 it read 436 MB for 64 MB of
    ``x`` (Nsight Compute). Measured on the H100 (tests/results/h100-2026-12-06-s33, the stage alone, cold L2,
    µs, slot -> token order): Qwen3 M = 16384 354.4 -> 253.0 (whole forward 2960 -> 2862), M = 4096 82.0 ->
    74.7, DeepSeek-V3 M = 4096 312.9 -> 221.3, M = 1024 72.8 -> 69.1; below the bound token order lost (its
    copies split over threads, each reading the row again): Qwen3 M = 1024 25.7 -> 26.7, M = 256 13.2 ->
    15.0, M = 64 8.1 -> 8.6, DeepSeek-V3 M = 256 24.1 -> 27.1; with one copy per row (topk = 1) the two
    orders do the same work (Llama-4-Scout M = 4096 39.2 -> 40.0)."""
    sms = _sm_count(device)  # (off CUDA, for the host oracle's rows, an H100's or H200's)
    return topk > 1 and x_rows * (k // 16) >= 2048 * sms


def fuses_silu(slots: int, num_experts: int) -> bool:
    """Whether a plan of ``slots`` rows over ``num_experts`` runs its first GEMM with SiLU-and-mul in the
    epilogue (:data:`FUSE_SILU`, at most :data:`SILU_MAX_ROWS_PER_EXPERT` rows per expert: the GEMM's 8-token
    tile, for which the library builds that epilogue)."""
    return FUSE_SILU and slots > 0 and -(-slots // min(num_experts, slots)) <= SILU_MAX_ROWS_PER_EXPERT


class Sm90Plan(NamedTuple):
    """The sm_90a GEMM's heuristic plan (``moe_fp4_sm90_gemm_plan``): its token tile, K slices per CTA, CTAs
    per tile (a K split across a cluster) and K splits through the workspace (1: none)."""

    tile_tokens: int
    slices: int
    cta_splits: int
    gs_splits: int


def sm90_gemm_plan(a_rows: int, num_experts: int, n: int, k: int, device: torch.device | None = None,
                   with_workspace: bool = True) -> Sm90Plan:
    """The plan the sm_90a GEMM takes for ``a_rows`` rows over ``num_experts`` experts of ``[n, k]`` weights
    on ``device``'s SMs (off CUDA an H100's or H200's 132), with or without a workspace (a plan's GEMMs have
    one)."""
    out = (ctypes.c_int32 * 4)()
    base = ctypes.addressof(out)
    _native.library().call("moe_fp4_sm90_gemm_plan", a_rows=a_rows, num_experts=num_experts, n=n, k=k,
                           sm_count=_sm_count(device), with_workspace=int(with_workspace), tile_tokens=base,
                           slices=base + 4, cta_splits=base + 8, gs_splits=base + 12)
    return Sm90Plan(*out)


def _nothing(stream) -> None:
    """A plan's launch that another one has taken over (the SiLU-and-mul stage, in the fused first GEMM)."""


class _Sm90W4A16Kernels(_Sm90Kernels):
    """W4A16 on the sm_90a GEMM: the row stages write the unquantized 16-bit rows (``Quantized.values``),
    the library's quantization kernels without a global scale; everything else as :class:`_Sm90Kernels`."""

    quantizes = False


def sm90_weights(packed: torch.Tensor, logical_scales: torch.Tensor, alpha: torch.Tensor,
                 out_codes: torch.Tensor | None = None, out_scales: torch.Tensor | None = None) -> Sm90Weights:
    """NVFP4 weights ``[E, N, K/2]`` with logical scales ``[E, N, K/16]`` re-laid out for the sm_90a GEMM
    (into ``out_codes`` uint8 and ``out_scales`` (uint8 or float8 storage) of the same shapes when given).
    ``alpha`` ``[E, S]`` (or ``[E]``: S = 1) gives the sections: S = 2 is w13 (gate rows, then up rows),
    which the layout interleaves by 8 rows (``moe_fp4_sm90_prepare_weights``' ``sections``)."""
    E, N, half_k = packed.shape
    alpha = alpha.reshape(E, -1).contiguous()
    w_out = torch.empty_like(packed) if out_codes is None else out_codes
    s_out = (torch.empty(logical_scales.shape, dtype=torch.uint8, device=packed.device) if out_scales is None
             else out_scales.view(torch.uint8))
    _native.library().call(
        "moe_fp4_sm90_prepare_weights", w=_ptr(packed), scales=_ptr(logical_scales.view(torch.uint8)),
        num_experts=E, n=N, k=half_k * 2, sections=alpha.shape[1], w_out=_ptr(w_out), scales_out=_ptr(s_out),
        device=_device(packed.device), stream=stream_handle(packed.device),
    )
    return Sm90Weights(w_out, s_out, alpha)


def sm90_restore(packed: torch.Tensor, scales: torch.Tensor, out_codes: torch.Tensor | None = None,
                 out_scales: torch.Tensor | None = None, sections: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`sm90_weights`' re-layout: the prepared ``packed`` uint8 ``[E, N, K/2]`` and
    ``scales`` uint8 ``[E, N, K/16]`` (as :class:`~moe_fp4.buffers.Sm90Weights` holds them) back to NVFP4
    codes uint8 ``[E, N, K/2]`` and logical float8_e4m3fn scales ``[E, N, K/16]``, written into
    ``out_codes`` / ``out_scales`` when given (contiguous, same device) and returned. Exact: the scales
    come back byte for byte, the codes but for those of zero-scale blocks, which preparation zeroed.
    ``sections``: the preparation's (2 for w13, its ``alpha`` of two columns)."""
    check_tensor("packed", packed, dtypes=(torch.uint8,), ndim=3, contiguous=True)
    E, N, half_k = packed.shape
    check_tensor("scales", scales, dtypes=(torch.uint8,), shape=(E, N, half_k // 8), contiguous=True)
    if out_codes is None:
        out_codes = torch.empty_like(packed)
    if out_scales is None:
        out_scales = torch.empty(scales.shape, dtype=torch.float8_e4m3fn, device=packed.device)
    check_tensor("out_codes", out_codes, dtypes=(torch.uint8,), shape=packed.shape, contiguous=True)
    check_tensor("out_scales", out_scales, dtypes=(torch.float8_e4m3fn,), shape=scales.shape, contiguous=True)
    check_same_device({"packed": packed, "scales": scales, "out_codes": out_codes, "out_scales": out_scales})
    _native.library().call(
        "moe_fp4_sm90_restore_weights", w=_ptr(packed), scales=_ptr(scales), num_experts=E, n=N, k=half_k * 2,
        sections=sections, w_out=_ptr(out_codes), scales_out=_ptr(out_scales.view(torch.uint8)),
        device=_device(packed.device), stream=stream_handle(packed.device),
    )
    return out_codes, out_scales


def _sm90_relayout(codes, scales, out_codes, out_scales, sections: int = 1) -> None:
    """:meth:`NvFp4Experts.in_layout`'s ``relayout`` for the sm_90a layout (outputs: the dtypes of the inputs)."""
    sm90_weights(codes, scales, torch.ones(codes.shape[0], sections, device=codes.device), out_codes, out_scales)


def _sm90_restore(codes, scales, sections: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`NvFp4Experts.in_layout`'s ``restore``: the sm_90a layout (scales in float8 storage) back to canonical."""
    return sm90_restore(codes, scales.view(torch.uint8), sections=sections)


# (w13's, w2's): w13 has two sections, gate and up, interleaved by the layout.
_SM90_RELAYOUT = (functools.partial(_sm90_relayout, sections=2), _sm90_relayout)
_SM90_RESTORE = (functools.partial(_sm90_restore, sections=2), _sm90_restore)


def sm90_layout(experts) -> tuple[torch.Tensor, ...]:
    """``(w13, w13_scale, w2, w2_scale)`` of ``experts`` in the sm_90a layout (w13's gate and up rows
    interleaved), under the layout key ``"sm90"``: the one place that names the key with its functions, so
    that nothing lays out another layout under it."""
    return experts.in_layout("sm90", _SM90_RELAYOUT, _SM90_RESTORE)


def _prepare_sm90(experts) -> tuple[Sm90Weights, Sm90Weights]:
    """The sm_90a layout of ``experts``' weights, in place of the canonical ones where
    :meth:`~moe_fp4.NvFp4Experts.in_layout` allows (one resident copy), and the W4A4 alphas."""
    alpha13, alpha2 = experts.alphas()
    w13, s13, w2, s2 = sm90_layout(experts)
    return (Sm90Weights(w13, s13.view(torch.uint8), alpha13.contiguous()),
            Sm90Weights(w2, s2.view(torch.uint8), alpha2.reshape(-1, 1).contiguous()))


def _prepare_sm90_w4a16(experts) -> tuple[Sm90Weights, Sm90Weights]:
    """The W4A4 prepared weights (re-laid out once, shared: no second copy) with alpha ``1/gs_w``."""
    w13, w2 = STAGES_SM90.weights(experts)
    alpha13, alpha2 = experts.alphas("w4a16")
    return (Sm90Weights(w13.packed, w13.scales, alpha13),
            Sm90Weights(w2.packed, w2.scales, alpha2.reshape(-1, 1).contiguous()))


STAGES = StageSet.from_kernels("cutlass", _Kernels(), reduce_dtypes=tuple(_OUT_DTYPES))
# Hopper (sm_90a): the quantization stages write the exact 16-bit values of the NVFP4 rows
# (W4A4) and no codes, and the GEMM multiplies them with weights dequantized in registers.
STAGES_SM90 = StageSet.from_kernels("cutlass-sm90", _Sm90Kernels(), reduce_dtypes=tuple(_OUT_DTYPES),
                                    weight_types=(Sm90Weights,), activation_values=True,
                                    activation_codes=_Sm90Kernels.codes, prepare_weights=_prepare_sm90,
                                    weights_key="sm90")
# Hopper, W4A16: the same GEMM on the unquantized rows, alpha = 1/gs_w.
STAGES_SM90_W4A16 = StageSet.from_kernels("cutlass-sm90-w4a16", _Sm90W4A16Kernels(), reduce_dtypes=tuple(_OUT_DTYPES),
                                          weight_types=(Sm90Weights,), activation_values=True, precision="w4a16",
                                          prepare_weights=_prepare_sm90_w4a16, weights_key="sm90-w4a16")


@functools.cache
def _sm_count(device: torch.device | None) -> int:
    """The SMs of ``device`` (the C library plans with the same count). For no device, a CPU one (the host
    oracle's rows) or without a CUDA runtime (the host-path tests' stubbed library, where nothing runs) an
    H100's or H200's 132."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _is_sm90(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device of compute capability 9.x (asked once per device)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def stages_for(device: torch.device, precision: str = "w4a4") -> StageSet:
    """The stage set that runs ``precision`` on ``device``: on compute capability 9.x :data:`STAGES_SM90`
    (``"w4a4"``) or :data:`STAGES_SM90_W4A16` (``"w4a16"``), else :data:`STAGES` (``"w4a4"`` only)."""
    sm90 = _is_sm90(device)
    if check_precision(precision) == "w4a16":
        if not sm90:
            raise ValueError(f"precision: the cutlass backend computes 'w4a16' on compute capability 9.x only (its "
                             f"sm_90a GEMM takes 16-bit activations; the block-scaled FP4 tensor-core GEMM of "
                             f"SM100/SM120 needs FP4 activations), not on {device}")
        return STAGES_SM90_W4A16
    return STAGES_SM90 if sm90 else STAGES

routing = STAGES.routing
quantize_rows = STAGES.quantize_rows
silu_mul_quantize = STAGES.silu_mul_quantize
grouped_gemm = STAGES.grouped_gemm
moe_reduce = STAGES.moe_reduce


def fused_moe(problem) -> torch.Tensor:
    """The MoE of :func:`moe_fp4.fused_moe` on the CUDA library (gate and up as separate GEMM groups
    with their own alpha); ``problem.precision`` ``"w4a16"`` on compute capability 9.x only."""
    _, H, I = problem.experts.sizes()  # noqa: E741
    if H % 32 or I % 32:
        raise ValueError(
            f"experts: the CUTLASS grouped GEMM needs the hidden and intermediate sizes to be multiples of 32 "
            f"(16-byte rows of packed e2m1 for TMA), got H = {H}, I = {I}; use backend='triton'"
        )
    return run_cached(stages_for(problem.hidden_states.device, problem.precision), problem)
