"""The MoE pipeline, stage by stage: the contracts every backend's kernels implement.

Each function here is the torch reference of one stage. The Triton kernels
(``moe_fp4.triton_kernels``) and the CUDA kernels (``csrc/``) take and return exactly these
buffers, so any stage of one backend can be checked against the reference and against the
other backend. Shapes use ``M`` tokens, ``topk`` slots per token, ``M_tot = M * topk``,
``E`` experts, ``H`` hidden, ``I`` intermediate.

1. :func:`routing` ``topk_ids -> RoutingData``: rows ("slots") grouped by expert, in
   ascending flat index ``i = t * topk + j`` within an expert (deterministic).
2. :func:`quantize_rows` gather + optional router weight + per-expert NVFP4 quantization
   into packed rows and a grouped, swizzled scale buffer.
3. :func:`grouped_gemm` ``D_e = alpha_e * (A_e . B_e^T)``, fp32 accumulation, 16-bit out.
4. :func:`silu_mul_quantize` ``silu(h[:, :I]) * h[:, I:]`` then per-expert quantization.
5. :func:`grouped_gemm` again with ``w2``.
6. :func:`moe_reduce` un-permute and the top-k weighted sum (fp32, slot order ``j = 0..topk-1``).

Buffer conventions (identical in every backend):

* Grouped scale buffers have :func:`~moe_fp4.format.grouped_scale_rows_bound` rows and
  ``Cp = ceil(K/64)*4`` columns; expert ``e``'s region starts at row
  ``blockscale_offsets[e]``. **Every byte that holds no scale is zero**, including region
  rows past ``m_e``, padded columns and rows past ``blockscale_offsets[E]``.
* Packed activation rows past ``expert_offsets[E]`` (slots left over by ``-1`` ids) are zero.
* Weight scales are swizzled per expert and per *section* of rows
  (:func:`prepare_weight_scales`): w13 has two sections (gate, up), so that gate and up
  can carry different global scales (``alpha [E, 2]``); w2 has one.
* GEMM output rows past ``expert_offsets[E]`` are not written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .format import (
    BLOCK_SIZE,
    _quantize_blocks,
    decode_scaled,
    grouped_scale_rows_bound,
    swizzle_scales,
    swizzled_shape,
    unswizzle_scales,
)

__all__ = [
    "RoutingData",
    "routing",
    "quantize_rows",
    "silu_mul",
    "silu_mul_quantize",
    "prepare_weight_scales",
    "grouped_gemm",
    "moe_reduce",
    "run_pipeline",
]


@dataclass(frozen=True)
class RoutingData:
    """Routing metadata (all int32, on the device of ``topk_ids``).

    expert_offsets:     ``[E+1]`` prefix sums of ``m_e`` (rows per expert; ``-1`` ids excluded).
    blockscale_offsets: ``[E+1]`` prefix sums of ``ceil(m_e/128)*128``.
    slot_to_flat:       ``[M_tot]`` flat index ``t*topk+j`` of each slot; ``-1`` past ``expert_offsets[E]``.
    flat_to_slot:       ``[M_tot]`` slot of each flat index; ``-1`` where the id is ``-1``.
    """

    expert_offsets: torch.Tensor
    blockscale_offsets: torch.Tensor
    slot_to_flat: torch.Tensor
    flat_to_slot: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.expert_offsets.numel() - 1


def routing(topk_ids: torch.Tensor, num_experts: int) -> RoutingData:
    """Reference routing metadata for ``topk_ids int32 [M, topk]`` with values in ``[-1, E)``."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    dev = topk_ids.device
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)[:num_experts]
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    padded = (counts + 127) // 128 * 128
    bso = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    # Stable sort by expert: within an expert, ascending flat index. -1 ids sort last.
    key = torch.where(flat >= 0, flat, num_experts)
    order = torch.sort(key, stable=True).indices
    valid = int(offsets[-1])
    slot_to_flat = torch.full((n,), -1, dtype=torch.int64, device=dev)
    slot_to_flat[:valid] = order[:valid]
    flat_to_slot = torch.full((n,), -1, dtype=torch.int64, device=dev)
    flat_to_slot[order[:valid]] = torch.arange(valid, device=dev)
    i32 = torch.int32
    return RoutingData(offsets.to(i32), bso.to(i32), slot_to_flat.to(i32), flat_to_slot.to(i32))


