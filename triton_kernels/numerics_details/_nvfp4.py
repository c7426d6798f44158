"""Device helpers for the NVFP4 format, bit-exact on the GPU and in Triton's CPU interpreter.

The format core (``moe_fp4.format``) fixes the quantizer as a sequence of IEEE float32
operations. Everything here is either integer bit manipulation or a single IEEE float32
operation whose result the standard fixes (multiply, add, compare, ``div_rn``), so a CUDA
build and the interpreter compute the same bits. None of it relies on Triton's float casts
to bf16 or fp8: the interpreter truncates float32 -> bf16 and mishandles subnormals, and
the e4m3 rounding must match ``torch.float8_e4m3fn`` exactly, subnormals included.

Kernels that use these helpers are launched with ``enable_fp_fusion=False`` so that no
multiply-add pair is contracted into an FMA (which would change a rounding).
"""

from __future__ import annotations

import triton
import triton.language as tl

# fp32(1/6) = 0x3E2AAAAB, the multiplier of step 2 of the quantizer (its float value is exact).
RCP6: tl.constexpr = tl.constexpr(0.1666666716337204)


# --------------------------------------------------------------------------- 16-bit <-> fp32


@triton.jit
def to_f32(x):
    """bf16, fp16 or fp32 values to float32, exactly (bf16 through its bits)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def round_f32(x, DTYPE: tl.constexpr, HW: tl.constexpr = False):
    """float32 -> ``DTYPE`` (bf16, fp16 or fp32), round to nearest even; NaN stays NaN.

    bf16 is rounded on the bits (the interpreter's own cast truncates), or with ``HW`` (on a GPU
    only) by the hardware's ``cvt.rn.bf16.f32``: the same numbers, but a NaN becomes the canonical
    one (its sign and payload lost), and one instruction per pair instead of about six per value.
    fp16 uses the hardware ``cvt.rn`` on the GPU and numpy's correctly rounded cast in the interpreter.
    """
    if DTYPE == tl.bfloat16 and HW:
        return x.to(tl.bfloat16)
    elif DTYPE == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(x != x, (b >> 16) | 0x40, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16)
    else:
        return x


# --------------------------------------------------------------------------- e4m3 block scales


@triton.jit
def e4m3_encode(v):
    """float32 ``v`` in ``[0, 448]`` (or NaN) -> the float8_e4m3fn byte (int32), nearest even.

    Normal range (``v >= 2^-6``): round the float32 significand to 3 bits on the integer
    bits (a carry into the exponent is the correct result). Subnormal range: adding 2^14
    puts ``v`` where the float32 spacing is 2^-9, the e4m3 subnormal step, so the IEEE add
    rounds it half-to-even onto that grid, exactly. NaN -> 0x7F.
    """
    b = v.to(tl.int32, bitcast=True)
    r = b + 0x7FFFF + ((b >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    small = tl.where(v < 0.015625, v, 0.0)
    byte = tl.where(v < 0.015625, (((small + 16384.0) - 16384.0) * 512.0).to(tl.int32), normal)
    return tl.where(v != v, 0x7F, byte)


@triton.jit
def e4m3_decode(byte):
    """Non-negative float8_e4m3fn bytes (int32) -> float32, exactly; 0x7F -> NaN."""
    exp = (byte >> 3) & 15
    man = byte & 7
    normal = ((exp + 120) << 23) | (man << 20)
    subnormal = (man.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    bits = tl.where(exp == 0, subnormal, normal)
    bits = tl.where((byte & 0x7F) == 0x7F, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


# --------------------------------------------------------------------------- e2m1 elements


@triton.jit
def e2m1_decode(code):
    """E2M1 codes (int32 0..15, bit 3 = sign) -> float32 values, exactly.

    Magnitude codes 2..7 are ``2^(e-1) * (1 + m/2)`` with ``code = 2e + m``: float32 bits
    ``(126 + e) << 23 | m << 22 = (252 + code) << 22``. Code 1 is 0.5 = ``252 << 22``.
    """
    mag = code & 7
    bits = tl.where(mag >= 2, mag + 252, mag * 252) << 22
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_step(v):
    """``(c, bits of t)`` for :func:`e2m1_round` and :func:`e2m1_code`: ``c = min(v, 6)`` and
    ``t = 2^22 * 2^floor(log2 max(c, 1))`` (that float's exponent field plus 22), at most 2^24."""
    c = tl.minimum(v, 6.0)
    return c, (tl.maximum(c, 1.0).to(tl.uint32, bitcast=True) & 0x7F800000) + 0x0B000000


@triton.jit
def e2m1_round(v):
    """``|y|`` (float32 >= 0 or inf) -> the E2M1 magnitude it rounds to, as float32: what
    ``e2m1_decode(e2m1_magnitude(v))`` gives (half to even, saturating at 6), in six operations.

    ``c = min(v, 6)`` is rounded to one significant bit after the point of its binade, the E2M1
    grid from 1 up (1, 1.5 | 2, 3 | 4, 6), and to multiples of 0.5 below 1 (0, 0.5): adding and
    subtracting ``t = 2^22 * 2^floor(log2 max(c, 1))`` (its exponent field plus 22, on the bits) puts
    ``c`` where the float32 spacing is that step, so the IEEE add rounds it half to even, and
    even multiples are the even codes. Clamping first keeps ``t <= 2^24`` and the result <= 6.
    Equal to the comparisons on every float32 in [2^-3, 2^4) (``tests/test_triton_numerics.py``) and, in
    a numpy model, on all 2^31 non-negative patterns but NaN. NaN: unspecified (6 with the GPU's
    ``min``); the quantizers discard it: ``x * inv`` is NaN only for a NaN ``x`` or where the multiplier
    is 0 (``inf * 0``), whose blocks take magnitude 0 (:func:`_e2m1_values`), or inf (``0 * inf``), which
    is split in two first (:func:`_multiplier_factors`).
    """
    c, tb = _e2m1_step(v)
    t = tb.to(tl.float32, bitcast=True)
    return (c + t) - t


@triton.jit
def e2m1_code(v):
    """``|y|`` (float32 >= 0 or inf) -> E2M1 magnitude code 0..7, what :func:`e2m1_magnitude` gives, from
    :func:`e2m1_round`'s add: ``c + t`` holds the multiple ``n`` of the step in its low mantissa bits
    (n <= 4 below 2, 2..4 in [2, 4), 2..3 from 4) and ``t``'s exponent says the binade (0, 1, 2 from
    2^22), so the code is ``n + 2 * binade``. A numpy model matched the comparisons on all 2^31
    non-negative patterns but NaN; ``tests/test_triton_numerics.py`` checks [2^-3, 2^4) whole. NaN:
    unspecified (the comparisons give 0; :func:`quantize_codes_halves` masks the blocks that can hold it)."""
    c, tb = _e2m1_step(v)
    s = (c + tb.to(tl.float32, bitcast=True)).to(tl.uint32, bitcast=True)
    return ((s & 7) + (tb >> 22) - 298).to(tl.int32)


@triton.jit
def e2m1_magnitude(v):
    """``|y|`` (float32 >= 0) -> E2M1 magnitude code 0..7: half to even, saturating at 6."""
    code = (v > 0.25).to(tl.int32)
    code += (v >= 0.75).to(tl.int32)
    code += (v > 1.25).to(tl.int32)
    code += (v >= 1.75).to(tl.int32)
    code += (v > 2.5).to(tl.int32)
    code += (v >= 3.5).to(tl.int32)
    code += (v > 5.0).to(tl.int32)
    return code


# --------------------------------------------------------------------------- GEMM operands
#
# The GEMMs multiply fp16 operands ``x = e2m1 * e4m3 * 2^-X`` with float32 accumulation and
# undo the 2^(2X) in the epilogue. ``v = e2m1 * e4m3`` has at most 6 significant bits and is
# a multiple of 2^-10 with |v| <= 2688, so ``v * 2^-X`` is an fp16 number for X = 7 (a
# multiple of 2^-17, on fp16's subnormal grid of 2^-24, below 21) and a normal one for
# X = 4 (in [2^-14, 168]). Each product of two operands is exact in the MMA, and the float32
# accumulation of ``v_a v_b 2^-2X`` is that of ``v_a v_b`` scaled by a power of two (the same
# roundings). Two constructions (constexpr ``FAST``):
#
# * FAST, X = 7: fp16 bits straight from the nibbles (``e2m1 * 2^-14``, code 1 is the
#   subnormal 2^-15) times the scale as fp16 ``e4m3 * 2^7``: about two integer operations
#   and half an fp16x2 multiply per element (on word pairs), but subnormal fp16 values in the
#   multiply and in the MMA (tests/test_triton_stages.py and benchmarks/tune_triton.py check
#   every code and scale through the GEMM).
# * not FAST, X = 4: each element decoded in float32 (``e2m1_decode * e4m3_decode``),
#   scaled and rounded to fp16 once: no subnormal anywhere; slower.
#
# The packed bytes are never reordered: a K step's bytes are read as little-endian int32
# words, and nibble ``j`` (0..3) of both 16-bit halves of every word goes to the ``j``-th of
# four operand tiles. A and B are split identically, so the four dots add exactly the
# products of one dot over K, in another order; the 8 elements of a word share one scale
# (words are 4-byte aligned inside the 8-byte scale blocks).


@triton.jit
def operand_unscale(FAST: tl.constexpr, VALUES: tl.constexpr = False):
    """2^(2X): the epilogue factor that undoes both operands' 2^-X (2^X with ``VALUES``: the
    activation operand is fp16 ``e2m1 * e4m3`` as the quantization stage wrote it, unscaled)."""
    if VALUES:
        if FAST:
            return 128.0
        else:
            return 16.0
    elif FAST:
        return 16384.0
    else:
        return 256.0


@triton.jit
def e2m1_pair_bits(w, J: tl.constexpr):
    """fp16x2 bits (int32) of ``e2m1 * 2^-14`` for nibble ``J`` of both 16-bit halves of the words ``w``.

    A code ``s e e m`` becomes fp16 ``s 000 eem 000000000``: magnitude bits to bits 9..11
    (exponent 0..3, mantissa msb), sign to bit 15; so code 1 (0.5) is the subnormal 2^-15 and
    code ``2e + m`` (e >= 1) is ``2^(e-15) (1 + m/2)``, both ``e2m1 * 2^-14``.
    """
    S: tl.constexpr = 4 * J
    if S <= 9:
        mag = (w << (9 - S)) & 0x0E000E00
    else:
        mag = (w >> (S - 9)) & 0x0E000E00
    if S <= 12:
        sign = (w << (12 - S)) & -0x7FFF8000  # 0x80008000 as an int32
    else:
        sign = (w >> (S - 12)) & -0x7FFF8000
    return mag | sign


@triton.jit
def k16_pair_bits(w, J: tl.constexpr):
    """:func:`e2m1_pair_bits` for words in the K16 layout (``moe_fp4.triton_kernels.gemm.K16_SHIFTS``).

    There tile ``J``'s magnitude bits (both halves) sit where one shift by the table's first
    entry moves them to bits 9..11 and its sign bits where the second moves them to bit 15,
    so tiles 0 and 1 take one mask each (shift 0 and 8 for both fields) and tiles 2 and 3 two
    masked shifts: 11 integer operations per word for its four fp16x2 pairs (15 canonically).
    """
    if J == 0:
        return w & -0x71FF7200  # 0x8E008E00 as an int32
    elif J == 1:
        return (w << 8) & -0x71FF7200
    elif J == 2:
        return ((w >> 3) & 0x0E000E00) | ((w << 7) & -0x7FFF8000)
    else:
        return ((w << 5) & 0x0E000E00) | ((w << 15) & -0x7FFF8000)


@triton.jit
def _halves(w):
    """int32 ``[R, W]`` -> its 16-bit halves as int16 ``[R, 2W]``, the low half of word ``i`` at ``2i``."""
    return tl.reshape(tl.join(w.to(tl.int16), (w >> 16).to(tl.int16)), (w.shape[0], 2 * w.shape[1]))


@triton.jit
def mul_f16(x, s, ASM: tl.constexpr):
    """``x * s`` in fp16, round to nearest (exact here). ``ASM``: one ``mul.rn.f16x2`` per register pair.

    The inline assembly keeps ptxas from swapping the halves of every pair before and after
    the multiply (two PRMTs per pair with plain fp16 multiplies); the interpreter cannot run it.
    """
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [x, s], dtype=tl.float16,
                                         is_pure=True, pack=2)
    else:
        return x * s


