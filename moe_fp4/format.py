"""The NVFP4 format core: quantization, dequantization and the swizzled scale layout.

Every backend of moe_fp4 must agree with this module bit for bit, so the quantizer is
defined as an exact sequence of IEEE float32 operations (no approximate reciprocals):

For each block of 16 consecutive elements ``x[0..15]`` along the last axis, with the
quantize-direction global scale ``gs`` (``448 * 6 / amax``):

1. ``amax = max_i |x_i|``                       (exact: the inputs are bf16/fp16/fp32)
2. ``s32  = (amax * RCP6) * gs``                (two float32 multiplications, RCP6 = fp32(1/6))
3. ``sf   = e4m3(min(s32, 448))``               (round to nearest even, saturate at 448)
4. ``inv  = gs / f32(sf)``, or 0 if ``sf == 0`` (one correctly rounded float32 division)
5. ``y_i  = x_i * inv``                         (float32 multiplication)
6. ``code_i = signbit(x_i) << 3 | m(|y_i|)`` where ``m`` rounds onto the E2M1 grid
   ``[0, .5, 1, 1.5, 2, 3, 4, 6]`` half-to-even and saturates at 6:
   ``m(v) = [v>.25] + [v>=.75] + [v>1.25] + [v>=1.75] + [v>2.5] + [v>=3.5] + [v>5]``.
7. Pack two codes per byte, element ``2j`` in the low nibble and ``2j+1`` in the high one.

Dequantization is ``x = e2m1(code) * f32(sf) / gs``. The product ``e2m1 * sf`` is exact in
bf16, fp16 and float32 (a 2-bit times a 4-bit significand, magnitudes 2^-10..2688), so
kernels may dequantize operands to 16 bits and apply ``alpha = 1 / (gs_a * gs_w)`` once,
after accumulation.

Block scales have the logical layout ``[rows, K/16]``; kernels read them in the swizzled
128x4 layout of :func:`swizzle_scales` (padding zeroed).
"""

from __future__ import annotations

import torch

from ._checks import check_divisible, check_tensor

__all__ = [
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E4M3_MAX",
    "E2M1_VALUES",
    "FP4_AMAX_SCALE",
    "global_scale_for",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "decode_scaled",
    "e2m1_codes_to_float",
    "pack_e2m1",
    "unpack_e2m1",
    "swizzle_scales",
    "unswizzle_scales",
    "swizzled_offset",
    "swizzled_shape",
    "grouped_scale_rows_bound",
    "blockscale_offsets_from_counts",
    "swizzle_scales_grouped",
    "unswizzle_scales_grouped",
]

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FP4_AMAX_SCALE = E4M3_MAX * E2M1_MAX  # 2688: gs = 2688 / amax
RCP6 = float(torch.tensor(1.0 / 6.0, dtype=torch.float32))  # fp32(1/6) = 0x3E2AAAAB, as kernels use it

# Code -> value for the 16 E2M1 codes (bit 3 = sign; 0x8 is -0).
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SCALE_DTYPES = (torch.float8_e4m3fn,)


# --------------------------------------------------------------------------- global scale


