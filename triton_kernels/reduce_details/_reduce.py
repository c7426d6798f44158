"""The un-permute + top-k weighted reduction (deterministic: a fixed order, no atomic sums); ``topk_sum`` also
serves the GEMM that takes the reduce into its own launch."""

from __future__ import annotations

import triton
import triton.language as tl

from .._gdc import enter_stage
from ..numerics_details._nvfp4 import round_f32, to_f32


@triton.jit
def topk_sum(y_ptr, f2s_ptr, w_ptr, t, h, t_ok, h_ok, H, n_slots, TOPK: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
             CACHE: tl.constexpr):
    """``sum_j w[t, j] * y[flat_to_slot[t*TOPK + j], h]`` for tokens ``t`` and columns ``h`` (``y [n_slots, H]``),
    float32 in slot order j = 0..TOPK-1, not rounded.

    Each product is rounded to float32 and then added (the callers' launches disable FMA
    contraction); slots that are -1 (or out of range) contribute an exact 0. The loop over
    j is unrolled, so all TOPK row loads are in flight together (decode is latency-bound).
    ``CACHE``: the cache modifier of the ``y`` loads (``".cg"`` where other programs of the same
    launch wrote ``y``).
    """
    acc = tl.zeros((t.shape[0], h.shape[0]), tl.float32)
    for j in tl.static_range(TOPK):
        flat = t * TOPK + j
        slot = tl.load(f2s_ptr + flat, mask=t_ok, other=-1)
        ok = t_ok & (slot >= 0) & (slot < n_slots)
        term = to_f32(tl.load(y_ptr + slot.to(tl.int64)[:, None] * H + h[None, :],
                              mask=ok[:, None] & h_ok[None, :], other=0.0, cache_modifier=CACHE))
        if HAS_WEIGHTS:
            term = term * tl.load(w_ptr + flat, mask=t_ok, other=0.0)[:, None]
        acc += tl.where(ok[:, None], term, 0.0)
    return acc


@triton.jit(do_not_specialize=["M", "n_slots"])
def moe_reduce_kernel(y_ptr, f2s_ptr, w_ptr, out_ptr, M, H, n_slots,
                      TOPK: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                      PDL: tl.constexpr = False):
    """``out[t] = sum_j w[t, j] * y[flat_to_slot[t*TOPK + j]]`` in float32, slot order j = 0..TOPK-1
    (:func:`topk_sum`), rounded once to ``out``'s dtype."""
    enter_stage(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < M
    h_ok = h < H
    acc = topk_sum(y_ptr, f2s_ptr, w_ptr, t, h, t_ok, h_ok, H, n_slots, TOPK, HAS_WEIGHTS, "")
    tl.store(out_ptr + t.to(tl.int64)[:, None] * H + h[None, :], round_f32(acc, out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & h_ok[None, :])