@triton.jit
def operand_scales(scale_bytes, FAST: tl.constexpr, REP: tl.constexpr = 4):
    """Each element's scale factor ``[R, REP*G]`` for the tiles of :func:`operand_tile`: each of the
    ``G`` scales of ``scale_bytes [R, G]`` serves ``REP`` consecutive tile columns (4 in the
    canonical layout, where ``W = 2G`` packed words hold ``G`` blocks of 16; 16 in the K16 layout,
    for the bytes :func:`k16_tile_scales` picks).

    One scale per 16 elements. FAST: fp16 ``e4m3 * 2^7``
    (``(b & 0x7F) << 7`` is fp16 ``e4m3 * 2^-8``, subnormal scales too; the multiply by 2^15
    is exact as ``448 * 2^7 < 65504``); otherwise float32 ``e4m3 * 2^-4``. Scale bytes are
    never 0x7F (NaN).
    """
    R: tl.constexpr = scale_bytes.shape[0]
    G: tl.constexpr = scale_bytes.shape[1]
    if FAST:
        s = ((scale_bytes.to(tl.int16) & 0x7F) << 7).to(tl.float16, bitcast=True) * 32768.0
    else:
        s = e4m3_decode(scale_bytes.to(tl.int32)) * 0.0625
    return tl.reshape(tl.broadcast_to(s[:, :, None], (R, G, REP)), (R, REP * G))


