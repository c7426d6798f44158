"""The grouped NVFP4 quantization kernel (gather / plain rows / SiLU-and-mul front ends), and the gather
front end fused with the single-program routing for the values form at decode."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .._gdc import enter_stage
from ..numerics_details._nvfp4 import (
    count_le,
    quantize,
    quantize_codes_halves,
    quantize_values,
    quantize_values_halves,
    round_f32,
    swizzled_col_offset,
    swizzled_row_offset,
    to_f32,
)
from ..routing_details._routing import flat_slots, route_small

# Where a slot's 16-bit row comes from (constexpr MODE).
ROWS = tl.constexpr(0)  # src[slot]: rows already grouped by expert
GATHER = tl.constexpr(1)  # src[slot_to_flat[slot] // topk], optionally times row_scale[slot_to_flat[slot]]
SILU_MUL = tl.constexpr(2)  # silu(src[slot, :K]) * src[slot, K:]


@triton.jit
def silu_mul(g, u, DTYPE: tl.constexpr, INTERPRET: tl.constexpr, HW: tl.constexpr = False):
    """``DTYPE(DTYPE(silu(g)) * u)`` for float32 ``g``, ``u`` holding 16-bit values.

    silu is ``g / (1 + exp(-g))`` in float32 with an IEEE division; exp is libdevice's
    ``expf`` on the GPU (the accurate one torch uses; ``tl.exp`` is ``ex2.approx``) and
    numpy's in the interpreter. The product of two 16-bit values is exact in float32.
    ``HW``: the roundings by the hardware's conversion (:func:`round_f32`).
    """
    if INTERPRET:
        ex = tl.exp(-g)
    else:
        ex = libdevice.exp(-g)
    s = to_f32(round_f32(tl.math.div_rn(g, 1.0 + ex), DTYPE, HW))
    return to_f32(round_f32(s * u, DTYPE, HW))


@triton.jit
def _source_values(src, ld, K, w, MODE: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, INTERPRET: tl.constexpr,
                   DTYPE: tl.constexpr, HW: tl.constexpr = False):
    """The float32 values a quantization front end feeds the quantizer at 16-bit pointers ``src`` (masked by
    ``ld``, zeros outside): the row's values, ``silu(src) * src[K:]`` (``SILU_MUL``), or the row's values
    times the router weight ``w`` rounded to ``DTYPE`` (``GATHER`` with ``HAS_ROW_SCALE``)."""
    x = to_f32(tl.load(src, mask=ld, other=0.0))
    if MODE == SILU_MUL:
        x = silu_mul(x, to_f32(tl.load(src + K, mask=ld, other=0.0)), DTYPE, INTERPRET, HW)
    if MODE == GATHER:
        if HAS_ROW_SCALE:
            x = to_f32(round_f32(x * w, DTYPE, HW))
    return x


@triton.jit
def _expert_of(offs_ptr, slot, E, E_BLOCK: tl.constexpr):
    """Expert of each slot: ``#{e < E : offs[e+1] <= slot}`` (``E`` for slots past ``offs[E]``)."""
    e = tl.zeros(slot.shape, tl.int32)
    for e0 in range(0, E, E_BLOCK):
        ej = e0 + tl.arange(0, E_BLOCK)
        ends = tl.load(offs_ptr + 1 + ej, mask=ej < E, other=0x7FFFFFFF)
        e += tl.sum((ends[None, :] <= slot[:, None]).to(tl.int32), axis=1)
    return e


@triton.jit
def _routed_slots(ids_ptr, slot, n, E, N_BLOCK: tl.constexpr, J_BLOCK: tl.constexpr):
    """``(expert, flat index)`` of each slot from the ids themselves (``n <= N_BLOCK``): the routing
    recomputed, so the fused kernel's programs need not wait for the routing's outputs. Slots that
    hold no row get expert ``E`` and flat index -1."""
    i, ids, valid, rank = flat_slots(ids_ptr, n, E, N_BLOCK, J_BLOCK)
    hit = valid[None, :] & (rank[None, :] == slot[:, None])
    found = tl.sum(hit.to(tl.int32), axis=1) > 0
    flat = tl.where(found, tl.sum(tl.where(hit, i[None, :], 0), axis=1), -1)
    e = tl.where(found, tl.sum(tl.where(hit, ids[None, :], 0), axis=1), E)
    return e, flat


