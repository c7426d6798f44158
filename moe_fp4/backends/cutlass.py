"""The ``cutlass`` backend: CUDA pipeline kernels and CUTLASS NVFP4 grouped GEMMs.

Everything runs in ``libmoe_fp4_cuda.so`` (:mod:`moe_fp4._native`, loaded on first use). The
stage functions take and return exactly the buffers of :mod:`moe_fp4.stages`, whose
docstrings are the contract, so each one can be compared with the torch reference and with
the Triton backend's function of the same name:

* :func:`routing`, :func:`quantize_rows`, :func:`silu_mul_quantize`, :func:`moe_reduce`: on
  any GPU from SM90 (sm_90a, sm_100a and sm_120f SASS, compute_90 PTX elsewhere). On CPU
  tensors the three element-wise ones run the library's host oracle, the very same kernel
  body executed serially on the host (a test path; ``routing`` has none).
* :func:`grouped_gemm`: SM100 (sm_100a) and SM120/SM121 (sm_120f) only; elsewhere it raises
  :class:`~moe_fp4.BackendUnavailableError` saying why.

Each stage also takes ``out=`` buffers (preallocated workspaces, CUDA graphs, tests that
poison buffers). Arguments are checked by :mod:`._stage_args`, the checks shared with the
Triton backend, then by the library's own preconditions. :func:`fused_moe` composes the
stages; it never synchronizes with the host.
"""

from __future__ import annotations

import torch

from .. import _native
from ..format import grouped_scale_rows_bound, swizzled_shape
from ..stages import RoutingData, prepare_weight_scales
from . import _stage_args as stage_args

__all__ = [
    "availability",
    "library_summary",
    "fused_moe",
    "routing",
    "quantize_rows",
    "silu_mul_quantize",
    "grouped_gemm",
    "moe_reduce",
]

_ROW_DTYPES = {torch.bfloat16: _native.BF16, torch.float16: _native.FP16}
_OUT_DTYPES = {**_ROW_DTYPES, torch.float32: _native.FP32}
# The library takes grouped scales as float8_e4m3fn or their uint8 view, in any multiple of
# 128 rows of at least the bound (the kernels zero the rows past blockscale_offsets[E]).
_SCALES = stage_args.ScaleBuffers((torch.float8_e4m3fn, torch.uint8), exact_rows=False)


# --------------------------------------------------------------------------- availability


def availability(device: torch.device, capability: tuple[int, int] | None) -> str | None:
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


def _placement(t: torch.Tensor) -> tuple[int, int | None]:
    """(device ordinal or HOST, stream handle) for a call on ``t``'s device."""
    if t.device.type == "cuda":
        return t.device.index, torch.cuda.current_stream(t.device).cuda_stream
    if t.device.type == "cpu":
        return _native.HOST, None
    raise ValueError(f"{t.device}: expected a CUDA or CPU tensor")


def _require_cuda(name: str, t: torch.Tensor, why: str) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor ({why}), got one on {t.device}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None or t.numel() == 0 else t.data_ptr()