@triton.jit
def k16_tile_scales(scale_words, J: tl.constexpr):
    """The scale bytes ``[R, G]`` of nibble tile ``J`` of a K step in the K16 weight layout.

    ``scale_words [R, G]``: int32 word ``g`` holds the step's blocks ``4g .. 4g + 3`` (one
    4-byte column group of the swizzled layout, :func:`load_scale_words`). In the K16 layout
    (``triton_kernels/gemm.py``) column ``16g + t`` of tile ``J`` is element ``64g + 16J + t``
    of the step, so tile ``J`` takes block ``4g + J``: byte ``J`` of word ``g``, one shift and
    one mask in registers.
    """
    return (scale_words >> (8 * J)) & 0xFF


@triton.jit
def operand_tile(words, scales, J: tl.constexpr, FAST: tl.constexpr, ASM: tl.constexpr, K16: tl.constexpr = False):
    """Operand tile ``J`` (0..3): fp16 ``e2m1 * e4m3 * 2^-X`` ``[R, 2W]`` of packed words ``[R, W]``.

    Element ``2i + h`` is nibble ``J`` of half ``h`` of word ``i`` (``K16``: the code of tile
    ``J``, half ``h`` in the K16 layout, :func:`k16_pair_bits`); ``scales`` from
    :func:`operand_scales`. FAST: the bits of :func:`e2m1_pair_bits` times the fp16 scale;
    otherwise the float32 decode times the float32 scale, rounded to fp16 once (exact).
    """
    if K16:
        bits = k16_pair_bits(words, J)
    else:
        bits = e2m1_pair_bits(words, J)
    if FAST:
        return mul_f16(_halves(bits).to(tl.float16, bitcast=True), scales, ASM)
    else:
        if K16:
            half = _halves(bits).to(tl.int32)  # fp16 bits s000eem000000000 (sign-extended)
            codes = ((half >> 9) & 7) | ((half >> 12) & 8)
        else:
            codes = (_halves(words).to(tl.int32) >> (4 * J)) & 15
        return (e2m1_decode(codes) * scales).to(tl.float16)


