"""The grouped NVFP4 x NVFP4 GEMM kernel: in-register dequantization, tensor-core dot, per-expert alpha."""

from __future__ import annotations

import triton
import triton.language as tl

from ..numerics_details._nvfp4 import dequantize, round_f32, swizzled_col_offset, swizzled_row_offset


@triton.jit
def find_tile(offs_ptr, E, pid_m, BM: tl.constexpr, E_BLOCK: tl.constexpr):
    """``(e, first local row)`` of M-tile ``pid_m`` when each expert's rows form ``ceil(m_e/BM)`` tiles.

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
    return e, (pid_m - start) * BM


@triton.jit(do_not_specialize=["E", "n_tiles_n"])
def grouped_gemm_kernel(
    a_ptr, a_sf_ptr, b_ptr, b_sf_ptr, alpha_ptr, offs_ptr, bso_ptr, out_ptr,
    N, K2, C, E, NS, NP_S, CP, n_tiles_n,
    S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SWAP_AB: tl.constexpr, DOT_DTYPE: tl.constexpr, E_BLOCK: tl.constexpr,
):
    """``out[slot, n] = alpha[e, n // NS] * sum_k A[slot, k] * B[e, n, k]`` for the rows of each expert.

    ``K2 = K/2`` packed bytes and ``C = K/16`` scales per row (passed so the compiler sees
    their divisibility and vectorizes the loads).

    One program computes a ``BM`` (rows of one expert) x ``BN`` (columns) tile. With
    ``SWAP_AB`` the dot is ``B_tile . A_tile^T`` so the weight rows fill the MMA's M side
    and a small row block (decode) wastes little. Programs past the last tile exit.
    """
    pid = tl.program_id(0)
    pid_m = pid // n_tiles_n
    pid_n = pid % n_tiles_n
    e, row0 = find_tile(offs_ptr, E, pid_m, BM, E_BLOCK)
    if e >= E:
        return
    first = tl.load(offs_ptr + e)
    m_e = tl.load(offs_ptr + e + 1) - first
    region = tl.load(bso_ptr + e)
    r = row0 + tl.arange(0, BM)
    r_ok = r < m_e
    slot = (first + r).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < N
    sec = n // NS  # weight-scale section (gate/up) of each column
    a_rows = a_ptr + slot[:, None] * K2
    b_rows = b_ptr + (e.to(tl.int64) * N + n[:, None]) * K2
    a_sf_rows = a_sf_ptr + region.to(tl.int64) * CP + swizzled_row_offset(r, CP)[:, None]
    b_sf_rows = (b_sf_ptr + (e * S + sec).to(tl.int64)[:, None] * NP_S * CP
                 + swizzled_row_offset(n - sec * NS, CP)[:, None])
    if SWAP_AB:
        acc = tl.zeros((BN, BM), tl.float32)
    else:
        acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K2, BK // 2):  # k0 counts packed bytes
        kb = k0 + tl.arange(0, BK // 2)
        c = k0 // 8 + tl.arange(0, BK // 16)
        c_off = swizzled_col_offset(c)[None, :]
        a_q = tl.load(a_rows + kb[None, :], mask=r_ok[:, None] & (kb < K2)[None, :], other=0)
        a_s = tl.load(a_sf_rows + c_off, mask=r_ok[:, None] & (c < C)[None, :], other=0)
        b_q = tl.load(b_rows + kb[None, :], mask=n_ok[:, None] & (kb < K2)[None, :], other=0)
        b_s = tl.load(b_sf_rows + c_off, mask=n_ok[:, None] & (c < C)[None, :], other=0)
        a = dequantize(a_q, a_s, DOT_DTYPE)
        b = dequantize(b_q, b_s, DOT_DTYPE)
        if DOT_DTYPE == tl.float32:  # the interpreter: exact float32 products
            if SWAP_AB:
                acc = tl.dot(b, tl.trans(a), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            if SWAP_AB:
                acc = tl.dot(b, tl.trans(a), acc)
            else:
                acc = tl.dot(a, tl.trans(b), acc)
    alpha = tl.load(alpha_ptr + e * S + sec, mask=n_ok, other=0.0)
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    if SWAP_AB:
        tl.store(out_ptr + slot[None, :] * N + n[:, None], round_f32(acc * alpha[:, None], OUT),
                 mask=n_ok[:, None] & r_ok[None, :])
    else:
        tl.store(out_ptr + slot[:, None] * N + n[None, :], round_f32(acc * alpha[None, :], OUT),
                 mask=r_ok[:, None] & n_ok[None, :])
