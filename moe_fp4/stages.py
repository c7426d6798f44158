"""The torch reference of every pipeline stage (:mod:`moe_fp4.pipeline`), as a :class:`StageSet`.

:data:`STAGES` is what the Triton and CUDA stages are checked against, buffer for buffer:
routing exactly, quantization bit for bit (every padding byte included), the GEMM within
the bound of its fp32 summation order (here the sum is exact: float64, then rounded to
float32 as an ideal fp32 accumulator would give, times alpha in float32), the reduce
exactly. Clear rather than fast: loops over experts, reads offsets on the host.
``run_pipeline(STAGES, problem)`` is the whole MoE composed from these references, a
cross-check of :func:`moe_fp4.reference.exact_moe`.

:data:`STAGES_W4A16` is the same for ``precision="w4a16"`` (a cross-check of
:func:`moe_fp4.reference.exact_moe` with ``precision="w4a16"``): its stages 2 and 4 write the rows unquantized into
``Quantized.values`` (:func:`w4a16_rows`, :func:`w4a16_silu_mul`: plain torch, vectorized,
with no host synchronization, what the GPU backends' W4A16 row kernels write), and its GEMM
multiplies those values.
"""

from __future__ import annotations

import functools

import torch

from .buffers import Quantized, RoutingData, WeightOperand
from .format import (
    BLOCK_SIZE,
    _quantize_blocks,
    decode_scaled,
    swizzle_scales,
    swizzled_shape,
    unswizzle_scales,
)
from .pipeline import Scratch, StageSet
from .reference import silu_mul

__all__ = ["STAGES", "STAGES_W4A16", "routing", "quantize_rows", "silu_mul_quantize", "grouped_gemm", "moe_reduce",
           "silu_mul", "w4a16_rows", "w4a16_silu_mul"]


def _routing(topk_ids: torch.Tensor, num_experts: int) -> RoutingData:
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    dev = topk_ids.device
    served = (flat >= 0) & (flat < num_experts)
    counts = torch.bincount(flat[served], minlength=num_experts)[:num_experts]
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    padded = (counts + 127) // 128 * 128
    bso = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    # Stable sort by expert: within an expert, ascending flat index. Unserved ids sort last.
    order = torch.sort(torch.where(served, flat, num_experts), stable=True).indices
    valid = int(offsets[-1])
    slot_to_flat = torch.full((n,), -1, dtype=torch.int64, device=dev)
    slot_to_flat[:valid] = order[:valid]
    flat_to_slot = torch.full((n,), -1, dtype=torch.int64, device=dev)
    flat_to_slot[order[:valid]] = torch.arange(valid, device=dev)
    i32 = torch.int32
    return RoutingData(offsets.to(i32), bso.to(i32), slot_to_flat.to(i32), flat_to_slot.to(i32))