# --------------------------------------------------------------------------- the quantizer


# Whether quantize_values rounds to the e2m1 grid on the float's bits (e2m1_round) instead of through
# the codes (e2m1_magnitude, e2m1_decode): the same bytes. The quantization kernel's values rows with
# ``QuantConfig.whole_blocks`` always round on the bits (quantize_values_halves); this switch is for
# the rows without it and the GEMM's SiLU epilogue. Off until it has run and been timed on the H200.
E2M1_BIT_ROUND: tl.constexpr = tl.constexpr(False)


@triton.jit
def _amax(bits, axis: tl.constexpr):
    """The largest magnitude along ``axis`` of float32 values given as int32 ``bits``, taken on the
    magnitude bits (integer max orders non-negative floats and lets NaN win)."""
    return tl.max(bits & 0x7FFFFFFF, axis=axis).to(tl.float32, bitcast=True)


@triton.jit
def _block_scale(amax, gs):
    """``(scale byte int32, scale value float32, gs / scale)`` of blocks whose magnitudes peak at ``amax``,
    with global scale ``gs`` (broadcast to ``amax``'s shape): the format core's steps, the one division
    ``div_rn``, nothing fused; a zero scale gets the multiplier 0."""
    s32 = (amax * RCP6) * gs
    sf = e4m3_encode(tl.minimum(s32, 448.0, propagate_nan=tl.PropagateNan.ALL))
    sf_val = e4m3_decode(sf)
    gs_b = tl.full(sf_val.shape, 0.0, tl.float32) + gs
    inv = tl.where(sf_val > 0, tl.math.div_rn(gs_b, tl.maximum(sf_val, 0.001953125)), 0.0)
    return sf, sf_val, inv


