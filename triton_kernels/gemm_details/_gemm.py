"""The grouped NVFP4 x NVFP4 GEMM kernels: in-register fp16 operands, tensor-core dots, per-expert alpha.

Operand construction and its exactness: ``numerics_details/_nvfp4.py`` (section "GEMM
operands"). With ``SPLIT`` each program sums one K range into float32 partials and
:func:`split_k_reduce_kernel` adds the ranges in order, then applies alpha, or, for the second GEMM of
a plan, :func:`split_k_topk_reduce_kernel` does that and the top-k reduce in one pass. Or, in one launch,
the GEMM's own programs do both (``FIXUP``, ``TOPK``): the last program to finish a piece of work, counted
with an atomic counter, does what depends on it (:func:`_last_to_arrive`), in the same order as the
separate launches, so with the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._gdc import enter_stage
from ..numerics_details._nvfp4 import (
    k16_tile_scales,
    operand_scales,
    operand_tile,
    operand_unscale,
    quantize_values,
    round_f32,
    swizzled_col_offset,
    swizzled_row_offset,
    to_f32,
)
from ..quantize_details._quantize import silu_mul
from ..reduce_details._reduce import topk_sum


@triton.jit
def _tile_rows(pid_n, N, NS, BN: tl.constexpr, SILU: tl.constexpr):
    """``(n, n_ok)``: the weight rows of column tile ``pid_n``: ``BN`` consecutive rows, or with
    ``SILU`` the gate and up rows of ``BN / 2`` output columns in pairs (even: gate row ``c``,
    odd: up row ``NS + c``), so the epilogue finds each column's two halves side by side."""
    j = tl.arange(0, BN)
    if SILU:
        c = pid_n * (BN // 2) + j // 2
        return c + (j % 2) * NS, c < NS
    else:
        n = pid_n * BN + j
        return n, n < N


@triton.jit
def _silu_quantize_store(h, e, slot, r_ok, pid_n, gs_ptr, out_ptr, NS, BM: tl.constexpr, BN: tl.constexpr,
                         H_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """The SiLU-and-mul quantization stage on float32 ``h [BM, BN]`` (alpha applied; columns in gate/up
    pairs, :func:`_tile_rows`), as ``quantize_grouped_kernel`` computes it from the rounded 16-bit
    ``h``: fp16 values ``e2m1 * e4m3`` of ``BN / 2`` output columns into ``out [n_rows, NS]``."""
    if H_BF16:
        H_DTYPE: tl.constexpr = tl.bfloat16
    else:
        H_DTYPE: tl.constexpr = tl.float16
    g, u = tl.split(tl.reshape(to_f32(round_f32(h, H_DTYPE)), (BM, BN // 2, 2)))
    x = silu_mul(g, u, H_DTYPE, INTERPRET)
    gs = tl.zeros((BM, 1), tl.float32) + tl.load(gs_ptr + e)
    c = pid_n * (BN // 2) + tl.arange(0, BN // 2)
    tl.store(out_ptr + slot[:, None] * NS + c[None, :], quantize_values(x, gs), mask=r_ok[:, None] & (c < NS)[None, :])


@triton.jit
def find_tile(offs_ptr, E, pid_m, BM: tl.constexpr, E_BLOCK: tl.constexpr):
    """``(e, first local row, tiles)`` of M-tile ``pid_m`` when each expert's rows form ``ceil(m_e/BM)`` tiles
    (``tiles``: all experts' together).

    Tiles are numbered expert by expert; ``e == E`` when ``pid_m`` is past the last tile.
    Reads only ``expert_offsets``, so the grid can be a static upper bound.
    """
    e = 0
    start = 0
    carry = 0
    for e0 in range(0, E, E_BLOCK):
        ej = e0 + tl.arange(0, E_BLOCK)
        lo = tl.load(offs_ptr + ej, mask=ej < E, other=0)
        hi = tl.load(offs_ptr + ej + 1, mask=ej < E, other=0)
        tiles = (hi - lo + BM - 1) // BM
        done = (tl.cumsum(tiles, 0) + carry <= pid_m) & (ej < E)
        e += tl.sum(done.to(tl.int32), 0)
        start += tl.sum(tl.where(done, tiles, 0), 0)
        carry += tl.sum(tiles, 0)
    return e, (pid_m - start) * BM, carry


@triton.jit
def _last_to_arrive(cnt_ptr, count):
    """Whether this program is the last of ``count`` to arrive at the int32 counter ``cnt_ptr``; the last one
    sets it back to 0 (so it is 0 again for the next launch, as it must be at the first).

    Every program arriving calls it once, after its stores: a barrier orders the stores of all its threads
    before one thread's acquire-release increment at GPU scope, so the last program to arrive sees what
    every one stored before it. The result is the same for all threads of the program."""
    tl.debug_barrier()
    last = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == count - 1
    if last:
        tl.store(cnt_ptr, 0)
    return last


@triton.jit
def _topk_reduce_if_last(cnt_ptr, m_tiles, y_ptr, f2s_ptr, w_ptr, red_ptr, M, N, n_rows, pid_n, BN: tl.constexpr,
                         TOPK: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr):
    """The top-k reduce of the columns of tile column ``pid_n`` by the last of its ``m_tiles`` row tiles to
    have written its rows of ``y [n_rows, N]``: ``red[t] = sum_j w[t, j] * y[flat_to_slot[t*TOPK + j]]`` for
    every token ``t < M`` (``moe_reduce_kernel``'s operations in its order: the same bits)."""
    if _last_to_arrive(cnt_ptr, m_tiles):
        h = pid_n * BN + tl.arange(0, BN)
        h_ok = h < N
        for t0 in range(0, M, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            t_ok = t < M
            acc = topk_sum(y_ptr, f2s_ptr, w_ptr, t, h, t_ok, h_ok, N, n_rows, TOPK, HAS_WEIGHTS, ".cg")
            tl.store(red_ptr + t.to(tl.int64)[:, None] * N + h[None, :], round_f32(acc, red_ptr.dtype.element_ty),
                     mask=t_ok[:, None] & h_ok[None, :])


@triton.jit
def _load_scales(rows, row_ok, k0, k_hi, CP, BK: tl.constexpr):
    """Scale bytes ``[rows, BK/16]`` of the K step starting at packed word ``k0`` (zeros at or past ``k_hi``)."""
    c = k0 // 2 + tl.arange(0, BK // 16)
    ok = row_ok[:, None] & ((c < CP) & (k0 < k_hi))[None, :]
    return tl.load(rows + swizzled_col_offset(c)[None, :], mask=ok, other=0)


@triton.jit
def _load_scale_words(rows, row_ok, k0, k_hi, CP, BK: tl.constexpr):
    """The scales of the K step at packed word ``k0`` as int32 words ``[rows, BK/64]``: word ``g`` holds
    blocks ``4g .. 4g + 3`` of the step (zeros at or past ``k_hi``). ``rows`` are byte pointers to
    4-byte aligned swizzled rows; a column group of 4 is one aligned word of the layout."""
    c = k0 // 2 + tl.arange(0, BK // 64) * 4
    ok = row_ok[:, None] & ((c < CP) & (k0 < k_hi))[None, :]
    return tl.load(rows.to(tl.pointer_type(tl.int32)) + (swizzled_col_offset(c) // 4)[None, :], mask=ok, other=0)


@triton.jit
def _weight_rows(b_ptr, b_sf_ptr, e, n, sec, N, KW, NS, NP_S, CP, S: tl.constexpr):
    """``(code rows, scale rows)`` of weight rows ``n`` (sections ``sec``) of expert ``e``: int32 word pointers
    into ``b [E, N, KW]`` and byte pointers to the rows of the swizzled scales ``[E, S, NP_S, CP]``."""
    b_rows = b_ptr.to(tl.pointer_type(tl.int32)) + (e.to(tl.int64) * N + n[:, None]) * KW
    b_sf_rows = (b_sf_ptr + (e * S + sec).to(tl.int64)[:, None] * NP_S * CP
                 + swizzled_row_offset(n - sec * NS, CP)[:, None])
    return b_rows, b_sf_rows


@triton.jit(do_not_specialize=["n_tiles_n"])
def dequantize_k16_kernel(b_ptr, b_sf_ptr, out_ptr, N, KW, NS, NP_S, CP, n_tiles_n,
                          S: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr,
                          ASM: tl.constexpr, PDL: tl.constexpr = False):
    """``out[e, n, k]`` = weight ``(e, n, k)`` of K16-layout codes ``b [E, N, KW]`` (int32 words) and their
    swizzled scales as the GEMM's fp16 operand ``e2m1 * e4m3 * 2^-X`` (:func:`operand_tile`), in natural
    K order: what :func:`grouped_gemm_kernel` with ``DENSE`` multiplies.

    Program ``(pid, kb)`` dequantizes ``BN`` rows of one expert over K step ``kb`` (``BK`` elements, a
    multiple of 64 dividing ``K``): the four nibble tiles the GEMM builds in registers, each stored
    at the 16-element runs of the columns it holds (K16 layout: tile ``J``, column ``16g + t`` is
    element ``64g + 16J + t`` of the step).
    """
    enter_stage(PDL)  # (the previous chunk's GEMM reads ``out``: it must have finished)
    pid = tl.program_id(0)
    k0 = tl.program_id(1) * (BK // 8)  # packed words
    e = pid // n_tiles_n
    n = (pid % n_tiles_n) * BN + tl.arange(0, BN)
    n_ok = n < N
    b_rows, b_sf_rows = _weight_rows(b_ptr, b_sf_ptr, e, n, n // NS, N, KW, NS, NP_S, CP, S)
    kw = k0 + tl.arange(0, BK // 8)
    b_q = tl.load(b_rows + kw[None, :], mask=n_ok[:, None], other=0)
    b_s = _load_scale_words(b_sf_rows, n_ok, k0, KW, CP, BK)
    kc = tl.arange(0, BK // 4)
    out_rows = out_ptr + (e.to(tl.int64) * N + n[:, None]) * (KW * 8)
    for j in tl.static_range(4):
        col = k0 * 8 + j * 16 + (kc // 16) * 64 + kc % 16
        b = operand_tile(b_q, operand_scales(k16_tile_scales(b_s, j), FAST, 16), j, FAST, ASM, True)
        tl.store(out_rows + col[None, :], b, mask=n_ok[:, None])


@triton.jit
def _mma(acc, a, b, SWAP_AB: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc + a . b^T`` (``SWAP_AB``: ``acc + b . a^T``) with the weight tile ``b`` (fp16) in the activations'
    dtype: bf16 activations (``precision="w4a16"``, the rows as they are) take bf16 weights, an exact
    conversion (``e2m1 * e4m3 * 2^-X`` has at most 6 significant bits and lies within bf16's normal range).
    The interpreter's bf16 dot is not a dot (numpy has no bf16): there both go to float32, whose products of
    these operands are exact."""
    if INTERPRET and a.dtype == tl.bfloat16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    elif a.dtype != b.dtype:
        b = b.to(a.dtype)
    if SWAP_AB:
        return tl.dot(b, tl.trans(a), acc)
    else:
        return tl.dot(a, tl.trans(b), acc)


@triton.jit(do_not_specialize=["n_rows", "E", "n_tiles_n", "split_steps", "M"])
def grouped_gemm_kernel(
    a_ptr, a_sf_ptr, b_ptr, b_sf_ptr, alpha_ptr, offs_ptr, bso_ptr, out_ptr, part_ptr, gs_ptr,
    n_rows, N, KW, E, NS, NP_S, CP, n_tiles_n, split_steps, cnt_ptr, f2s_ptr, w_ptr, red_ptr, M,
    S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SWAP_AB: tl.constexpr, SPLIT: tl.constexpr, FAST: tl.constexpr, ASM: tl.constexpr,
    E_BLOCK: tl.constexpr, VALUES: tl.constexpr = False, PDL: tl.constexpr = False,
    SILU: tl.constexpr = False, H_BF16: tl.constexpr = True, INTERPRET: tl.constexpr = False,
    DENSE: tl.constexpr = False, FIXUP: tl.constexpr = False, TOPK: tl.constexpr = 0,
    HAS_WEIGHTS: tl.constexpr = False, BLOCK_T: tl.constexpr = 1,
):
    """``out[slot, n] = alpha[e, n // NS] * sum_k A[slot, k] * B[e, n, k]`` for the rows of each expert.

    ``KW = K/8`` packed int32 words per row (passed so the compiler sees its divisibility and
    vectorizes the loads); ``CP`` padded scale columns; ``split_steps`` K steps per K range.

    Program ``(pid, ks)`` computes a ``BM`` (rows of one expert) x ``BN`` (columns) tile over
    K range ``ks``. With ``SWAP_AB`` the dot is ``B_tile . A_tile^T`` so the weight rows fill
    the MMA's M side and a small row block (decode) wastes little. Without ``SPLIT`` it
    writes ``out``; with it, float32 ``part[ks, slot, n]`` (unscaled). Programs past the
    last tile exit.

    ``VALUES``: ``a_ptr`` is the fp16 values ``[n_rows, K]`` the quantization stage wrote
    (``a_sf_ptr`` unused) and the weights are in the K16 layout (``K`` a multiple of 64): tile
    ``J`` of a step is the activation columns ``64g + 16J + t``, 16-element runs loaded as they
    are, so only the weights are dequantized.

    ``DENSE`` (with ``VALUES``): ``b_ptr`` is the weights already dequantized, fp16 ``[E, N, K]`` in natural
    K order (:func:`dequantize_k16_kernel`; ``b_sf_ptr`` unused): both operands are loaded as they are.

    ``SILU`` (with ``VALUES``, ``S = 2``, without ``SPLIT`` or with ``FIXUP``): the tile's rows are gate/up pairs
    (:func:`_tile_rows`) and the epilogue writes ``out [n_rows, NS]`` = the fp16 values of
    ``quantize(silu(h_gate) * h_up, gs[e])`` (:func:`_silu_quantize_store`; ``h`` rounded to bf16 with
    ``H_BF16``, else fp16), what the GEMM and the SiLU-and-mul quantization stage write in two launches.
    A split GEMM without ``FIXUP`` computes its partial sums in natural column tiles;
    :func:`split_k_reduce_kernel` pairs them.

    ``FIXUP`` (with ``SPLIT``): no second launch adds the K ranges; the last of a tile's ranges to finish
    does, as :func:`split_k_reduce_kernel` would (the same bits), and writes ``out`` (with ``SILU``, through
    the SiLU-and-mul quantization, as that kernel's ``SILU`` does).
    ``cnt_ptr``: int32 counters, zero, one per program of grid axis 0 and then one per column tile (left
    zero). ``TOPK`` (> 0: a plan's second GEMM, ``S = 1``, with a 16-bit ``out``; not ``DENSE`` or
    ``SILU``): then the last row tile of each column tile to write its rows of ``out`` (``y``) does the
    top-k reduce of those columns for all ``M`` tokens into ``red [M, N]`` (``flat_to_slot`` at ``f2s_ptr``,
    the router weights ``[M, TOPK]`` at ``w_ptr`` with ``HAS_WEIGHTS``; :func:`_topk_reduce_if_last`), what
    ``moe_reduce_kernel`` would write after this launch. Where no row is served (every id -1), no tile counts
    in and the programs of row tile 0 (K range 0) write the reduce's zeros (+0.0, what it sums to then).
    """
    enter_stage(PDL)
    pid = tl.program_id(0)
    ks = tl.program_id(1)
    pid_m = pid // n_tiles_n
    pid_n = pid % n_tiles_n
    e, row0, m_tiles = find_tile(offs_ptr, E, pid_m, BM, E_BLOCK)
    if e >= E:
        if TOPK:
            if (m_tiles == 0) & (pid_m == 0) & (ks == 0):  # no row served: no tile counts in; the reduce's +0.0
                h = pid_n * BN + tl.arange(0, BN)
                for t0 in range(0, M, BLOCK_T):
                    t = t0 + tl.arange(0, BLOCK_T)
                    tl.store(red_ptr + t.to(tl.int64)[:, None] * N + h[None, :],
                             tl.zeros((BLOCK_T, BN), red_ptr.dtype.element_ty),
                             mask=(t < M)[:, None] & (h < N)[None, :])
        return
    first = tl.load(offs_ptr + e)
    m_e = tl.load(offs_ptr + e + 1) - first
    region = tl.load(bso_ptr + e)
    r = row0 + tl.arange(0, BM)
    r_ok = r < m_e
    slot = (first + r).to(tl.int64)
    n, n_ok = _tile_rows(pid_n, N, NS, BN, SILU)
    sec = n // NS  # weight-scale section (gate/up) of each column
    if VALUES:
        a_rows = a_ptr + slot[:, None] * (KW * 8)
        kc = tl.arange(0, BK // 4)
        a_cols = (kc // 16) * 64 + kc % 16  # tile 0's columns of a step; tile J adds 16 J
    else:
        a_rows = a_ptr.to(tl.pointer_type(tl.int32)) + slot[:, None] * KW
        a_sf_rows = a_sf_ptr + region.to(tl.int64) * CP + swizzled_row_offset(r, CP)[:, None]
    if SWAP_AB:
        acc = tl.zeros((BN, BM), tl.float32)
    else:
        acc = tl.zeros((BM, BN), tl.float32)
    k_lo = ks * split_steps * (BK // 8)  # a multiple of BK/8 the compiler can see
    k_hi = tl.minimum(k_lo + split_steps * (BK // 8), KW)
    if DENSE:  # (a_rows: the values' rows)
        b_rows = b_ptr + (e.to(tl.int64) * N + n[:, None]) * (KW * 8)
        for k0 in range(k_lo * 8, k_hi * 8, BK):
            kk = k0 + tl.arange(0, BK)
            a = tl.load(a_rows + kk[None, :], mask=r_ok[:, None], other=0.0)
            b = tl.load(b_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
            acc = _mma(acc, a, b, SWAP_AB, INTERPRET)
    else:
        b_rows, b_sf_rows = _weight_rows(b_ptr, b_sf_ptr, e, n, sec, N, KW, NS, NP_S, CP, S)
        # The scale tiles are too small for the compiler's asynchronous copies (< 4 bytes per
        # thread), so they are loaded one K step ahead by hand.
        if VALUES:  # the activation values carry their scales
            b_s_next = _load_scale_words(b_sf_rows, n_ok, k_lo, k_hi, CP, BK)
        else:
            a_s_next = _load_scales(a_sf_rows, r_ok, k_lo, k_hi, CP, BK)
            b_s_next = _load_scales(b_sf_rows, n_ok, k_lo, k_hi, CP, BK)
        for k0 in range(k_lo, k_hi, BK // 8):  # k0 counts packed words (8 elements)
            kw = k0 + tl.arange(0, BK // 8)
            b_q = tl.load(b_rows + kw[None, :], mask=n_ok[:, None] & (kw < KW)[None, :], other=0)
            b_s = b_s_next
            if VALUES:
                b_s_next = _load_scale_words(b_sf_rows, n_ok, k0 + BK // 8, k_hi, CP, BK)
            else:
                b_s_next = _load_scales(b_sf_rows, n_ok, k0 + BK // 8, k_hi, CP, BK)
            if not VALUES:
                a_q = tl.load(a_rows + kw[None, :], mask=r_ok[:, None] & (kw < KW)[None, :], other=0)
                sa = operand_scales(a_s_next, FAST)
                sb = operand_scales(b_s, FAST)
                a_s_next = _load_scales(a_sf_rows, r_ok, k0 + BK // 8, k_hi, CP, BK)
            for j in tl.static_range(4):  # four dots over the nibble tiles (numerics_details/_nvfp4.py)
                if VALUES:
                    col = k0 * 8 + j * 16 + a_cols
                    a = tl.load(a_rows + col[None, :], mask=r_ok[:, None] & (col < KW * 8)[None, :], other=0.0)
                    b = operand_tile(b_q, operand_scales(k16_tile_scales(b_s, j), FAST, 16), j, FAST, ASM, True)
                else:
                    a = operand_tile(a_q, sa, j, FAST, ASM)
                    b = operand_tile(b_q, sb, j, FAST, ASM)
                acc = _mma(acc, a, b, SWAP_AB, INTERPRET)
    if not SPLIT:
        alpha = tl.load(alpha_ptr + e * S + sec, mask=n_ok, other=0.0) * operand_unscale(FAST, VALUES)
        OUT: tl.constexpr = out_ptr.dtype.element_ty
        if SILU:
            if SWAP_AB:
                h = tl.trans(acc * alpha[:, None])
            else:
                h = acc * alpha[None, :]
            _silu_quantize_store(h, e, slot, r_ok, pid_n, gs_ptr, out_ptr, NS, BM, BN, H_BF16, INTERPRET)
        elif SWAP_AB:
            tl.store(out_ptr + slot[None, :] * N + n[:, None], round_f32(acc * alpha[:, None], OUT),
                     mask=n_ok[:, None] & r_ok[None, :])
        else:
            tl.store(out_ptr + slot[:, None] * N + n[None, :], round_f32(acc * alpha[None, :], OUT),
                     mask=r_ok[:, None] & n_ok[None, :])
        wrote = True
    else:
        part = part_ptr + ks.to(tl.int64) * (n_rows.to(tl.int64) * N)
        if SWAP_AB:
            tl.store(part + slot[None, :] * N + n[:, None], acc, mask=n_ok[:, None] & r_ok[None, :])
        else:
            tl.store(part + slot[:, None] * N + n[None, :], acc, mask=r_ok[:, None] & n_ok[None, :])
        wrote = False
        if FIXUP:
            wrote = _last_to_arrive(cnt_ptr + pid, tl.num_programs(1))  # the tile's last K range adds them all
            if wrote:
                _reduce_split_tile(part_ptr, alpha_ptr, out_ptr, gs_ptr, e, slot, r_ok, n, n_ok, pid_n, n_rows, N, NS,
                                   tl.num_programs(1), S, FAST, VALUES, BM, BN, SILU, H_BF16, INTERPRET, ".cg")
    if TOPK:
        if wrote:
            _topk_reduce_if_last(cnt_ptr + tl.num_programs(0) + pid_n, m_tiles, out_ptr, f2s_ptr, w_ptr, red_ptr, M,
                                 N, n_rows, pid_n, BN, TOPK, HAS_WEIGHTS, BLOCK_T)


@triton.jit
def _split_sum(part_ptr, offs, ok, stride, n_split, CACHE: tl.constexpr):
    """``((part[0] + part[1]) + ...) + part[n_split - 1]`` at ``offs`` (float32; ``stride`` elements per K
    range), masked by ``ok``: the K ranges' sums in range order (``CACHE``: the loads' cache modifier)."""
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0, cache_modifier=CACHE)
    for ks in range(1, n_split):
        acc += tl.load(part_ptr + ks * stride + offs, mask=ok, other=0.0, cache_modifier=CACHE)
    return acc


@triton.jit(do_not_specialize=["n_rows", "E", "n_tiles_n", "n_split"])
def split_k_reduce_kernel(part_ptr, alpha_ptr, offs_ptr, out_ptr, gs_ptr, n_rows, N, E, NS, n_tiles_n, n_split,
                          S: tl.constexpr, FAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          E_BLOCK: tl.constexpr, VALUES: tl.constexpr = False, PDL: tl.constexpr = False,
                          SILU: tl.constexpr = False, H_BF16: tl.constexpr = True, INTERPRET: tl.constexpr = False):
    """``out[slot, n] = alpha[e, n // NS] * (((part[0] + part[1]) + ...) + part[n_split-1])``, float32, then rounded
    (with ``SILU``: then the SiLU-and-mul quantization, as :func:`grouped_gemm_kernel`'s epilogue).

    The same tiles as :func:`grouped_gemm_kernel` (``BM`` rows of one expert x ``BN`` columns),
    so exactly the rows it wrote are read.
    """
    enter_stage(PDL)
    pid = tl.program_id(0)
    e, row0, _ = find_tile(offs_ptr, E, pid // n_tiles_n, BM, E_BLOCK)
    if e >= E:
        return
    first = tl.load(offs_ptr + e)
    r = row0 + tl.arange(0, BM)
    r_ok = r < tl.load(offs_ptr + e + 1) - first
    n, n_ok = _tile_rows(pid % n_tiles_n, N, NS, BN, SILU)
    _reduce_split_tile(part_ptr, alpha_ptr, out_ptr, gs_ptr, e, (first + r).to(tl.int64), r_ok, n, n_ok,
                       pid % n_tiles_n, n_rows, N, NS, n_split, S, FAST, VALUES, BM, BN, SILU, H_BF16, INTERPRET, "")


@triton.jit
def _reduce_split_tile(part_ptr, alpha_ptr, out_ptr, gs_ptr, e, slot, r_ok, n, n_ok, pid_n, n_rows, N, NS, n_split,
                       S: tl.constexpr, FAST: tl.constexpr, VALUES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       SILU: tl.constexpr, H_BF16: tl.constexpr, INTERPRET: tl.constexpr, CACHE: tl.constexpr):
    """Rows ``slot`` (of expert ``e``) x columns ``n`` of ``out = alpha[e, n // NS] * (the K ranges' partial sums
    added in range order)``, rounded to ``out``'s dtype, or with ``SILU`` (gate/up column pairs) through the
    SiLU-and-mul quantization (:func:`_silu_quantize_store`): what :func:`split_k_reduce_kernel` writes, and
    a ``FIXUP`` GEMM's last K range (``CACHE``: the partials' cache modifier)."""
    offs = slot[:, None] * N + n[None, :]
    ok = r_ok[:, None] & n_ok[None, :]
    acc = _split_sum(part_ptr, offs, ok, n_rows.to(tl.int64) * N, n_split, CACHE)
    alpha = tl.load(alpha_ptr + e * S + n // NS, mask=n_ok, other=0.0) * operand_unscale(FAST, VALUES)
    if SILU:
        _silu_quantize_store(acc * alpha[None, :], e, slot, r_ok, pid_n, gs_ptr, out_ptr, NS, BM, BN, H_BF16,
                             INTERPRET)
    else:
        tl.store(out_ptr + offs, round_f32(acc * alpha[None, :], out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _expert_of(offs_ptr, slot, E, E_BLOCK: tl.constexpr):
    """The expert whose rows hold each ``slot``: the last ``e < E`` with ``expert_offsets[e] <= slot`` (for a
    ``slot`` in ``[0, expert_offsets[E])``; 0 for a negative one), by a branchless binary search over
    ``E_BLOCK >= E`` entries (a power of two): log2(E_BLOCK) dependent loads, no cross-thread reduction."""
    e = tl.zeros_like(slot)
    for b in tl.static_range(1, 11):  # E_BLOCK <= 1024
        if (E_BLOCK >> b) > 0:
            mid = e + (E_BLOCK >> b)
            start = tl.load(offs_ptr + mid, mask=mid < E, other=2**31 - 1)
            e = tl.where(start <= slot, mid, e)
    return e


@triton.jit(do_not_specialize=["M", "n_rows", "E", "n_split"])
def split_k_topk_reduce_kernel(part_ptr, alpha_ptr, offs_ptr, f2s_ptr, w_ptr, out_ptr, M, n_rows, N, E, n_split,
                               TOPK: tl.constexpr, FAST: tl.constexpr, VALUES: tl.constexpr, Y_BF16: tl.constexpr,
                               HAS_WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                               E_BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """The split GEMM's epilogue and the top-k reduce in one pass, ``y`` never written:
    ``out[t] = sum_j w[t, j] * y[flat_to_slot[t*TOPK + j]]`` (float32, slot order, rounded once) with
    ``y[slot] = round(alpha[e] * (((part[0] + part[1]) + ...) + part[n_split-1]))`` to bf16 (``Y_BF16``)
    or fp16, ``e`` the expert whose rows hold ``slot`` and ``alpha [E]`` (one weight section, as the second
    GEMM has): what :func:`split_k_reduce_kernel` and then ``moe_reduce_kernel`` compute (the same
    operations in the same order, no FMA contraction), so the same bits. Slots that are -1 or out of
    range add an exact 0. Grid: (token blocks, column blocks); ``E <= E_BLOCK <= 1024``.
    """
    enter_stage(PDL)
    if Y_BF16:
        Y: tl.constexpr = tl.bfloat16
    else:
        Y: tl.constexpr = tl.float16
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = t < M
    n_ok = n < N
    stride = n_rows.to(tl.int64) * N
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    for j in tl.static_range(TOPK):
        flat = t * TOPK + j
        slot = tl.load(f2s_ptr + flat, mask=t_ok, other=-1)
        ok = t_ok & (slot >= 0) & (slot < n_rows)
        e = _expert_of(offs_ptr, slot, E, E_BLOCK)
        y = _split_sum(part_ptr, slot.to(tl.int64)[:, None] * N + n[None, :], ok[:, None] & n_ok[None, :], stride,
                       n_split, "")
        alpha = tl.load(alpha_ptr + e, mask=ok & (e < E), other=0.0) * operand_unscale(FAST, VALUES)
        term = to_f32(round_f32(y * alpha[:, None], Y))
        if HAS_WEIGHTS:
            term = term * tl.load(w_ptr + flat, mask=t_ok, other=0.0)[:, None]
        acc += tl.where(ok[:, None], term, 0.0)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * N + n[None, :], round_f32(acc, out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & n_ok[None, :])