def _group_quantize(rows: torch.Tensor, gs: torch.Tensor, r: RoutingData, out: Quantized) -> None:
    """Quantize row-grouped ``rows [n, K]`` per expert into ``out`` (packed, grouped swizzled scales, values)."""
    n, K = rows.shape
    E = r.num_experts
    C = K // BLOCK_SIZE
    _, Cp = swizzled_shape(1, C)
    packed = torch.zeros((n, K // 2), dtype=torch.uint8, device=rows.device)
    sf = torch.zeros((out.scales.shape[0], Cp), dtype=torch.uint8, device=rows.device)
    values = None if out.values is None else torch.zeros((n, K), dtype=rows.dtype, device=rows.device)
    offs, bso = r.expert_offsets.tolist(), r.blockscale_offsets.tolist()
    for e in range(E):
        a, b = offs[e], offs[e + 1]
        if b == a:
            continue
        q, s = _quantize_blocks(rows[a:b], gs[e].reshape(()))
        packed[a:b] = q
        if values is not None:
            values[a:b] = decode_scaled(q, s).to(rows.dtype)  # exact: e2m1 * e4m3 fits 16 bits
        region = swizzle_scales(s).view(torch.uint8)
        sf[bso[e] : bso[e] + region.shape[0]] = region
    out.packed.copy_(packed)
    out.scales.view(torch.uint8).copy_(sf)
    if values is not None:
        out.values.copy_(values)


def _no_config(config: object, stages: str = "reference") -> None:
    if config is not None:
        raise TypeError(f"config: the {stages} stages take no launch configuration, got {type(config).__name__}")


class _Reference:
    """The reference kernels (:class:`~moe_fp4.pipeline.StageKernels`)."""

    def routing(self, topk_ids: torch.Tensor, out: RoutingData, scratch: Scratch) -> None:
        r = _routing(topk_ids, out.num_experts)
        for f in ("expert_offsets", "blockscale_offsets", "slot_to_flat", "flat_to_slot"):
            getattr(out, f).copy_(getattr(r, f))

    def quantize_rows(self, x, gs, routing, gather, row_scale, out, config) -> None:
        _no_config(config)
        rows = x
        if gather:
            n = routing.num_slots
            topk = n // x.shape[0] if x.shape[0] else 1
            valid = int(routing.expert_offsets[-1])
            flat = routing.slot_to_flat[:valid].long()
            rows = torch.zeros((n, x.shape[1]), dtype=x.dtype, device=x.device)
            rows[:valid] = x[flat // topk]
            if row_scale is not None:
                rows[:valid] = (rows[:valid].float() * row_scale[flat].unsqueeze(1)).to(x.dtype)
        _group_quantize(rows, gs, routing, out)

    def silu_mul_quantize(self, h, gs, routing, out, config) -> None:
        _no_config(config)
        valid = int(routing.expert_offsets[-1])
        act = torch.zeros((h.shape[0], h.shape[1] // 2), dtype=h.dtype, device=h.device)
        act[:valid] = silu_mul(h[:valid])
        _group_quantize(act, gs, routing, out)

    def _activations(self, a: Quantized, lo: int, hi: int, scale_row: int) -> torch.Tensor:
        """Rows ``lo:hi`` of ``a`` (one expert's, its scales from ``scale_row``) as the GEMM multiplies them."""
        C = a.K // BLOCK_SIZE
        Rp, _ = swizzled_shape(hi - lo, C)
        sfa = unswizzle_scales(a.scales[scale_row : scale_row + Rp], hi - lo, C)
        return decode_scaled(a.packed[lo:hi], sfa)

    def grouped_gemm(self, a: Quantized, w: WeightOperand, routing, out, scratch, config) -> None:
        _no_config(config)
        C, ns = a.K // BLOCK_SIZE, w.N // w.S
        offs, bso = routing.expert_offsets.tolist(), routing.blockscale_offsets.tolist()
        for e in range(w.E):
            lo, hi = offs[e], offs[e + 1]
            if hi == lo:
                continue
            sfb = unswizzle_scales(w.scales[e], ns, C).reshape(w.N, C)
            A = self._activations(a, lo, hi, bso[e]).double()
            B = decode_scaled(w.packed[e], sfb).double()
            acc = (A @ B.T).float()
            out[lo:hi] = (acc * w.alpha[e].repeat_interleave(ns)).to(out.dtype)

    def moe_reduce(self, y, routing, topk_weights, out) -> None:
        num_tokens = out.shape[0]
        topk = routing.num_slots // num_tokens
        acc = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
        slots = routing.flat_to_slot.reshape(num_tokens, topk).long()
        for j in range(topk):
            s = slots[:, j]
            term = y[s.clamp_min(0)].float()
            if topk_weights is not None:
                term = term * topk_weights[:, j].unsqueeze(1)
            acc += torch.where((s >= 0).unsqueeze(1), term, torch.zeros((), device=y.device))
        out.copy_(acc.to(out.dtype))


def _values_of(out: Quantized, like: torch.Tensor) -> torch.Tensor:
    if out.values is None or out.values.dtype != like.dtype:
        got = "none" if out.values is None else str(out.values.dtype).removeprefix("torch.")
        raise ValueError(f"out: expected values of dtype {str(like.dtype).removeprefix('torch.')} (w4a16 writes the "
                         f"unquantized rows there), got {got}")
    return out.values


def w4a16_rows(x: torch.Tensor, routing: RoutingData, gather: bool, row_scale: torch.Tensor | None,
               out: Quantized) -> None:
    """Stage 2 of a w4a16 stage set: the routed rows, unquantized, into ``out.values`` (16-bit ``[n, K]``).

    Slot ``s`` gets ``x[slot_to_flat[s] // topk]`` (with ``gather``; else ``x[s]``), times
    ``row_scale[slot_to_flat[s]]`` in float32 rounded to ``x.dtype`` when given; slots past
    ``expert_offsets[E]`` (``slot_to_flat == -1``) get zeros. Torch ops only, no host
    synchronization; ``out.packed`` and ``out.scales`` are not written.
    """
    values = _values_of(out, x)
    flat = routing.slot_to_flat.long()
    safe = flat.clamp_min(0)
    rows = x
    if gather:
        topk = flat.numel() // x.shape[0] if x.shape[0] else 1
        rows = x.index_select(0, safe // topk)
        if row_scale is not None:
            rows = (rows.float() * row_scale.index_select(0, safe).unsqueeze(1)).to(x.dtype)
    torch.where((flat >= 0).unsqueeze(1), rows, torch.zeros((), dtype=x.dtype, device=x.device), out=values)


def w4a16_silu_mul(h: torch.Tensor, routing: RoutingData, out: Quantized) -> None:
    """Stage 4 of a w4a16 stage set: ``silu_mul(h)`` (:func:`moe_fp4.reference.silu_mul`'s roundings),
    unquantized, into ``out.values``; rows past ``expert_offsets[E]`` get zeros. No host synchronization:
    ``silu_mul`` reads every row of ``h``, also those the GEMM did not write, which the workspace
    holds zeroed from its allocation (and the GEMM stage allocates its output zeroed)."""
    values = _values_of(out, h)
    served = (routing.slot_to_flat >= 0).unsqueeze(1)
    torch.where(served, silu_mul(h), torch.zeros((), dtype=h.dtype, device=h.device), out=values)


class _ReferenceW4A16(_Reference):
    """The reference kernels of the w4a16 pipeline: rows unquantized (stages 2 and 4 are :func:`w4a16_rows`
    and :func:`w4a16_silu_mul`, which take no launch configuration), the GEMM multiplies ``Quantized.values``."""

    def quantize_rows(self, x, gs, routing, gather, row_scale, out, config) -> None:
        _no_config(config, "w4a16 row")
        w4a16_rows(x, routing, gather, row_scale, out)

    def silu_mul_quantize(self, h, gs, routing, out, config) -> None:
        _no_config(config, "w4a16 row")
        w4a16_silu_mul(h, routing, out)

    def _activations(self, a: Quantized, lo: int, hi: int, scale_row: int) -> torch.Tensor:
        return a.values[lo:hi]


# The reference reduce also writes float32 (the CUDA library's reduce does).
_REDUCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STAGES = StageSet.from_kernels("reference", _Reference(), reduce_dtypes=_REDUCE_DTYPES)
# W4A16: the GEMMs' weights carry alpha = 1/gs_w (the weights' global scales only).
STAGES_W4A16 = StageSet.from_kernels(
    "reference-w4a16", _ReferenceW4A16(), reduce_dtypes=_REDUCE_DTYPES, activation_values=True, precision="w4a16",
    prepare_weights=functools.partial(WeightOperand.from_experts, precision="w4a16"), weights_key="swizzled-w4a16",
)

routing = STAGES.routing
quantize_rows = STAGES.quantize_rows
silu_mul_quantize = STAGES.silu_mul_quantize
grouped_gemm = STAGES.grouped_gemm
moe_reduce = STAGES.moe_reduce
