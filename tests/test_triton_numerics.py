"""Bit-exactness of the Triton NVFP4 device helpers against torch and the format core.

Each helper of ``triton_kernels/numerics_details/_nvfp4.py`` runs in a one-program test
kernel on the ``device`` fixture: compiled on a GPU, in Triton's CPU interpreter here. All
comparisons are exact (bytes or bits): the helpers promise the same bits as
``torch.Tensor.to`` (e4m3 after clamping to 448, bf16, fp16) and ``moe_fp4.format``.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moe_fp4.format import E2M1_VALUES, RCP6, _e2m1_magnitude_code, _quantize_blocks, decode_scaled
from moe_fp4.triton_kernels._common import EXACT  # the launch options of the production kernels
from moe_fp4.triton_kernels.numerics_details import _nvfp4 as nv

pytestmark = pytest.mark.interpreter

BLOCK = 1024


def test_kernel_constants_equal_the_format_core():
    # triton_kernels imports nothing of moe_fp4, so it states the quantizer's constants itself.
    from moe_fp4.format import BLOCK_SIZE as FORMAT_BLOCK
    from moe_fp4.triton_kernels._common import BLOCK_SIZE

    assert nv.RCP6.value == RCP6 and BLOCK_SIZE == FORMAT_BLOCK


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


@triton.jit
def _e4m3_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + i, mask=i < n, other=0.0)
    byte = nv.e4m3_encode(tl.minimum(v, 448.0, propagate_nan=tl.PropagateNan.ALL))
    tl.store(out_ptr + i, byte.to(tl.uint8), mask=i < n)


@triton.jit
def _e4m3_decode_kernel(b_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, nv.e4m3_decode(tl.load(b_ptr + i).to(tl.int32)))


@triton.jit
def _round_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + i, nv.round_f32(v, out_ptr.dtype.element_ty), mask=i < n)


@triton.jit
def _to_f32_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, nv.to_f32(tl.load(x_ptr + i, mask=i < n, other=0.0)), mask=i < n)


@triton.jit
def _e2m1_kernel(code_ptr, v_ptr, val_ptr, mag_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(val_ptr + i, nv.e2m1_decode(tl.load(code_ptr + i)))
    tl.store(mag_ptr + i, nv.e2m1_magnitude(tl.load(v_ptr + i)))


@triton.jit
def _quantize_kernel(x_ptr, gs_ptr, q_ptr, sf_ptr, R: tl.constexpr, KB: tl.constexpr):
    r = tl.arange(0, R)
    k = tl.arange(0, KB)
    x = nv.to_f32(tl.load(x_ptr + r[:, None] * KB + k[None, :]))
    packed, scales = nv.quantize(x, tl.load(gs_ptr))
    kq = tl.arange(0, KB // 2)
    kc = tl.arange(0, KB // 16)
    tl.store(q_ptr + r[:, None] * (KB // 2) + kq[None, :], packed)
    tl.store(sf_ptr + r[:, None] * (KB // 16) + kc[None, :], scales)


@triton.jit
def _operand_kernel(q_ptr, sf_ptr, out_ptr, R: tl.constexpr, W: tl.constexpr, FAST: tl.constexpr):
    """The four GEMM operand tiles of ``R`` rows of ``W`` packed words, stored as ``out[j, r, 2i + h]``."""
    r = tl.arange(0, R)
    words = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + r[:, None] * W + tl.arange(0, W)[None, :])
    s = tl.load(sf_ptr + r[:, None] * (W // 2) + tl.arange(0, W // 2)[None, :])
    scales = nv.operand_scales(s, FAST)
    k = tl.arange(0, 2 * W)
    for j in tl.static_range(4):
        tile = nv.operand_tile(words, scales, j, FAST, False)
        tl.store(out_ptr + j * R * 2 * W + r[:, None] * 2 * W + k[None, :], tile)


def _e4m3_probe_values() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours (the ties) and one float32 ulp either side."""
    vals = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (vals[:-1].double() + vals[1:].double()) / 2  # exact in float32 (e4m3 has 4 significant bits)
    mids = mids.float()
    up = torch.nextafter(mids, torch.tensor(float("inf")))
    down = torch.nextafter(mids, torch.tensor(0.0))
    g = torch.Generator().manual_seed(0)
    rand = torch.cat([torch.rand(4000, generator=g) * 448, torch.rand(2000, generator=g) * 2**-6,
                      2.0 ** (torch.rand(2000, generator=g) * 30 - 20)])
    specials = torch.tensor([0.0, 2.0**-10, 2.0**-11, 2.0**-149, 448.0, 449.0, 464.0, 480.0, 1e30,
                             float("inf"), float("nan")])
    return torch.cat([vals, mids, up, down, rand, specials]).contiguous()