def _expert_of_slots(expert_offsets: torch.Tensor, n: int) -> torch.Tensor:
    """Expert index of slots ``0..n-1`` (slots past ``expert_offsets[E]`` get ``E``)."""
    s = torch.arange(n, device=expert_offsets.device)
    return torch.searchsorted(expert_offsets[1:].long(), s, right=True)


def _group_quantize(
    rows: torch.Tensor, gs: torch.Tensor, expert_offsets: torch.Tensor, blockscale_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize row-grouped ``rows [M_tot, K]`` per expert into (packed, grouped swizzled scales)."""
    n, K = rows.shape
    E = expert_offsets.numel() - 1
    C = K // BLOCK_SIZE
    _, Cp = swizzled_shape(1, C)
    packed = torch.zeros((n, K // 2), dtype=torch.uint8, device=rows.device)
    sf = torch.zeros((grouped_scale_rows_bound(n, E), Cp), dtype=torch.uint8, device=rows.device)
    offs = expert_offsets.tolist()
    bso = blockscale_offsets.tolist()
    for e in range(E):
        a, b = offs[e], offs[e + 1]
        if b == a:
            continue
        q, s = _quantize_blocks(rows[a:b], gs[e].reshape(()))
        packed[a:b] = q
        region = swizzle_scales(s).view(torch.uint8)
        sf[bso[e] : bso[e] + region.shape[0]] = region
    return packed, sf.view(torch.float8_e4m3fn)


def quantize_rows(
    x: torch.Tensor,
    gs: torch.Tensor,
    expert_offsets: torch.Tensor,
    blockscale_offsets: torch.Tensor,
    slot_to_flat: torch.Tensor | None = None,
    topk: int = 1,
    row_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2: per-expert activation quantization, with an optional fused gather.

    Slot ``s < expert_offsets[E]`` belongs to the expert ``e`` with
    ``expert_offsets[e] <= s < expert_offsets[e+1]`` and holds row
    ``x[slot_to_flat[s] // topk]`` (or ``x[s]`` without ``slot_to_flat``). With
    ``row_scale`` (float32 ``[M_tot]``, the flattened router weights), the row is first
    multiplied by ``row_scale[slot_to_flat[s]]`` in float32 and rounded to ``x.dtype``.
    It is then quantized with ``gs[e]`` (format core).

    Returns ``(packed uint8 [M_tot, K/2], scales float8_e4m3fn [rows_bound, Cp])``.
    """
    if slot_to_flat is None:
        rows = x
    else:
        n = slot_to_flat.numel()
        valid = int(expert_offsets[-1])
        flat = slot_to_flat[:valid].long()
        rows = torch.zeros((n, x.shape[1]), dtype=x.dtype, device=x.device)
        rows[:valid] = x[flat // topk]
        if row_scale is not None:
            rows[:valid] = (rows[:valid].float() * row_scale[flat].unsqueeze(1)).to(x.dtype)
    return _group_quantize(rows, gs, expert_offsets, blockscale_offsets)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """``silu(h[:, :I]) * h[:, I:]``: silu in float32 rounded to 16-bit, the product rounded to 16-bit."""
    I = h.shape[-1] // 2
    g = h[..., :I].float()
    s = (g / (1.0 + torch.exp(-g))).to(h.dtype)
    return (s.float() * h[..., I:].float()).to(h.dtype)


def silu_mul_quantize(
    h: torch.Tensor, gs: torch.Tensor, expert_offsets: torch.Tensor, blockscale_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 4: :func:`silu_mul` of the grouped GEMM1 output, then per-expert quantization.

    Rows past ``expert_offsets[E]`` are ignored (their packed rows are zero).
    """
    valid = int(expert_offsets[-1])
    act = torch.zeros((h.shape[0], h.shape[1] // 2), dtype=h.dtype, device=h.device)
    act[:valid] = silu_mul(h[:valid])
    return _group_quantize(act, gs, expert_offsets, blockscale_offsets)


def prepare_weight_scales(scales: torch.Tensor, sections: int) -> torch.Tensor:
    """Swizzle weight scales ``[E, N, K/16]`` per expert and per row section.

    Returns ``[E, sections, Np_s, Cp]`` with ``Np_s = ceil((N/sections)/128)*128``; section
    ``h`` holds rows ``h*N/sections .. (h+1)*N/sections``. Padding is zero.
    """
    E, N, C = scales.shape
    if N % sections:
        raise ValueError(f"scales: expected rows divisible by {sections} sections, got {N}")
    return swizzle_scales(scales.reshape(E, sections, N // sections, C))


def grouped_gemm(
    a: torch.Tensor,
    a_sf: torch.Tensor,
    b: torch.Tensor,
    b_sf: torch.Tensor,
    alpha: torch.Tensor,
    expert_offsets: torch.Tensor,
    blockscale_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Stages 3 and 5: ``D[rows of e] = alpha[e, section(n)] * sum_k A[m,k] B[e,n,k]``.

    a:     uint8 ``[M_tot, K/2]``; a_sf: grouped swizzled scales ``[rows_bound, Cp]``.
    b:     uint8 ``[E, N, K/2]``;  b_sf: ``[E, S, Np_s, Cp]`` from :func:`prepare_weight_scales`.
    alpha: float32 ``[E, S]`` (``[E]`` means S = 1): ``1/(gs_a * gs_w)`` per section.

    The sum is exact here (float64, then rounded to float32, as an ideal fp32 accumulator
    would give), times alpha in float32, rounded to ``out_dtype``. Rows past
    ``expert_offsets[E]`` are zero in this reference (kernels leave them unwritten).
    """
    n_rows, half_k = a.shape
    K = half_k * 2
    E, N, _ = b.shape
    alpha = alpha.reshape(E, -1)
    S = alpha.shape[1]
    C = K // BLOCK_SIZE
    out = torch.zeros((n_rows, N), dtype=out_dtype, device=a.device)
    offs = expert_offsets.tolist()
    bso = blockscale_offsets.tolist()
    ns = N // S
    Rp_s, _ = swizzled_shape(ns, C)
    for e in range(E):
        lo, hi = offs[e], offs[e + 1]
        if hi == lo:
            continue
        Rp, _ = swizzled_shape(hi - lo, C)
        sfa = unswizzle_scales(a_sf[bso[e] : bso[e] + Rp], hi - lo, C)
        sfb = unswizzle_scales(b_sf[e], ns, C).reshape(N, C)
        A = decode_scaled(a[lo:hi], sfa).double()
        B = decode_scaled(b[e], sfb).double()
        acc = (A @ B.T).float()
        col_alpha = alpha[e].repeat_interleave(ns)
        out[lo:hi] = (acc * col_alpha).to(out_dtype)
    return out


def moe_reduce(
    y: torch.Tensor, flat_to_slot: torch.Tensor, topk_weights: torch.Tensor | None, num_tokens: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """Stage 6: ``out[t] = sum_j w[t,j] * y[flat_to_slot[t*topk+j]]`` over slots with a valid id.

    Summed in float32 in slot order ``j = 0..topk-1`` (each product rounded to float32,
    then added), rounded once to ``out_dtype``. ``topk_weights=None`` gives the plain sum
    (used when the router weights were applied on the input).
    """
    topk = flat_to_slot.numel() // max(num_tokens, 1)
    acc = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
    slots = flat_to_slot.reshape(num_tokens, topk).long()
    for j in range(topk):
        s = slots[:, j]
        ok = s >= 0
        term = y[s.clamp_min(0)].float()
        if topk_weights is not None:
            term = term * topk_weights[:, j].unsqueeze(1)
        acc += torch.where(ok.unsqueeze(1), term, torch.zeros((), device=y.device))
    return acc.to(out_dtype)


def run_pipeline(
    x: torch.Tensor,
    experts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """The whole MoE composed from the stage references (a cross-check of the reference backend)."""
    M, topk = topk_ids.shape
    r = routing(topk_ids, experts.num_experts)
    alpha13, alpha2 = experts.alphas()
    a, a_sf = quantize_rows(
        x, experts.a13_gs, r.expert_offsets, r.blockscale_offsets, r.slot_to_flat, topk,
        topk_weights.reshape(-1).float() if apply_router_weight_on_input else None,
    )
    b13_sf = prepare_weight_scales(experts.w13_scale, 2)
    h = grouped_gemm(a, a_sf, experts.w13, b13_sf, alpha13, r.expert_offsets, r.blockscale_offsets, x.dtype)
    a2, a2_sf = silu_mul_quantize(h, experts.a2_gs, r.expert_offsets, r.blockscale_offsets)
    b2_sf = prepare_weight_scales(experts.w2_scale, 1)
    y = grouped_gemm(a2, a2_sf, experts.w2, b2_sf, alpha2, r.expert_offsets, r.blockscale_offsets, x.dtype)
    return moe_reduce(y, r.flat_to_slot, None if apply_router_weight_on_input else topk_weights.float(), M, x.dtype)
