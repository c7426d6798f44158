"""An independent, deliberately naive NVFP4 quantizer for the tests (numpy, element by element).

It shares no code with ``moe_fp4.format``: E4M3 rounding is a brute-force search over the
decoded values of all 256 bytes, and E2M1 rounding a search over the 8 grid values, both
with explicit tie-to-even rules. The float32 operation sequence is the one the format
core documents in its module docstring, executed with numpy float32 scalars.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)
RCP6 = F32(1.0) / F32(6.0)


def e4m3_decode(byte: int) -> float:
    """Value of one float8_e4m3fn byte (NaN for 0x7f/0xff)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp = (byte >> 3) & 0xF
    man = byte & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        return sign * man * 2.0**-9
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


_POS = [(e4m3_decode(b), b) for b in range(0x7F)]  # all finite non-negative values, ascending


def e4m3_round(v: float) -> tuple[int, float]:
    """Round v >= 0 to the nearest finite e4m3 value, ties to even mantissa, saturate at 448."""
    if v >= 448.0:
        return 0x7E, 448.0
    best = min(_POS, key=lambda p: (abs(p[0] - v), p[1] & 1))
    return best[1], best[0]


def e2m1_round(v: float) -> int:
    """Magnitude code 0..7 of v >= 0: nearest grid value, ties to the even code, saturating at 6."""
    if v >= 6.0:
        return 7
    d = np.abs(E2M1_GRID - v)
    cands = np.flatnonzero(d == d.min())
    return int(cands[0] if len(cands) == 1 else [c for c in cands if c % 2 == 0][0])


def quantize_block(x: np.ndarray, gs: float) -> tuple[list[int], int]:
    """Quantize 16 values (float32) with global scale gs: (codes, scale byte)."""
    xs = x.astype(F32)
    amax = F32(np.max(np.abs(xs)))
    s32 = F32(F32(amax * RCP6) * F32(gs))
    sf_byte, sf_val = e4m3_round(float(s32))
    sfd = F32(sf_val)
    inv = F32(F32(gs) / sfd) if sfd > 0 else F32(0.0)
    codes = []
    for xi in xs:
        y = F32(xi * inv)
        codes.append(e2m1_round(float(abs(y))) | (8 if np.signbit(xi) else 0))
    return codes, sf_byte


def quantize(x: np.ndarray, gs: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[R, K]`` -> (packed uint8 [R, K/2], scale bytes uint8 [R, K/16])."""
    R, K = x.shape
    packed = np.zeros((R, K // 2), dtype=np.uint8)
    scales = np.zeros((R, K // 16), dtype=np.uint8)
    for r in range(R):
        for g in range(K // 16):
            codes, sb = quantize_block(x[r, 16 * g : 16 * g + 16], gs)
            scales[r, g] = sb
            for j in range(8):
                packed[r, 8 * g + j] = codes[2 * j] | (codes[2 * j + 1] << 4)
    return packed, scales