def global_scale_for(x: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Quantize-direction global scale ``448 * 6 / amax(|x|)`` in float32.

    ``dim=None`` reduces over the whole tensor (a 0-d result); otherwise over ``dim``
    (e.g. ``dim=(1, 2)`` gives one scale per expert of ``[E, N, K]`` weights). An all-zero
    input gets scale 1.0 (any positive value quantizes zeros to zero).
    """
    check_tensor("x", x, dtypes=_INPUT_DTYPES)
    a = x.detach().abs().float()
    amax = a.amax() if dim is None else a.amax(dim=dim)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("x: expected finite values, got inf or nan")
    gs = torch.where(amax > 0, FP4_AMAX_SCALE / amax.clamp_min(torch.finfo(torch.float32).tiny), 1.0)
    return gs.to(torch.float32)


def _as_global_scale(global_scale: float | torch.Tensor, x: torch.Tensor, name: str = "global_scale") -> torch.Tensor:
    """Return gs as float32, shaped to broadcast against ``x``'s blocks ``[..., K/16]``."""
    lead = x.shape[:-1]
    if isinstance(global_scale, (int, float)):
        gs = torch.tensor(float(global_scale), dtype=torch.float32, device=x.device)
    elif isinstance(global_scale, torch.Tensor):
        if global_scale.dtype != torch.float32:
            raise TypeError(f"{name}: expected dtype float32, got {str(global_scale.dtype).replace('torch.', '')}")
        if global_scale.device != x.device:
            raise ValueError(
                f"{name}: expected a tensor on {x.device} (the device of x), got one on {global_scale.device}"
            )
        gs = global_scale
        if gs.dim() == 1 and gs.numel() == 1 and (len(lead) == 0 or lead[0] != 1):
            gs = gs.reshape(())
        if tuple(gs.shape) != tuple(lead[: gs.dim()]):
            raise ValueError(
                f"{name}: expected a scalar or a tensor of shape equal to a leading part of {list(lead)}, "
                f"got shape {list(global_scale.shape)}"
            )
    else:
        raise TypeError(f"{name}: expected a float or a float32 tensor, got {type(global_scale).__name__}")
    if not bool(torch.isfinite(gs).all()) or not bool((gs > 0).all()):
        raise ValueError(f"{name}: expected finite positive values (448*6/amax), got {gs.flatten()[:8].tolist()}")
    # One trailing 1 per remaining leading dim, plus one for the K (or K/16) axis.
    return gs.reshape(tuple(gs.shape) + (1,) * (len(lead) - gs.dim() + 1))


# --------------------------------------------------------------------------- E2M1 codes


def _e2m1_magnitude_code(v: torch.Tensor) -> torch.Tensor:
    """Round |y| >= 0 onto the E2M1 grid, half to even, saturating at 6; return codes 0..7."""
    # Ties after an even code round down (strict >), ties after an odd code round up (>=).
    code = (v > 0.25).to(torch.uint8)
    code += v >= 0.75
    code += v > 1.25
    code += v >= 1.75
    code += v > 2.5
    code += v >= 3.5
    code += v > 5.0
    return code


def e2m1_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Codes (uint8 values 0..15) to float32 values."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes ``[..., K]`` to ``[..., K/2]``: element 2j low nibble, 2j+1 high."""
    check_tensor("codes", codes, dtypes=(torch.uint8,))
    check_divisible("codes", codes.shape[-1], 2, "the last dimension")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack uint8 ``[..., K/2]`` to codes ``[..., K]`` (inverse of :func:`pack_e2m1`)."""
    check_tensor("packed", packed, dtypes=(torch.uint8,))
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# --------------------------------------------------------------------------- quantize


def _quantize_blocks(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact quantizer (module docstring) without input checks; ``gs`` already broadcastable."""
    xb = x.float().unflatten(-1, (-1, BLOCK_SIZE))  # [..., K/16, 16]
    amax = xb.abs().amax(dim=-1)  # [..., K/16]
    s32 = (amax * torch.tensor(RCP6, dtype=torch.float32, device=x.device)) * gs
    sf = s32.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    sfd = sf.float()
    inv = torch.where(sfd > 0, gs / sfd.clamp_min(2.0**-9), torch.zeros((), device=x.device))
    y = xb * inv.unsqueeze(-1)
    code = _e2m1_magnitude_code(y.abs()) | (torch.signbit(xb).to(torch.uint8) << 3)
    return pack_e2m1(code.flatten(-2)), sf


def quantize_nvfp4(x: torch.Tensor, global_scale: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` to NVFP4.

    Args:
        x: bf16, fp16 or fp32, ``K % 16 == 0``, finite.
        global_scale: quantize-direction global scale (``448*6/amax``, float32): a float, a
            0-d or 1-element tensor, or a tensor whose shape is a leading part of
            ``x.shape[:-1]`` (e.g. ``[E]`` for ``x [E, N, K]``).

    Returns:
        ``(packed uint8 [..., K/2], scales float8_e4m3fn [..., K/16])``, scales row-major.
    """
    check_tensor("x", x, dtypes=_INPUT_DTYPES, ndim=tuple(range(1, 9)))
    check_divisible("x", x.shape[-1], BLOCK_SIZE, "the last dimension (K)")
    gs = _as_global_scale(global_scale, x)
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("x: expected finite values, got inf or nan")
    return _quantize_blocks(x, gs)


def decode_scaled(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``e2m1 * f32(scale)`` (no global scale) for packed ``[..., K/2]`` and logical scales ``[..., K/16]``.

    Exact in float32: this is what a kernel feeds its tensor cores after in-register dequant.
    """
    vals = e2m1_codes_to_float(unpack_e2m1(packed)).unflatten(-1, (-1, BLOCK_SIZE))
    return (vals * scales.float().unsqueeze(-1)).flatten(-2)


def dequantize_nvfp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: float | torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize ``packed uint8 [..., K/2]`` with ``scales float8_e4m3fn [..., K/16]``.

    Returns ``e2m1 * f32(scale) / global_scale`` in ``dtype`` (computed in float32).
    """
    check_tensor("packed", packed, dtypes=(torch.uint8,), ndim=tuple(range(1, 9)))
    check_tensor("scales", scales, dtypes=_SCALE_DTYPES, ndim=packed.dim())
    if scales.device != packed.device:
        raise ValueError(
            f"scales: expected a tensor on {packed.device} (the device of packed), got one on {scales.device}"
        )
    K = packed.shape[-1] * 2
    if tuple(scales.shape[:-1]) != tuple(packed.shape[:-1]) or scales.shape[-1] * BLOCK_SIZE != K:
        raise ValueError(
            f"scales: expected shape {list(packed.shape[:-1]) + [K // BLOCK_SIZE]} for packed of shape "
            f"{list(packed.shape)}, got {list(scales.shape)}"
        )
    if K % BLOCK_SIZE != 0:
        raise ValueError(f"packed: the unpacked last dimension must be a multiple of 16, got {K}")
    scaled = decode_scaled(packed, scales)
    gs = _as_global_scale(global_scale, scaled)
    return (scaled / gs).to(dtype)


# --------------------------------------------------------------------------- swizzled layout


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Padded ``(Rp, Cp)`` of the 128x4 layout for ``rows x cols`` scales."""
    return (rows + 127) // 128 * 128, (cols + 3) // 4 * 4


def swizzled_offset(r: torch.Tensor | int, c: torch.Tensor | int, cols: int) -> torch.Tensor | int:
    """Byte offset of logical scale ``(r, c)`` in the swizzled layout of a ``cols``-wide matrix."""
    cp = (cols + 3) // 4 * 4
    return (r // 128) * (cp // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Logical ``[..., R, C]`` scales to the swizzled 128x4 layout ``[..., Rp, Cp]``.

    The result's memory is in swizzled order (``off(r, c)`` of :func:`swizzled_offset`,
    independently per leading index); padding rows and columns are zero.
    """
    check_tensor("scales", scales, dtypes=_SCALE_DTYPES + (torch.uint8,), ndim=tuple(range(2, 9)))
    lead, (R, C) = scales.shape[:-2], scales.shape[-2:]
    Rp, Cp = swizzled_shape(R, C)
    b = scales.reshape(-1, R, C).view(torch.uint8)
    padded = torch.zeros((b.shape[0], Rp, Cp), dtype=torch.uint8, device=scales.device)
    padded[:, :R, :C] = b
    out = padded.reshape(-1, Rp // 128, 4, 32, Cp // 4, 4).permute(0, 1, 4, 3, 2, 5).contiguous()
    return out.reshape(*lead, Rp, Cp).view(scales.dtype)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: ``[..., Rp, Cp]`` back to ``[..., rows, cols]``."""
    check_tensor("swizzled", swizzled, dtypes=_SCALE_DTYPES + (torch.uint8,), ndim=tuple(range(2, 9)))
    Rp, Cp = swizzled_shape(rows, cols)
    if tuple(swizzled.shape[-2:]) != (Rp, Cp):
        raise ValueError(
            f"swizzled: expected the last two dimensions to be {[Rp, Cp]} for {rows}x{cols} scales, "
            f"got {list(swizzled.shape[-2:])}"
        )
    lead = swizzled.shape[:-2]
    b = swizzled.contiguous().view(torch.uint8).reshape(-1, Rp // 128, Cp // 4, 32, 4, 4)
    logical = b.permute(0, 1, 4, 3, 2, 5).reshape(-1, Rp, Cp)[:, :rows, :cols]
    return logical.reshape(*lead, rows, cols).contiguous().view(swizzled.dtype)


# --------------------------------------------------------------------------- grouped regions


def grouped_scale_rows_bound(total_rows: int, num_experts: int) -> int:
    """Rows of a grouped scale buffer that holds any routing of ``total_rows`` rows.

    Each non-empty expert's region is rounded up to 128 rows, so the regions take at most
    ``total_rows + 127 * min(E, total_rows)`` rows; rounded up to a multiple of 128.
    """
    bound = total_rows + 127 * min(num_experts, total_rows)
    return (bound + 127) // 128 * 128


def blockscale_offsets_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """``[E]`` row counts to int32 ``[E+1]`` prefix sums of ``ceil(m_e/128)*128``."""
    padded = (counts.to(torch.int64) + 127) // 128 * 128
    return torch.cat([padded.new_zeros(1), padded.cumsum(0)]).to(torch.int32)


def swizzle_scales_grouped(
    scales: torch.Tensor, expert_offsets: torch.Tensor, total_rows_bound: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Swizzle row-grouped scales ``[R, C]`` into per-expert 128x4 regions.

    Rows ``expert_offsets[e] .. expert_offsets[e+1]`` belong to expert ``e``; each expert's
    region starts at row ``blockscale_offsets[e]`` and is an independent swizzled block.
    Returns ``(buffer [rows_bound, Cp], blockscale_offsets int32 [E+1])``; every byte not
    holding a scale is zero. ``rows_bound`` defaults to :func:`grouped_scale_rows_bound`.
    """
    check_tensor("scales", scales, dtypes=_SCALE_DTYPES, ndim=2)
    check_tensor("expert_offsets", expert_offsets, dtypes=(torch.int32, torch.int64), ndim=1)
    R, C = scales.shape
    E = expert_offsets.numel() - 1
    offs = expert_offsets.tolist()
    if offs[0] != 0 or any(b < a for a, b in zip(offs, offs[1:])) or offs[-1] > R:
        raise ValueError(f"expert_offsets: expected non-decreasing offsets from 0 to at most {R}, got {offs}")
    bso = blockscale_offsets_from_counts(torch.tensor([b - a for a, b in zip(offs, offs[1:])]))
    bound = grouped_scale_rows_bound(R, E) if total_rows_bound is None else total_rows_bound
    _, Cp = swizzled_shape(1, C)
    out = torch.zeros((bound, Cp), dtype=torch.uint8, device=scales.device)
    for e in range(E):
        a, b = offs[e], offs[e + 1]
        if b > a:
            region = swizzle_scales(scales[a:b]).view(torch.uint8)
            out[int(bso[e]) : int(bso[e]) + region.shape[0]] = region
    return out.view(scales.dtype), bso.to(scales.device)


def unswizzle_scales_grouped(
    buffer: torch.Tensor, expert_offsets: torch.Tensor, blockscale_offsets: torch.Tensor, cols: int
) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales_grouped`: the ``[expert_offsets[E], cols]`` logical scales."""
    offs = expert_offsets.tolist()
    bso = blockscale_offsets.tolist()
    parts = []
    for e in range(len(offs) - 1):
        m = offs[e + 1] - offs[e]
        if m:
            Rp, _ = swizzled_shape(m, cols)
            parts.append(unswizzle_scales(buffer[bso[e] : bso[e] + Rp], m, cols))
    if not parts:
        return buffer.new_zeros((0, cols))
    return torch.cat(parts)