@triton.jit
def _quantize_rows(pid, src_ptr, src_stride, slot_to_flat_ptr, row_scale_ptr, gs_ptr, offs_ptr, bso_ptr, q_ptr,
                   sf_ptr, n_slots, topk, E, K, CP, n_k_blocks,
                   MODE: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, INTERPRET: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, E_BLOCK: tl.constexpr, VALUES: tl.constexpr,
                   ids_ptr=None, ROUTE: tl.constexpr = False, N_BLOCK: tl.constexpr = 16, J_BLOCK: tl.constexpr = 32,
                   WHOLE: tl.constexpr = False, RAW: tl.constexpr = False):
    """Slots ``BLOCK_R * (pid // n_k_blocks) ..`` x columns ``BLOCK_K * (pid % n_k_blocks) ..``: codes and scales,
    or with ``VALUES`` the fp16 values ``e2m1 * e4m3`` into ``q_ptr [n_slots, K]`` (``sf_ptr`` unused).
    ``ROUTE`` (``GATHER`` and ``VALUES`` only): each slot's expert and flat index come from the ids
    (``ids_ptr``, :func:`_routed_slots`), not from the routing's outputs. ``WHOLE``: each block's two
    halves loaded apart so that one thread holds the block (:func:`quantize_values_halves`,
    :func:`quantize_codes_halves`; K a multiple of 16), the 16-bit roundings by the hardware on a GPU.
    ``RAW`` (with ``VALUES``, not ``WHOLE``; ``precision="w4a16"``): no quantization, the front end's 16-bit
    values (the row, times the router weight rounded, or the SiLU-and-mul product) into ``q_ptr`` of the
    source's dtype (``gs_ptr`` unused).

    Slots past ``offs[E]`` get zero packed codes (or values; their rows are not loaded) and no scales.
    """
    slot = (pid // n_k_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = (pid % n_k_blocks) * BLOCK_K
    if ROUTE:
        e, flat = _routed_slots(ids_ptr, slot, n_slots, E, N_BLOCK, J_BLOCK)
        valid = e < E
    else:
        e = _expert_of(offs_ptr, slot, E, E_BLOCK)
        valid = e < E
        first = tl.load(offs_ptr + e, mask=valid, other=0)
        region = tl.load(bso_ptr + e, mask=valid, other=0)
    if not RAW:
        gs = tl.load(gs_ptr + e, mask=valid, other=1.0)
    if MODE == GATHER:
        if not ROUTE:
            flat = tl.load(slot_to_flat_ptr + slot, mask=valid, other=-1)
        valid = valid & (flat >= 0) & (flat < n_slots)
        src_row = flat // topk
        if HAS_ROW_SCALE:
            w = tl.load(row_scale_ptr + flat, mask=valid, other=0.0)
    else:
        src_row = slot
    DTYPE: tl.constexpr = src_ptr.dtype.element_ty
    if not HAS_ROW_SCALE:
        w = 1.0  # not read
    if WHOLE:
        HW: tl.constexpr = not INTERPRET
        kb = k0 + 16 * tl.arange(0, BLOCK_K // 16)  # the program's blocks; K % 16 == 0
        col = (kb[:, None] + tl.arange(0, 8)[None, :])[None, :, :]  # [1, NB, 8]: each block's first half
        ld = valid[:, None, None] & (kb < K)[None, :, None]
        src = src_ptr + src_row.to(tl.int64)[:, None, None] * src_stride + col
        w3 = w[:, None, None] if HAS_ROW_SCALE else w
        lo = _source_values(src, ld, K, w3, MODE, HAS_ROW_SCALE, INTERPRET, DTYPE, HW)
        hi = _source_values(src + 8, ld, K, w3, MODE, HAS_ROW_SCALE, INTERPRET, DTYPE, HW)
        st = (slot < n_slots)[:, None, None] & (kb < K)[None, :, None]
        if VALUES:
            v_lo, v_hi = quantize_values_halves(lo, hi, gs[:, None])
            dst = q_ptr + slot.to(tl.int64)[:, None, None] * K + col
            tl.store(dst, v_lo, mask=st)
            tl.store(dst + 8, v_hi, mask=st)
        else:
            p_lo, p_hi, scales = quantize_codes_halves(lo, hi, gs[:, None])
            j = tl.arange(0, BLOCK_K // 16)  # the program's blocks; k0 is a multiple of 64
            byte = (k0 // 2 + 8 * j[:, None] + tl.arange(0, 4)[None, :])[None, :, :]  # [1, NB, 4]: a half's bytes
            dst = q_ptr + slot.to(tl.int64)[:, None, None] * (K // 2) + byte
            tl.store(dst, p_lo, mask=st)
            tl.store(dst + 4, p_hi, mask=st)
            c = k0 // 16 + j
            sf_col = (k0 // 64 + (j >> 2)) * 512 + (j & 3)  # swizzled_col_offset(c), shifts for divisions
            sf = sf_ptr + region.to(tl.int64)[:, None] * CP + swizzled_row_offset(slot - first, CP)[:, None]
            tl.store(sf + sf_col[None, :], scales.to(tl.uint8), mask=(e < E)[:, None] & (c < CP)[None, :])
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        ld = valid[:, None] & (k < K)[None, :]  # padding columns load zeros: zero codes and scales
        src = src_ptr + src_row.to(tl.int64)[:, None] * src_stride + k[None, :]
        x = _source_values(src, ld, K, w[:, None] if HAS_ROW_SCALE else w, MODE, HAS_ROW_SCALE, INTERPRET, DTYPE)
        if RAW:  # (x holds 16-bit values: the store's rounding is exact)
            tl.store(q_ptr + slot.to(tl.int64)[:, None] * K + k[None, :], x,
                     mask=(slot < n_slots)[:, None] & (k < K)[None, :])
        elif VALUES:
            tl.store(q_ptr + slot.to(tl.int64)[:, None] * K + k[None, :], quantize_values(x, gs[:, None]),
                     mask=(slot < n_slots)[:, None] & (k < K)[None, :])
        else:
            packed, scales = quantize(x, gs[:, None])
            kq = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            tl.store(q_ptr + slot.to(tl.int64)[:, None] * (K // 2) + kq[None, :], packed,
                     mask=(slot < n_slots)[:, None] & (kq < K // 2)[None, :])
            c = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            sf = sf_ptr + region.to(tl.int64)[:, None] * CP + swizzled_row_offset(slot - first, CP)[:, None]
            tl.store(sf + swizzled_col_offset(c)[None, :], scales, mask=(e < E)[:, None] & (c < CP)[None, :])


@triton.jit
def _zero_padding(pid, offs_ptr, bso_ptr, sf_ptr, E, CP, n_w_blocks, W_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr):
    """Zero the scale rows of 128-row band ``pid // n_w_blocks`` that hold no scale, ``W_BLOCK`` words at a time.

    Regions start at multiples of 128, so a band lies in one expert's region (or past
    ``bso[E]``); its rows ``>= m_e`` hold no scale. A band is ``128 * CP`` contiguous bytes:
    int32 word ``w`` of it holds 4 columns of local row ``(w % 128) // 4 + 32 * (w % 4)``.
    """
    band = pid // n_w_blocks
    row0 = band * 128
    e = count_le(bso_ptr + 1, E, row0, E_BLOCK)  # regions ending at or before row0
    m_e = tl.load(offs_ptr + e + 1, mask=e < E, other=0) - tl.load(offs_ptr + e, mask=e < E, other=0)
    m_local = m_e - (row0 - tl.load(bso_ptr + e))  # rows of this band that hold scales
    if m_local < 128:
        w = (pid % n_w_blocks) * W_BLOCK + tl.arange(0, W_BLOCK)
        row = (w % 128) // 4 + 32 * (w % 4)
        words = sf_ptr.to(tl.pointer_type(tl.int32)) + band.to(tl.int64) * 32 * CP
        tl.store(words + w, tl.zeros((W_BLOCK,), tl.int32), mask=(row >= m_local) & (w < 32 * CP))


@triton.jit(do_not_specialize=["n_slots", "topk", "E", "n_row_programs", "n_k_blocks", "n_w_blocks"])
def quantize_grouped_kernel(
    src_ptr, src_stride,
    slot_to_flat_ptr, row_scale_ptr, gs_ptr, offs_ptr, bso_ptr,
    q_ptr, sf_ptr,
    n_slots, topk, E, K, CP, n_row_programs, n_k_blocks, n_w_blocks,
    MODE: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, W_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
    VALUES: tl.constexpr = False, PDL: tl.constexpr = False, WHOLE: tl.constexpr = False, RAW: tl.constexpr = False,
):
    """Programs ``< n_row_programs`` quantize slot blocks; the others zero the scale bytes that hold no scale.

    Together they write every packed byte of the ``n_slots`` rows and every byte of the
    grouped scale buffer exactly once; padding rows and columns cost no loads and no math.
    With ``VALUES`` there are only the row programs, and they write every value of the rows.
    ``WHOLE``: see :func:`_quantize_rows`.
    """
    enter_stage(PDL)
    pid = tl.program_id(0)
    if pid < n_row_programs:
        _quantize_rows(pid, src_ptr, src_stride, slot_to_flat_ptr, row_scale_ptr, gs_ptr, offs_ptr, bso_ptr, q_ptr,
                       sf_ptr, n_slots, topk, E, K, CP, n_k_blocks,
                       MODE, HAS_ROW_SCALE, INTERPRET, BLOCK_R, BLOCK_K, E_BLOCK, VALUES, WHOLE=WHOLE, RAW=RAW)
    elif not VALUES:
        _zero_padding(pid - n_row_programs, offs_ptr, bso_ptr, sf_ptr, E, CP, n_w_blocks, W_BLOCK, E_BLOCK)


@triton.jit(do_not_specialize=["n_slots", "topk", "E", "n_row_programs", "n_k_blocks"])
def routing_quantize_kernel(
    ids_ptr, src_ptr, src_stride, row_scale_ptr, gs_ptr,
    offs_ptr, bso_ptr, s2f_ptr, f2s_ptr, q_ptr,
    n_slots, topk, E, K, n_row_programs, n_k_blocks,
    HAS_ROW_SCALE: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    E_BLOCK: tl.constexpr, N_BLOCK: tl.constexpr, J_BLOCK: tl.constexpr, PDL: tl.constexpr = False,
    WHOLE: tl.constexpr = False, RAW: tl.constexpr = False,
):
    """The routing and the first quantization (gather, fp16 values) in one launch, for ``n_slots <= N_BLOCK``.

    Programs ``< n_row_programs`` write the values of their slot blocks as
    :func:`quantize_grouped_kernel` does (``GATHER``, ``VALUES``), each recomputing the slots' experts
    and flat indices from the ids; the last program writes the four routing outputs as
    ``routing_small_kernel`` does. The same bytes as the two launches, one kernel's latency fewer.
    """
    enter_stage(PDL)
    pid = tl.program_id(0)
    if pid < n_row_programs:
        _quantize_rows(pid, src_ptr, src_stride, s2f_ptr, row_scale_ptr, gs_ptr, offs_ptr, bso_ptr, q_ptr, q_ptr,
                       n_slots, topk, E, K, 0, n_k_blocks, GATHER, HAS_ROW_SCALE, INTERPRET, BLOCK_R, BLOCK_K,
                       E_BLOCK, True, ids_ptr, True, N_BLOCK, J_BLOCK, WHOLE, RAW)
    else:
        route_small(ids_ptr, offs_ptr, bso_ptr, s2f_ptr, f2s_ptr, n_slots, E, N_BLOCK, E_BLOCK, J_BLOCK)