@triton.jit
def _multiplier_factors(inv):
    """``(live, a, b)`` for multipliers ``inv [R, NB]``, each ``[R, NB, 1]`` (to broadcast over a block's
    elements): ``live`` where ``inv > 0`` (:func:`_e2m1_values`), and ``(x * a) * b`` quantizing like
    ``x * inv`` for every element of the block.

    ``inv = gs / scale`` overflows to inf where a global scale past 2^118 meets a small scale. The
    format core then gets ``x * inf``: inf for ``x != 0`` (code 7) and NaN for a zero (code 0 by the
    comparisons), which the six-operation roundings would not give (``e2m1_round(NaN)`` is
    unspecified). There ``a = b = 2^127``: any nonzero float32 times 2^254 is past 6 (code 7) and zero
    stays zero. Elsewhere ``b = 1`` and ``(x * inv) * 1`` is ``x * inv`` exactly.
    """
    over = inv == float("inf")
    a = tl.where(over, 1.7014118346046923e38, inv)
    b = tl.where(over, 1.7014118346046923e38, 1.0)
    return (inv > 0)[:, :, None], a[:, :, None], b[:, :, None]


@triton.jit
def _e2m1_values(x, bits, inv_a, inv_b, live, sf_val):
    """The quantized values ``e2m1 * scale`` (float32, exact) of elements ``x`` (``bits`` their int32
    bits) of blocks with multiplier factors ``inv_a``, ``inv_b`` (:func:`_multiplier_factors`) and scale
    value ``sf_val``: :func:`e2m1_round` of ``|x * inv|`` with ``x``'s sign (a zero keeps it, as its code
    does), times the scale. Where the block's multiplier is 0 (``live`` false: a zero or NaN scale, or
    ``gs / scale`` underflowed) the magnitude is 0, as the comparisons give ``x * 0`` (0, or NaN for an
    inf or NaN ``x``); times a NaN scale it is still NaN."""
    q = tl.where(live, e2m1_round(tl.abs((x * inv_a) * inv_b)), 0.0).to(tl.int32, bitcast=True)
    return (q | (bits & -0x80000000)).to(tl.float32, bitcast=True) * sf_val