def _new_quantized(rows: int, k: int, num_experts: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """New uninitialized (packed, scales) for ``rows`` rows of ``k`` (the kernel writes every byte)."""
    _, cp = swizzled_shape(1, k // 16)
    packed = torch.empty((rows, k // 2), dtype=torch.uint8, device=device)
    scales = torch.empty((grouped_scale_rows_bound(rows, num_experts), cp), dtype=torch.uint8, device=device)
    return packed, scales.view(torch.float8_e4m3fn)


# --------------------------------------------------------------------------- stages


def routing(topk_ids: torch.Tensor, num_experts: int, *, out: RoutingData | None = None) -> RoutingData:
    """:func:`moe_fp4.stages.routing` on the GPU for int32 ``topk_ids [M, topk]`` (one launch up to 4096 ids)."""
    stage_args.routing_args(topk_ids, num_experts, out)
    _require_cuda("topk_ids", topk_ids, "routing runs on the GPU; stages.routing is the CPU reference")
    n, dev = topk_ids.numel(), topk_ids.device
    if out is None:
        out = RoutingData(*(torch.empty(s, dtype=torch.int32, device=dev) for s in (num_experts + 1,) * 2 + (n,) * 2))
    lib = _native.library()
    workspace = torch.empty(lib.size_query("moe_fp4_routing_workspace_size", n, num_experts), dtype=torch.uint8, device=dev)
    device, stream = _placement(topk_ids)
    lib.call(
        "moe_fp4_routing", _ptr(topk_ids), n, num_experts, _ptr(out.expert_offsets), _ptr(out.blockscale_offsets),
        _ptr(out.slot_to_flat), _ptr(out.flat_to_slot), _ptr(workspace), workspace.numel(), device, stream,
    )
    return out


def quantize_rows(
    x: torch.Tensor,
    gs: torch.Tensor,
    expert_offsets: torch.Tensor,
    blockscale_offsets: torch.Tensor,
    slot_to_flat: torch.Tensor | None = None,
    topk: int = 1,
    row_scale: torch.Tensor | None = None,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_fp4.stages.quantize_rows` in one kernel (``row_scale`` needs ``slot_to_flat``).

    ``out=(packed uint8 [n, K/2], scales [rows, Cp])``: every byte of both is written (padding
    as zero); ``scales`` needs at least ``grouped_scale_rows_bound(n, E)`` rows, a multiple of 128.
    """
    E, rows, dev = stage_args.quantize_rows_args(
        x, gs, expert_offsets, blockscale_offsets, slot_to_flat, topk, row_scale, out, _SCALES
    )
    packed, scales = out if out is not None else _new_quantized(rows, x.shape[1], E, dev)
    device, stream = _placement(x)
    _native.library().call(
        "moe_fp4_quantize_rows", _ptr(x), _ROW_DTYPES[x.dtype], x.shape[0], x.shape[1], _ptr(slot_to_flat), topk,
        _ptr(row_scale), rows, _ptr(gs), _ptr(expert_offsets), _ptr(blockscale_offsets), E, _ptr(packed),
        _ptr(scales), scales.shape[0], device, stream,
    )
    return packed, scales


def silu_mul_quantize(
    h: torch.Tensor,
    gs: torch.Tensor,
    expert_offsets: torch.Tensor,
    blockscale_offsets: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_fp4.stages.silu_mul_quantize` in one kernel (SiLU, product and quantization fused).

    ``out=(packed uint8 [n, I/2], scales [rows, Cp])`` as for :func:`quantize_rows`.
    """
    E, inter, dev = stage_args.silu_mul_quantize_args(h, gs, expert_offsets, blockscale_offsets, out, _SCALES)
    packed, scales = out if out is not None else _new_quantized(h.shape[0], inter, E, dev)
    device, stream = _placement(h)
    _native.library().call(
        "moe_fp4_silu_mul_quantize", _ptr(h), _ROW_DTYPES[h.dtype], h.shape[0], inter, _ptr(gs), _ptr(expert_offsets),
        _ptr(blockscale_offsets), E, _ptr(packed), _ptr(scales), scales.shape[0], device, stream,
    )
    return packed, scales


def grouped_gemm(
    a: torch.Tensor,
    a_sf: torch.Tensor,
    b: torch.Tensor,
    b_sf: torch.Tensor,
    alpha: torch.Tensor,
    expert_offsets: torch.Tensor,
    blockscale_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`moe_fp4.stages.grouped_gemm` as one CUTLASS grouped GEMM of E*S groups (SM100/SM120 only).

    ``out [M_tot, N]`` of ``out_dtype``: rows past ``expert_offsets[E]`` are left untouched.
    """
    E, n, N, K, S, dev = stage_args.grouped_gemm_args(
        a, a_sf, b, b_sf, alpha, expert_offsets, blockscale_offsets, out_dtype, out, _SCALES
    )
    if S not in (1, 2):
        raise ValueError(f"b_sf: expected 1 (w2) or 2 (w13: gate, up) sections in the CUTLASS GEMM, got {S} "
                         f"(shape {list(b_sf.shape)})")
    _require_cuda("a", a, "the grouped GEMM runs on SM100/SM120 GPUs")
    if out is None:
        out = torch.empty((n, N), dtype=out_dtype, device=dev)
    lib = _native.library()
    device, stream = _placement(a)
    dtype = _ROW_DTYPES[out_dtype]
    workspace = torch.empty(
        lib.size_query("moe_fp4_grouped_gemm_workspace_size", E, S, dtype, device), dtype=torch.uint8, device=dev
    )
    lib.call(
        "moe_fp4_grouped_gemm", _ptr(a), _ptr(a_sf), a.shape[0], a_sf.shape[0], _ptr(b), _ptr(b_sf), _ptr(alpha), E, S,
        N, K, _ptr(expert_offsets), _ptr(blockscale_offsets), _ptr(out), dtype, _ptr(workspace), workspace.numel(),
        device, stream,
    )
    return out


def moe_reduce(
    y: torch.Tensor,
    flat_to_slot: torch.Tensor,
    topk_weights: torch.Tensor | None,
    num_tokens: int,
    out_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`moe_fp4.stages.moe_reduce` in one kernel (float32 sums in slot order); ``out_dtype`` may also be float32."""
    topk, dev = stage_args.moe_reduce_args(
        y, flat_to_slot, topk_weights, num_tokens, out_dtype, out, tuple(_OUT_DTYPES)
    )
    if out is None:
        out = torch.empty((num_tokens, y.shape[1]), dtype=out_dtype, device=dev)
    device, stream = _placement(y)
    _native.library().call(
        "moe_fp4_moe_reduce", _ptr(y), _ROW_DTYPES[y.dtype], y.shape[0], y.shape[1], _ptr(flat_to_slot),
        _ptr(topk_weights), num_tokens, topk, _ptr(out), _OUT_DTYPES[out_dtype], device, stream,
    )
    return out


# --------------------------------------------------------------------------- the MoE


def _prepared(experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w13 scales [E,2,Np,Cp], w2 scales [E,1,Np,Cp], alpha13 [E,2], alpha2 [E]), built once per experts."""

    def build(ex):
        alpha13, alpha2 = ex.alphas()
        return prepare_weight_scales(ex.w13_scale, 2), prepare_weight_scales(ex.w2_scale, 1), alpha13, alpha2

    return experts.prepared(("cutlass", "weights"), build)


def fused_moe(problem) -> torch.Tensor:
    """The MoE of :func:`moe_fp4.fused_moe` as 6 stages: routing, gather+quantize, GEMM1 (gate and
    up as separate groups with their own alpha), SiLU-mul+quantize, GEMM2, top-k reduce."""
    x, ex = problem.hidden_states, problem.experts
    H, I = ex.hidden_size, ex.intermediate_size
    if H % 32 or I % 32:
        raise ValueError(
            f"experts: the CUTLASS grouped GEMM needs the hidden and intermediate sizes to be multiples of 32 "
            f"(16-byte rows of packed e2m1 for TMA), got H = {H}, I = {I}; use backend='triton'"
        )
    b13_sf, b2_sf, alpha13, alpha2 = _prepared(ex)
    r = routing(problem.topk_ids, ex.num_experts)
    eo, bso = r.expert_offsets, r.blockscale_offsets
    row_scale = problem.topk_weights.reshape(-1) if problem.apply_router_weight_on_input else None
    a, a_sf = quantize_rows(x, ex.a13_gs, eo, bso, r.slot_to_flat, problem.topk, row_scale)
    h = grouped_gemm(a, a_sf, ex.w13, b13_sf, alpha13, eo, bso, x.dtype)
    a2, a2_sf = silu_mul_quantize(h, ex.a2_gs, eo, bso)
    y = grouped_gemm(a2, a2_sf, ex.w2, b2_sf, alpha2, eo, bso, x.dtype)
    weights = None if problem.apply_router_weight_on_input else problem.topk_weights
    return moe_reduce(y, r.flat_to_slot, weights, problem.num_tokens, x.dtype, out=problem.output())