def test_e4m3_encode_matches_torch_float8_cast(device):
    """The scale rounding equals torch's float8_e4m3fn cast after clamping to 448, subnormals and ties included."""
    v = _e4m3_probe_values().to(device)
    got = torch.empty(v.shape, dtype=torch.uint8, device=device)
    _e4m3_kernel[_grid(v.numel())](v, got, v.numel(), BLOCK=BLOCK, **EXACT)
    want = v.clamp(max=448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(v[i]), int(got[i]), int(want[i])) for i in bad[:8]]


def test_e4m3_decode_every_byte(device):
    """Decoding all 128 non-negative bytes gives torch's values (NaN for 0x7F)."""
    b = torch.arange(128, dtype=torch.uint8, device=device)
    got = torch.empty(128, dtype=torch.float32, device=device)
    _e4m3_decode_kernel[(1,)](b, got, BLOCK=128, **EXACT)
    want = b.view(torch.float8_e4m3fn).float()
    assert torch.equal(got[:127], want[:127]) and bool(got[127].isnan())


def _round_probe_values(dtype: torch.dtype) -> torch.Tensor:
    """Random float32 over many binades, the dtype's exact ties, subnormals, overflow, inf and NaN."""
    g = torch.Generator().manual_seed(1)
    finfo = torch.finfo(dtype)
    rand = torch.randn(6000, generator=g) * 2.0 ** torch.randint(-30, 30, (6000,), generator=g).float()
    reps = torch.randn(3000, generator=g).to(dtype).float()
    nxt = torch.nextafter(reps.to(dtype), torch.tensor(float("inf"), dtype=dtype)).float()
    ties = (reps.double() + nxt.double()) / 2  # halfway between neighbours: exact in float32
    ties = ties.float()
    sub = torch.tensor([finfo.tiny, finfo.tiny / 3, finfo.tiny * 0.75, -finfo.tiny / 5, 1e-45])
    big = torch.tensor([finfo.max, finfo.max * 1.001, -finfo.max * 1.01, 3.4e38, float("inf"), -float("inf"), -0.0])
    return torch.cat([rand, reps, ties, torch.nextafter(ties, ties * 2), sub, big]).contiguous()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # probes overflow on purpose
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_round_f32_matches_torch_cast(device, dtype):
    """float32 -> 16-bit is round-to-nearest-even like torch's cast (the interpreter's own bf16 cast truncates)."""
    v = _round_probe_values(dtype).to(device)
    got = torch.empty(v.shape, dtype=dtype, device=device)
    _round_kernel[_grid(v.numel())](v, got, v.numel(), BLOCK=BLOCK, **EXACT)
    want = v.to(dtype)
    bits = (got.view(torch.int16) != want.view(torch.int16)).nonzero().flatten()
    assert bits.numel() == 0, [(float(v[i]), float(got[i]), float(want[i])) for i in bits[:8]]
    nan = torch.tensor([float("nan")], device=device)
    out = torch.empty(1, dtype=dtype, device=device)
    _round_kernel[(1,)](nan, out, 1, BLOCK=16, **EXACT)
    assert bool(out.isnan().all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_to_f32_is_exact(device, dtype):
    """Every 16-bit pattern (subnormals included) widens to the value torch gives."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).to(device)
    got = torch.empty(x.shape, dtype=torch.float32, device=device)
    _to_f32_kernel[_grid(x.numel())](x, got, x.numel(), BLOCK=BLOCK, **EXACT)
    want = x.float()
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all())
    assert torch.equal(got.view(torch.int32)[~want.isnan()] >> 31, want.view(torch.int32)[~want.isnan()] >> 31)


def test_e2m1_decode_and_rounding(device):
    """All 16 codes decode to E2M1_VALUES (signed zero included); every tie rounds like the format core."""
    codes = torch.arange(16, dtype=torch.int32, device=device)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    ties = (grid[:-1] + grid[1:]) / 2
    probes = torch.cat([grid, ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1),
                        torch.tensor([5.999, 6.0, 7.0, 1e30])]).float()
    probes = torch.cat([probes, torch.zeros(64 - probes.numel())]).to(device)
    val = torch.empty(16, dtype=torch.float32, device=device)
    mag = torch.empty(64, dtype=torch.int32, device=device)
    _e2m1_kernel[(1,)](torch.cat([codes, codes.new_zeros(48)]), probes, val, mag, BLOCK=16, **EXACT)
    assert torch.equal(val.view(torch.int32).cpu(), E2M1_VALUES.view(torch.int32))
    _e2m1_kernel[(1,)](codes.new_zeros(64), probes, torch.empty(64, device=device), mag, BLOCK=64, **EXACT)
    assert torch.equal(mag.cpu(), _e2m1_magnitude_code(probes.cpu()).to(torch.int32))


@triton.jit
def _e2m1_round_kernel(v_ptr, out_ptr, BLOCK: tl.constexpr, CODE: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + i)
    if CODE:
        tl.store(out_ptr + i, nv.e2m1_code(v).to(tl.float32))
    else:
        tl.store(out_ptr + i, nv.e2m1_round(v))


def _e2m1_probe_bits() -> torch.Tensor:
    """float32 bit patterns: every float32 in [2^-3, 2^4) (all 7 x 2^23 of them: below, all round to 0;
    above, to 6), 4096 mantissas of every finite exponent, 0, subnormals, the largest float and inf;
    padded with zeros to a multiple of 2^20."""
    inner = torch.arange(0x3E000000, 0x41800000, dtype=torch.int64)  # [2^-3, 2^4)
    exps = torch.arange(255, dtype=torch.int64)[:, None] << 23
    outer = (exps | (torch.arange(4096, dtype=torch.int64)[None, :] << 11)).flatten()
    specials = torch.tensor([0, 1, 0x007FFFFF, 0x7F7FFFFF, 0x7F800000], dtype=torch.int64)
    bits = torch.cat([inner, outer, specials])
    return torch.cat([bits, bits.new_zeros(-bits.numel() % (1 << 20))]).to(torch.int32)


@pytest.mark.parametrize("code", [False, True], ids=["round", "code"])
def test_e2m1_round_and_code_equal_the_comparisons(device, code):
    """``e2m1_round`` (the values quantizer's rounding on the bits) gives ``E2M1_VALUES[magnitude code]`` and
    ``e2m1_code`` (the codes quantizer's, with whole blocks per thread) the magnitude code itself, as the
    comparisons do, on :func:`_e2m1_probe_bits`. Both leave NaN unspecified: the quantizers meet it only
    in blocks whose scale is NaN (test_quantize_values_matches_format_core and
    test_quantize_halves_matches_format_core hold those blocks)."""
    for chunk in _e2m1_probe_bits().split(1 << 24):
        v = chunk.view(torch.float32).to(device)
        got = torch.empty_like(v)
        _e2m1_round_kernel[(v.numel() >> 20,)](v, got, BLOCK=1 << 20, CODE=code, **EXACT)
        mag = _e2m1_magnitude_code(v.cpu()).long()
        want = mag.float() if code else E2M1_VALUES[mag]
        bad = (got.cpu().view(torch.int32) != want.view(torch.int32)).nonzero().flatten()
        assert bad.numel() == 0, [(float(v[i]), float(got[i]), float(want[i])) for i in bad[:8]]


@triton.jit
def _quantize_values_kernel(x_ptr, gs_ptr, out_ptr, R: tl.constexpr, KB: tl.constexpr, BIT_ROUND: tl.constexpr):
    r = tl.arange(0, R)[:, None]
    k = tl.arange(0, KB)[None, :]
    x = nv.to_f32(tl.load(x_ptr + r * KB + k))
    tl.store(out_ptr + r * KB + k, nv.quantize_values(x, tl.load(gs_ptr), BIT_ROUND))


@pytest.mark.parametrize("bit_round", [False, True], ids=["codes", "bits"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
# (numpy warns where the interpreter overflows gs / scale and multiplies by it: the case under test)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
# 1e37: an overflowed multiplier (row 5); 1e-44: an underflowed one (the inf block, row 4: inf * 0)
@pytest.mark.parametrize("gs", [2688.0 / 3.7, 3.0e6, 1.0e37, 1.0e-44])
def test_quantize_values_matches_format_core(device, dtype, gs, bit_round):
    """The values quantizer, both roundings (through the codes, the default; on the bits, E2M1_BIT_ROUND):
    fp16 ``e2m1 * e4m3`` equal to the format core's codes and scales decoded, bit for bit (signed zeros
    included), NaN exactly where the block's scale is NaN (its NaN or inf block)."""
    rows, kb = 32, 64
    x, gst = _quantizer_case(dtype, rows, kb, gs, device)
    got = torch.empty(rows, kb, dtype=torch.float16, device=device)
    _quantize_values_kernel[(1,)](x, gst, got, R=rows, KB=kb, BIT_ROUND=bit_round, **EXACT)
    q, sf = _quantize_blocks(x.cpu(), gst.cpu().reshape(()))
    want = decode_scaled(q, sf).half()
    got = got.cpu()
    assert torch.equal(got.isnan(), want.isnan()) and bool(want.isnan().any())
    ok = ~want.isnan()
    assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16)), (got[ok] != want[ok]).nonzero()[:8]


