"""The grouped NVFP4 quantization kernel (gather / plain rows / SiLU-and-mul front ends)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..numerics_details._nvfp4 import (
    count_le,
    quantize,
    round_f32,
    swizzled_col_offset,
    swizzled_row_offset,
    to_f32,
)

# Where a slot's 16-bit row comes from (constexpr MODE).
ROWS = tl.constexpr(0)  # src[slot]: rows already grouped by expert
GATHER = tl.constexpr(1)  # src[slot_to_flat[slot] // topk], optionally times row_scale[slot_to_flat[slot]]
SILU_MUL = tl.constexpr(2)  # silu(src[slot, :K]) * src[slot, K:]


@triton.jit
def _silu_mul(g, u, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """``DTYPE(DTYPE(silu(g)) * u)`` for float32 ``g``, ``u`` holding 16-bit values.

    silu is ``g / (1 + exp(-g))`` in float32 with an IEEE division; exp is libdevice's
    ``expf`` on the GPU (the accurate one torch uses; ``tl.exp`` is ``ex2.approx``) and
    numpy's in the interpreter. The product of two 16-bit values is exact in float32.
    """
    if INTERPRET:
        ex = tl.exp(-g)
    else:
        ex = libdevice.exp(-g)
    s = to_f32(round_f32(tl.math.div_rn(g, 1.0 + ex), DTYPE))
    return to_f32(round_f32(s * u, DTYPE))


@triton.jit(do_not_specialize=["n_slots", "topk", "E"])
def quantize_grouped_kernel(
    src_ptr, src_stride,
    slot_to_flat_ptr, row_scale_ptr, gs_ptr, offs_ptr, bso_ptr,
    q_ptr, sf_ptr,
    n_slots, topk, E, K, CP,
    MODE: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, E_BLOCK: tl.constexpr,
):
    """One program owns ``BLOCK_R`` rows of the grouped scale buffer (BLOCK_R divides 128).

    Regions start at multiples of 128, so all its rows lie in one expert's region (or in
    the tail past ``bso[E]``). Row ``r`` of expert ``e``'s region holds slot
    ``offs[e] + r`` when ``r < m_e``; every other scale byte it owns is written as zero.
    Tail programs also zero the packed rows of the slots past ``offs[E]`` (there are
    never more of those than tail rows, see ``grouped_scale_rows_bound``).
    """
    row0 = tl.program_id(0) * BLOCK_R
    e = count_le(bso_ptr + 1, E, row0, E_BLOCK)  # regions ending at or before row0
    region = tl.load(bso_ptr + e)
    first = tl.load(offs_ptr + e)
    m_e = tl.load(offs_ptr + e + 1, mask=e < E, other=first) - first
    gs = tl.load(gs_ptr + e, mask=e < E, other=1.0)
    r = row0 - region + tl.arange(0, BLOCK_R)
    valid = r < m_e
    slot = first + r
    write = valid | ((e == E) & (slot < n_slots))  # tail slots get zero packed rows
    if MODE == GATHER:
        flat = tl.load(slot_to_flat_ptr + slot, mask=valid, other=-1)
        valid = valid & (flat >= 0) & (flat < n_slots)
        src_row = flat // topk
        if HAS_ROW_SCALE:
            w = tl.load(row_scale_ptr + flat, mask=valid, other=0.0)
    else:
        src_row = slot
    src_rows = src_ptr + src_row.to(tl.int64)[:, None] * src_stride
    q_rows = q_ptr + slot.to(tl.int64)[:, None] * (K // 2)
    sf_rows = sf_ptr + region.to(tl.int64) * CP + swizzled_row_offset(r, CP)[:, None]
    DTYPE: tl.constexpr = src_ptr.dtype.element_ty
    for k0 in range(0, CP * 16, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ld = valid[:, None] & (k < K)[None, :]  # padding rows and columns load zeros: zero codes and scales
        x = to_f32(tl.load(src_rows + k[None, :], mask=ld, other=0.0))
        if MODE == SILU_MUL:
            u = to_f32(tl.load(src_rows + K + k[None, :], mask=ld, other=0.0))
            x = _silu_mul(x, u, DTYPE, INTERPRET)
        if MODE == GATHER:
            if HAS_ROW_SCALE:
                x = to_f32(round_f32(x * w[:, None], DTYPE))
        packed, scales = quantize(x, gs)
        kq = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        tl.store(q_rows + kq[None, :], packed, mask=write[:, None] & (kq < K // 2)[None, :])
        c = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        tl.store(sf_rows + swizzled_col_offset(c)[None, :], scales, mask=(c < CP)[None, :])
