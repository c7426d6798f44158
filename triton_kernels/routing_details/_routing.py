"""Routing-metadata kernels: expert offsets and the deterministic slot permutations.

The slot of a routed flat index ``i`` (id ``e`` valid) is its rank under the key
``(e, i)`` among all valid flat indices: experts in order, ascending ``i`` within one.
Small problems take one program; larger ones count per chunk, scan, then scatter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._gdc import enter_stage


@triton.jit
def _load_ids(ids_ptr, i, n, E):
    """(ids, valid) for flat indices ``i``; ids outside [0, E) are not routed."""
    ids = tl.load(ids_ptr + i, mask=i < n, other=-1)
    return ids, (i < n) & (ids >= 0) & (ids < E)


@triton.jit
def _count_before(ids_ptr, key, i, lo, hi, E, J_BLOCK: tl.constexpr):
    """For each ``i``, over the routed ``j`` in ``[lo, hi)``: (#{key_j < key_i}, #{key_j == key_i and j < i}).

    The other indices are re-read in blocks of ``J_BLOCK``, so registers hold
    ``len(i) x J_BLOCK`` comparisons at a time.
    """
    less = tl.zeros(key.shape, tl.int32)
    tied = tl.zeros(key.shape, tl.int32)
    for j0 in range(lo, hi, J_BLOCK):
        j = j0 + tl.arange(0, J_BLOCK)
        ids_j, valid_j = _load_ids(ids_ptr, j, hi, E)
        key_j = tl.where(valid_j, ids_j, E)[None, :]
        less += tl.sum(((key_j < key[:, None]) & valid_j[None, :]).to(tl.int32), axis=1)
        tied += tl.sum(((key_j == key[:, None]) & (j[None, :] < i[:, None]) & valid_j[None, :]).to(tl.int32), axis=1)
    return less, tied


@triton.jit
def _expert_counts(ids, valid, e0, E_BLOCK: tl.constexpr):
    """Rows per expert ``e0 .. e0+E_BLOCK-1`` among ``ids`` (int32 [E_BLOCK])."""
    sel = valid & (ids >= e0) & (ids < e0 + E_BLOCK)
    return tl.histogram(tl.where(sel, ids - e0, 0), E_BLOCK, mask=sel)


@triton.jit
def _store_offsets(counts, e0, carry, carry_padded, offs_ptr, bso_ptr, E):
    """Write ``offs[e0+1 ..]`` and ``bso[e0+1 ..]`` for one chunk of counts; return the new carries."""
    ej = e0 + tl.arange(0, counts.shape[0])
    padded = (counts + 127) // 128 * 128
    tl.store(offs_ptr + 1 + ej, tl.cumsum(counts, 0) + carry, mask=ej < E)
    tl.store(bso_ptr + 1 + ej, tl.cumsum(padded, 0) + carry_padded, mask=ej < E)
    return carry + tl.sum(counts, 0), carry_padded + tl.sum(padded, 0)


@triton.jit
def flat_slots(ids_ptr, n, E, BLOCK: tl.constexpr, J_BLOCK: tl.constexpr):
    """``(i, ids, valid, slot)`` of the flat indices ``i < BLOCK`` (``n <= BLOCK``): slot = rank under ``(e, i)``."""
    i = tl.arange(0, BLOCK)
    ids, valid = _load_ids(ids_ptr, i, n, E)
    less, tied = _count_before(ids_ptr, tl.where(valid, ids, E), i, 0, n, E, J_BLOCK)
    return i, ids, valid, less + tied


@triton.jit(do_not_specialize=["n", "E"])
def routing_small_kernel(ids_ptr, offs_ptr, bso_ptr, s2f_ptr, f2s_ptr, n, E,
                         BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, J_BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Everything in one program, for ``n <= BLOCK`` flat indices."""
    enter_stage(PDL)
    route_small(ids_ptr, offs_ptr, bso_ptr, s2f_ptr, f2s_ptr, n, E, BLOCK, E_BLOCK, J_BLOCK)


@triton.jit
def route_small(ids_ptr, offs_ptr, bso_ptr, s2f_ptr, f2s_ptr, n, E,
                BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, J_BLOCK: tl.constexpr):
    """The routing of ``n <= BLOCK`` flat indices by one program (also a program of the fused
    routing-and-quantization kernel, ``quantize_details/_quantize.py``)."""
    i, ids, valid, slot = flat_slots(ids_ptr, n, E, BLOCK, J_BLOCK)
    tl.store(f2s_ptr + i, tl.where(valid, slot, -1), mask=i < n)
    tl.store(s2f_ptr + slot, i, mask=valid)
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    tl.store(s2f_ptr + i, -1, mask=(i < n) & (i >= n_valid))
    tl.store(offs_ptr, 0)
    tl.store(bso_ptr, 0)
    carry = 0
    carry_padded = 0
    for e0 in range(0, E, E_BLOCK):
        counts = _expert_counts(ids, valid, e0, E_BLOCK)
        carry, carry_padded = _store_offsets(counts, e0, carry, carry_padded, offs_ptr, bso_ptr, E)


@triton.jit(do_not_specialize=["n", "E"])
def routing_count_kernel(ids_ptr, hist_ptr, n, E, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    """``hist[c, e]`` = rows of expert ``e`` among flat indices ``c*CHUNK ..`` (one program per chunk)."""
    enter_stage(PDL)
    c = tl.program_id(0)
    ids, valid = _load_ids(ids_ptr, c * CHUNK + tl.arange(0, CHUNK), n, E)
    for e0 in range(0, E, E_BLOCK):
        ej = e0 + tl.arange(0, E_BLOCK)
        tl.store(hist_ptr + c * E + ej, _expert_counts(ids, valid, e0, E_BLOCK), mask=ej < E)


@triton.jit(do_not_specialize=["n_chunks", "E"])
def routing_scan_kernel(hist_ptr, offs_ptr, bso_ptr, n_chunks, E, C_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
    """One program: the offsets, then ``hist[c, e]`` := first slot of expert ``e``'s rows in chunk ``c``."""
    enter_stage(PDL)
    tl.store(offs_ptr, 0)
    tl.store(bso_ptr, 0)
    carry = 0
    carry_padded = 0
    for e0 in range(0, E, E_BLOCK):
        ej = e0 + tl.arange(0, E_BLOCK)
        total = tl.zeros((E_BLOCK,), tl.int32)
        for c0 in range(0, n_chunks, C_BLOCK):
            cj = c0 + tl.arange(0, C_BLOCK)
            ptrs = hist_ptr + cj[:, None] * E + ej[None, :]
            total += tl.sum(tl.load(ptrs, mask=(cj < n_chunks)[:, None] & (ej < E)[None, :], other=0), axis=0)
        start = tl.cumsum(total, 0) - total + carry  # first slot of each expert
        carry, carry_padded = _store_offsets(total, e0, carry, carry_padded, offs_ptr, bso_ptr, E)
        for c0 in range(0, n_chunks, C_BLOCK):
            cj = c0 + tl.arange(0, C_BLOCK)
            ptrs = hist_ptr + cj[:, None] * E + ej[None, :]
            mask = (cj < n_chunks)[:, None] & (ej < E)[None, :]
            h = tl.load(ptrs, mask=mask, other=0)
            tl.store(ptrs, tl.cumsum(h, 0) - h + start[None, :], mask=mask)
            start += tl.sum(h, axis=0)


@triton.jit(do_not_specialize=["n", "E"])
def routing_scatter_kernel(ids_ptr, base_ptr, offs_ptr, s2f_ptr, f2s_ptr, n, E,
                           CHUNK: tl.constexpr, J_BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Slots of chunk ``c``: its experts' first slots plus the rank within the chunk."""
    enter_stage(PDL)
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    ids, valid = _load_ids(ids_ptr, i, n, E)
    end = tl.minimum(c * CHUNK + CHUNK, n)
    _, rank = _count_before(ids_ptr, tl.where(valid, ids, E), i, c * CHUNK, end, E, J_BLOCK)
    slot = tl.load(base_ptr + c * E + ids, mask=valid, other=0) + rank
    tl.store(f2s_ptr + i, tl.where(valid, slot, -1), mask=i < n)
    tl.store(s2f_ptr + slot, i, mask=valid)
    tail = tl.load(offs_ptr + E) + i  # slots past offs[E] hold no row
    tl.store(s2f_ptr + tail, -1, mask=tail < n)