@triton.jit
def _quantize_halves_kernel(x_ptr, gs_ptr, out_ptr, codes_ptr, sf_ptr, R: tl.constexpr, KB: tl.constexpr):
    r = tl.arange(0, R)[:, None, None]
    j = tl.arange(0, KB // 16)
    k = (16 * j[:, None] + tl.arange(0, 8)[None, :])[None, :, :]  # each block's first half
    src = x_ptr + r * KB + k
    x_lo, x_hi = nv.to_f32(tl.load(src)), nv.to_f32(tl.load(src + 8))
    lo, hi = nv.quantize_values_halves(x_lo, x_hi, tl.load(gs_ptr))
    tl.store(out_ptr + r * KB + k, lo)
    tl.store(out_ptr + r * KB + k + 8, hi)
    p_lo, p_hi, sf = nv.quantize_codes_halves(x_lo, x_hi, tl.load(gs_ptr))
    byte = codes_ptr + r * (KB // 2) + (8 * j[:, None] + tl.arange(0, 4)[None, :])[None, :, :]
    tl.store(byte, p_lo)
    tl.store(byte + 4, p_hi)
    tl.store(sf_ptr + tl.arange(0, R)[:, None] * (KB // 16) + j[None, :], sf.to(tl.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
# (numpy warns where the interpreter overflows gs / scale and multiplies by it: the case under test)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
# 1e37: an overflowed multiplier (row 5); 1e-44: an underflowed one (the inf block, row 4: inf * 0)
@pytest.mark.parametrize("gs", [2688.0 / 3.7, 3.0e6, 1.0e37, 1.0e-44])
def test_quantize_halves_matches_format_core(device, dtype, gs):
    """Both quantizers on blocks held as two halves (``QuantConfig.whole_blocks``): the codes form's packed
    bytes and scale bytes equal the format core's, byte for byte (the NaN and inf blocks and signed zeros
    included), and the values form's fp16 values equal those decoded, bit for bit, NaN exactly where
    those are NaN."""
    rows, kb = 32, 64
    x, gst = _quantizer_case(dtype, rows, kb, gs, device)
    got = torch.empty(rows, kb, dtype=torch.float16, device=device)
    codes = torch.empty(rows, kb // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(rows, kb // 16, dtype=torch.uint8, device=device)
    _quantize_halves_kernel[(1,)](x, gst, got, codes, scales, R=rows, KB=kb, **EXACT)
    q, sf = _quantize_blocks(x.cpu(), gst.cpu().reshape(()))
    assert torch.equal(codes.cpu(), q) and torch.equal(scales.cpu(), sf.view(torch.uint8))
    want = decode_scaled(q, sf).half()
    got = got.cpu()
    assert torch.equal(got.isnan(), want.isnan()) and bool(want.isnan().any())
    ok = ~want.isnan()
    assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16)), (got[ok] != want[ok]).nonzero()[:8]


def _quantizer_inputs(dtype: torch.dtype, rows: int, kb: int) -> torch.Tensor:
    """Blocks spanning saturated, normal, subnormal-scale and all-zero amax, plus exact ties of the grid."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, kb, generator=g)
    scale = 2.0 ** torch.randint(-24, 12, (rows, kb // 16, 1), generator=g).float()
    x = (x.reshape(rows, kb // 16, 16) * scale).reshape(rows, kb)
    x[0, :16] = 0.0  # amax 0 -> scale 0, inv 0
    x[1, 16:32] = torch.tensor([6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25] * 2) * torch.tensor([1.0, -1.0] * 8)
    x[2, :16] = -0.0  # signed zeros keep their sign bit in the code
    # bf16 subnormals and zeros: with a global scale past 2^118 the block's multiplier gs / scale
    # overflows to inf (x * inf: code 7, or NaN and code 0 for the zeros); in fp16 an all-zero block
    x[5, :16] = torch.tensor([1e-39, -0.0, 0.0, 2e-40, -1e-39, 0.0, 5e-40, -0.0] * 2)
    return x.to(dtype)


def _quantizer_case(dtype: torch.dtype, rows: int, kb: int, gs: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_quantizer_inputs` with a NaN block (row 3) and an inf block (row 4) on ``device``, and ``gs`` there.
    In float32 the NaN carries a payload in its low bits (``0x7FC00003``), which a quantizer that read its
    code off the NaN's bits would turn into a nonzero code."""
    x = _quantizer_inputs(dtype, rows, kb)
    x[3, 0] = float("nan")
    if dtype == torch.float32:
        x.view(torch.int32)[3, 0] = 0x7FC00003
    x[4, 5] = float("inf")
    return x.to(device), torch.tensor([gs], dtype=torch.float32, device=device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("gs", [2688.0 / 3.7, 1.0, 3.0e6, 2.0**20])
def test_quantize_matches_format_core(device, dtype, gs):
    """The whole block quantizer, codes and scale bytes, equals moe_fp4.format's (incl. NaN/inf blocks)."""
    rows, kb = 32, 64
    x, gst = _quantizer_case(dtype, rows, kb, gs, device)
    q = torch.empty(rows, kb // 2, dtype=torch.uint8, device=device)
    sf = torch.empty(rows, kb // 16, dtype=torch.uint8, device=device)
    _quantize_kernel[(1,)](x, gst, q, sf, R=rows, KB=kb, **EXACT)
    want_q, want_sf = _quantize_blocks(x, gst.reshape(()))
    assert torch.equal(q, want_q), (q != want_q).nonzero()[:8].tolist()
    assert torch.equal(sf, want_sf.view(torch.uint8)), (sf != want_sf.view(torch.uint8)).nonzero()[:8].tolist()


def every_code_and_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed [128, 8], scales [128, 1])``: row ``r`` holds the 16 codes (shuffled) under scale byte ``r``.

    Scale bytes 0..126 are every finite non-negative e4m3 value (subnormals included); row
    127 repeats scale 0x7E with codes in another order (0x7F is NaN, never a scale).
    """
    g = torch.Generator().manual_seed(3)
    codes = torch.stack([torch.randperm(16, generator=g) for _ in range(128)]).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = torch.arange(128, dtype=torch.uint8).reshape(128, 1)
    scales[127] = 0x7E
    return packed, scales


@pytest.mark.parametrize("fast", [True, False], ids=["bits", "float"])
def test_operand_tiles_exact_for_every_code_and_scale(device, fast):
    """The GEMM operand tiles are ``e2m1 * e4m3 * 2^-X`` exactly, for all 16 codes under all 127 scales.

    Element ``2i + h`` of tile ``j`` is nibble ``j`` of half ``h`` of packed word ``i``, i.e.
    element ``8i + 4h + j`` of the row (bytes ``4i + 2h`` and ``4i + 2h + 1``, low nibble first).
    X = 7 for the fp16 bit construction (subnormal fp16 results included), 4 for the float path.
    """
    packed, scales = every_code_and_scale()
    out = torch.empty(4, 128, 4, dtype=torch.float16, device=device)
    _operand_kernel[(1,)](packed.to(device), scales.to(device), out, R=128, W=2, FAST=fast)
    exact = decode_scaled(packed, scales.view(torch.float8_e4m3fn)) * 2.0 ** (-7 if fast else -4)
    assert torch.equal(exact.half().float(), exact)  # the premise: exact in fp16
    if not fast:
        assert float(exact[exact != 0].abs().min()) >= 2.0**-14  # and never subnormal on the float path
    order = torch.tensor([[8 * i + 4 * h + j for i in range(2) for h in range(2)] for j in range(4)])
    want = exact[:, order].permute(1, 0, 2)  # [j, r, 2i + h]
    assert torch.equal(out.float().cpu(), want), (out.float().cpu() != want).nonzero()[:8].tolist()