@triton.jit
def _block_scales(x, gs):
    """The scale half of the format core's quantizer on ``x float32 [R, KB]`` (KB a multiple of 16) with
    global scale ``gs``: ``(x [R, KB/16, 16], its bits, scale bytes int32 [R, KB/16], scale values float32,
    inv = gs / scale [R, KB/16])``."""
    R: tl.constexpr = x.shape[0]
    KB: tl.constexpr = x.shape[1]
    xb = tl.reshape(x, (R, KB // 16, 16))
    bits = xb.to(tl.int32, bitcast=True)
    sf, sf_val, inv = _block_scale(_amax(bits, 2), gs)
    return xb, bits, sf, sf_val, inv


@triton.jit
def _quantize_blocks(x, gs):
    """The format core's quantizer on ``x float32 [R, KB]`` (KB a multiple of 16) with global scale ``gs``.

    Returns ``(codes int32 [R, KB/16, 16], scale bytes int32 [R, KB/16], scale values float32
    [R, KB/16])`` (:func:`_block_scales`).
    """
    xb, bits, sf, sf_val, inv = _block_scales(x, gs)
    return e2m1_magnitude(tl.abs(xb * inv[:, :, None])) | ((bits >> 28) & 8), sf, sf_val


@triton.jit
def quantize(x, gs):
    """:func:`_quantize_blocks` as stored: ``(packed uint8 [R, KB/2], scale bytes uint8 [R, KB/16])``."""
    R: tl.constexpr = x.shape[0]
    KB: tl.constexpr = x.shape[1]
    code, sf, _ = _quantize_blocks(x, gs)
    lo, hi = tl.split(tl.reshape(code, (R, KB // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8), sf.to(tl.uint8)


@triton.jit
def quantize_values(x, gs, BIT_ROUND: tl.constexpr = E2M1_BIT_ROUND):
    """:func:`_quantize_blocks` as the GEMMs' 16-bit operand: fp16 ``e2m1 * e4m3`` ``[R, KB]`` (the global
    scale left to the GEMM's alpha).

    Exact: the float32 product has at most 6 significant bits and lies in ``[2^-10, 2688]``
    (or is zero), a normal fp16 number, so the conversion does not round.
    """
    R: tl.constexpr = x.shape[0]
    KB: tl.constexpr = x.shape[1]
    if BIT_ROUND:
        xb, bits, _, sf_val, inv = _block_scales(x, gs)
        live, inv_a, inv_b = _multiplier_factors(inv)
        return tl.reshape(_e2m1_values(xb, bits, inv_a, inv_b, live, sf_val[:, :, None]), (R, KB)).to(tl.float16)
    code, _, sf_val = _quantize_blocks(x, gs)
    return tl.reshape(e2m1_decode(code) * sf_val[:, :, None], (R, KB)).to(tl.float16)


@triton.jit
def _halves_scale(lo, hi, gs):
    """The scale half of the quantizer on blocks held as halves (:func:`quantize_values_halves`): ``(bits of
    lo, bits of hi, scale bytes, scale values, live, a, b)`` (the last three: :func:`_multiplier_factors`)."""
    b_lo = lo.to(tl.int32, bitcast=True)
    b_hi = hi.to(tl.int32, bitcast=True)
    sf, sf_val, inv = _block_scale(tl.maximum(_amax(b_lo, 2), _amax(b_hi, 2)), gs)
    live, inv_a, inv_b = _multiplier_factors(inv)
    return b_lo, b_hi, sf, sf_val, live, inv_a, inv_b


@triton.jit
def quantize_values_halves(lo, hi, gs):
    """:func:`quantize_values` (rounding on the bits) of blocks held as halves: ``lo``, ``hi`` float32
    ``[R, NB, 8]`` are elements 0..7 and 8..15 of ``NB`` blocks (``gs`` ``[R, 1]`` or scalar); returns their
    fp16 values ``(lo, hi)``.

    Loaded as two tensors of 8 contiguous elements, the halves of a block land in one thread, so the
    block's maximum, scale and division are that thread's alone: no shuffle and no second thread
    computing the same scale, as the 16-wide form gets with 8-element (16-byte) vectors.
    """
    b_lo, b_hi, _, sf_val, live, inv_a, inv_b = _halves_scale(lo, hi, gs)
    sf_val = sf_val[:, :, None]
    return (_e2m1_values(lo, b_lo, inv_a, inv_b, live, sf_val).to(tl.float16),
            _e2m1_values(hi, b_hi, inv_a, inv_b, live, sf_val).to(tl.float16))


@triton.jit
def quantize_codes_halves(lo, hi, gs):
    """The format core's quantizer on blocks held as halves (:func:`quantize_values_halves`): ``(packed lo,
    packed hi, scale bytes)``, the packed bytes uint8 ``[R, NB, 4]`` of each half (element ``2i`` in the low
    nibble of byte ``i``) and the scale bytes int32 ``[R, NB]``; codes by :func:`e2m1_code`.

    A block whose multiplier is 0 (a zero or NaN scale, or ``gs / scale`` underflowed) gets magnitude
    codes 0, as the comparisons give it (``x * 0`` is 0, or NaN for an inf or NaN ``x``, which
    :func:`e2m1_code` leaves unspecified): one select per element on a per-block predicate instead of a
    NaN test per element. An overflowed multiplier is split in two (:func:`_multiplier_factors`).
    """
    R: tl.constexpr = lo.shape[0]
    NB: tl.constexpr = lo.shape[1]
    b_lo, b_hi, sf, _, live, inv_a, inv_b = _halves_scale(lo, hi, gs)
    c_lo = tl.where(live, e2m1_code(tl.abs((lo * inv_a) * inv_b)), 0) | ((b_lo >> 28) & 8)
    c_hi = tl.where(live, e2m1_code(tl.abs((hi * inv_a) * inv_b)), 0) | ((b_hi >> 28) & 8)
    e_lo, o_lo = tl.split(tl.reshape(c_lo, (R, NB, 4, 2)))
    e_hi, o_hi = tl.split(tl.reshape(c_hi, (R, NB, 4, 2)))
    return (e_lo | (o_lo << 4)).to(tl.uint8), (e_hi | (o_hi << 4)).to(tl.uint8), sf


# --------------------------------------------------------------------------- layouts


@triton.jit
def swizzled_row_offset(r, CP):
    """The row part of the byte offset of scale ``(r, c)`` in the 128x4 swizzled layout with ``CP`` columns.

    512-byte atoms of 128 rows x 4 columns, K atoms inner, row bands outer: the offset is
    ``swizzled_row_offset(r, CP) + swizzled_col_offset(c)`` (hoist the row part out of K loops).
    """
    return (r // 128) * (CP * 128) + (r % 32) * 16 + ((r % 128) // 32) * 4


@triton.jit
def swizzled_col_offset(c):
    """The column part of the swizzled offset (see :func:`swizzled_row_offset`)."""
    return (c // 4) * 512 + (c % 4)


@triton.jit
def count_le(ptr, n, value, BLOCK: tl.constexpr):
    """``#{j < n : ptr[j] <= value}`` for an int32 array in global memory (chunks of BLOCK)."""
    total = 0
    for start in range(0, n, BLOCK):
        j = start + tl.arange(0, BLOCK)
        v = tl.load(ptr + j, mask=j < n, other=0)
        total += tl.sum(((v <= value) & (j < n)).to(tl.int32), axis=0)
    return total
