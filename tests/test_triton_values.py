"""The Triton values operand (``STAGES_VALUES``, issue #11): fp16 activation values, K16 weights.

The quantization stages write the NVFP4 rows as fp16 values (``e2m1 * e4m3``, the global scale
left to alpha) instead of codes and scales, and the GEMM multiplies them with weights in the
K16 layout (``triton_kernels/gemm.py``), dequantizing only the weights. Checked here in the
interpreter against the torch reference: the layout against an independent decode of its
definition, the values bit for bit, the GEMM within the reference's fp32 summation bound
(``gemm_error_bound``), the whole forward within the tolerance of the codes path, and the
refusals. The SASS side (fewer operand instructions per weight element) is
tests/test_triton_compile.py.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from moe_cases import GRID, GRID_IDS, Case, grid_case, make_experts, make_inputs
from test_triton_moe import MAX_TOL, RMS_TOL
from test_triton_numerics import every_code_and_scale
from test_triton_stages import (
    ONE_HOTS,
    VALUES_EXHAUSTIVE_CONFIGS,
    _grouped,
    _one_hot_rows,
    gemm_error_bound,
    gemm_operands,
)

import moe_fp4.backends.triton as tb
from moe_fp4 import fused_moe, stages
from moe_fp4.buffers import K16Weights, Quantized, WeightOperand
from moe_fp4.format import E2M1_VALUES, decode_scaled, swizzle_scales_grouped
from moe_fp4.moe import MoEProblem
from moe_fp4.pipeline import StageSet, cached_workspace
from moe_fp4.testing import errors, poison, routed_ids, served_ids

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


def _tk():
    return tb.kernels()


# --------------------------------------------------------------------------- the K16 layout


def _decode_k16_word(word: int) -> dict[tuple[int, int], int]:
    """Codes ``(J, h) -> code`` of one K16 word, read the way the kernel's fp16 bits do it: shift by
    the table's entries, then the fp16 fields (magnitude bits 9..11 and 25..27, signs 15 and 31)."""
    codes = {}
    for j, (dm, ds) in enumerate(_tk().K16_SHIFTS):
        mag = (word << dm if dm >= 0 else word >> -dm) & 0xFFFFFFFF
        sign = (word << ds if ds >= 0 else word >> -ds) & 0xFFFFFFFF
        for h in (0, 1):
            codes[j, h] = ((mag >> (9 + 16 * h)) & 7) | (((sign >> (15 + 16 * h)) & 1) << 3)
    return codes


def test_k16_layout_is_the_documented_permutation():
    """Every element of a random code tensor lands where the layout's definition puts it (element
    ``16 J + 2 i + h`` of each 64-group in word ``i``, decoded through K16_SHIFTS), and back."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (2, 3, 96), generator=gen, dtype=torch.uint8)  # K = 192: three groups
    laid = _tk().k16_codes(codes)
    assert laid.shape == codes.shape and laid.dtype == torch.uint8
    assert torch.equal(_tk().k16_restore(laid), codes)
    element = torch.stack((codes & 15, codes >> 4), -1).reshape(2, 3, 192)  # canonical element k
    words = laid.reshape(2, 3, 24, 4).to(torch.int64)  # 24 little-endian int32 words per row
    words = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24
    for e in range(2):
        for n in range(3):
            for w in range(24):
                g, i = divmod(w, 8)
                for (j, h), code in _decode_k16_word(int(words[e, n, w])).items():
                    assert code == int(element[e, n, 64 * g + 16 * j + 2 * i + h]), (e, n, w, j, h)


def test_k16_shifts_put_both_fields_in_place():
    """The table moves each tile's bits into disjoint source positions: a permutation of the 32 bits."""
    positions = [p for j, h, mag, sign in _tk().gemm._k16_positions() for p in (mag, mag + 1, mag + 2, sign)]
    assert sorted(positions) == list(range(32))


# --------------------------------------------------------------------------- the values stages


def _whole_blocks_configs():
    """The values quantization's launch: the table's, and pinned ones with ``QuantConfig.whole_blocks``:
    one block per thread (1 x 512, one warp) and two (4 x 512, two warps), the layouts the GPU gets in
    the decode and prefill shapes, and 4 x 64 on one warp, fewer blocks than threads (Triton splits
    them again; still exact). 512 columns leave a partial program at K = 128, 192 and 320."""
    qc = _tk().QuantConfig
    return [None, qc(1, 512, 1, whole_blocks=True), qc(4, 512, 2, whole_blocks=True), qc(4, 64, 1, whole_blocks=True)]


WHOLE_IDS = ["table", "whole1x512", "whole4x512", "whole4x64"]


@pytest.mark.parametrize("quant", range(4), ids=WHOLE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,topk,e,k,row_scale", [(5, 3, 4, 128, True), (9, 2, 7, 192, False), (1, 1, 3, 64, False),
                                                  (7, 2, 5, 320, True)])
def test_quantize_rows_values_bit_exact(device, dtype, m, topk, e, k, row_scale, quant):
    """Stage 2's fp16 values equal the reference's values of the same rows (exact numbers, any 16-bit type),
    with the table's launch and with whole blocks per thread; slots of no expert (-1 ids) get zeros."""
    gen = torch.Generator().manual_seed(m * k + e)
    ids = routed_ids(m, topk, e, gen, "minus_one").to(device)
    r = stages.routing(ids, e)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype).to(device)
    gs = (torch.rand(e, generator=gen) * 900 + 100).to(device)
    weights = torch.rand(m * topk, generator=gen).to(device) if row_scale else None
    want = stages.quantize_rows(x, gs, r, row_scale=weights,
                                out=Quantized.empty(r.num_slots, k, e, device, values=dtype))
    got = torch.full((r.num_slots, k), float("nan"), dtype=torch.float16, device=device)
    _tk().quantize_rows_values_launcher(m, k, gs, r.expert_offsets, r.slot_to_flat, row_scale, got,
                                        _whole_blocks_configs()[quant])(x, weights)
    assert torch.equal(got.float(), want.values.float())
    assert bool((got[int(r.expert_offsets[-1]):] == 0).all())


def _fused_routing_equals_two_launches(ids, x, gs, e, weights, cfg):
    """Runs the fused routing and first quantization and, on buffers of their own (all poisoned), the routing
    launch and the values quantization launch; asserts the five outputs equal byte for byte. Returns the
    two launches' ``(expert_offsets, blockscale_offsets)``."""
    tk = _tk()
    (m, k), n, device = x.shape, ids.numel(), x.device

    def buffers():
        i32 = dict(dtype=torch.int32, device=device)
        return (torch.full((e + 1,), -7, **i32), torch.full((e + 1,), -7, **i32), torch.full((n,), -7, **i32),
                torch.full((n,), -7, **i32), torch.full((n, k), float("nan"), dtype=torch.float16, device=device))

    offs, bso, s2f, f2s, vals = want = buffers()
    tk.routing_launcher(n, offs, bso, s2f, f2s, None)(ids)
    tk.quantize_rows_values_launcher(m, k, gs, offs, s2f, weights is not None, vals)(x, weights)
    got = buffers()
    fused = tk.routing_quantize_values_launcher(m, k, gs, *got[:4], weights is not None, got[4], cfg)
    assert fused is not None
    fused(ids, x, weights)
    for name, a, b in zip(("expert_offsets", "blockscale_offsets", "slot_to_flat", "flat_to_slot", "values"),
                          got, want, strict=True):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.float16 else a,
                           b.view(torch.int16) if b.dtype == torch.float16 else b), name
    return offs, bso


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,topk,e,k,pattern,row_scale", [
    (1, 8, 16, 128, "random", False),  # decode: one token, top-8
    (5, 3, 4, 192, "minus_one", True),  # -1 ids, router weights on the input
    (8, 8, 300, 64, "skewed", False),  # n = 64 = FUSED_ROUTING_MAX, E > 256 (expert blocks)
    (3, 2, 9, 64, "out_of_range", False),  # ids outside [-1, E): not routed
])
@pytest.mark.parametrize("whole", [False, True], ids=["split", "whole"])
def test_fused_routing_quantize_writes_what_the_two_launches_write(device, dtype, m, topk, e, k, pattern, row_scale,
                                                                  whole):
    """The fused routing and first quantization (one launch at decode) writes the bytes of the routing
    launch and the values quantization launch, every one of the five outputs (poisoned before); with
    ``whole`` the fused launch holds whole blocks per thread and the two launches do not."""
    tk = _tk()
    gen = torch.Generator().manual_seed(m * 131 + e)
    ids = routed_ids(m, topk, e, gen, pattern).to(device)
    n = m * topk
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype).to(device)
    gs = (torch.rand(e, generator=gen) * 900 + 100).to(device)
    weights = torch.rand(n, generator=gen).to(device) if row_scale else None
    cfg = tk.QuantConfig(1, 512, 1, whole_blocks=True) if whole else None
    offs, bso = _fused_routing_equals_two_launches(ids, x, gs, e, weights, cfg)
    # Past FUSED_ROUTING_MAX flat indices the two launches stay two.
    big = tk.FUSED_ROUTING_MAX + 1
    assert tk.routing_quantize_values_launcher(big, k, gs, offs, bso, torch.empty(big, dtype=torch.int32),
                                               torch.empty(big, dtype=torch.int32), False,
                                               torch.empty(big, k, dtype=torch.float16)) is None


@pytest.mark.parametrize("m,topk,e,pattern", [(16, 8, 128, "random"), (32, 8, 256, "skewed")],
                         ids=["n128", "n256"])
def test_fused_routing_quantize_is_exact_up_to_the_single_program_routing(device, monkeypatch, m, topk, e, pattern):
    """The fused routing and first quantization past FUSED_ROUTING_MAX (64) flat indices, up to the
    single-program routing's limit (routing.SMALL_MAX, 256), where a plan could take it (Qwen3 M = 16 and
    32; not timed yet): the same five outputs, byte for byte, as the two launches."""
    from moe_fp4.triton_kernels import quantize as tq

    monkeypatch.setattr(tq, "FUSED_ROUTING_MAX", 256)
    gen = torch.Generator().manual_seed(m * 7 + e)
    ids = routed_ids(m, topk, e, gen, pattern).to(device)
    x = (torch.randn(m, 64, generator=gen) * 3).to(torch.bfloat16).to(device)
    gs = (torch.rand(e, generator=gen) * 900 + 100).to(device)
    _fused_routing_equals_two_launches(ids, x, gs, e, None, None)


def test_values_plan_chooses_each_gemms_tile_with_its_own_n_and_k(device, monkeypatch):
    """A values plan asks the launch table for each GEMM with that GEMM's N and K (the table's alternatives for a
    GEMM's shape depend on them: gemm_config): gate/up N = 2I, K = H; down N = H, K = I."""
    tk = _tk()
    asked: list[tuple] = []
    table = tk.gemm_config
    monkeypatch.setattr(tk, "gemm_config", lambda *args: (asked.append(args), table(*args))[1])
    case = Case(2, 8, 8, 128, 64, routing="with_minus_one")  # H = 128, I = 64
    gen = torch.Generator().manual_seed(case.seed)
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    with tb.operand_form("values"):
        fused_moe(x, ex, w, ids, backend="triton")  # the checked run: binds the plan
        fused_moe(x, ex, w, ids, backend="triton")
    shapes = {(args[3], args[5]) for args in asked if len(args) == 6 and args[2]}  # (N, K) of the values GEMMs
    assert shapes == {(2 * 64, 128), (128, 64)}, asked


@pytest.mark.parametrize("fuse_silu", [False, True], ids=["default", "fuse_silu"])
def test_values_plan_fuses_launches(device, monkeypatch, fuse_silu):
    """A repeated shape runs its plan, whose routing and first quantization are one launch at decode and,
    with ``FUSE_SILU`` (off by default: it did not pay on the H200), whose first GEMM takes the SiLU-and-mul
    quantization, with the output of the first (stage-by-stage, unfused) call bit for bit; past
    FUSED_ROUTING_MAX flat indices the plan keeps the routing's own launch."""
    from moe_fp4.triton_kernels import _common

    monkeypatch.setattr(tb, "FUSE_SILU", fuse_silu)
    launched: list[str] = []
    call = _common.Launch.__call__
    monkeypatch.setattr(_common.Launch, "__call__",
                        lambda self, *free: (launched.append(self._kernel.__name__), call(self, *free))[1])
    for m, fused in ((2, True), (12, False)):  # n = 16 and 96 flat indices
        case = Case(m, 8, 8, 64, 64, routing="with_minus_one")
        gen = torch.Generator().manual_seed(case.seed)
        ex = make_experts(case, gen, device)
        x, w, ids = make_inputs(case, gen, device)
        with tb.operand_form("values"):
            first = fused_moe(x, ex, w, ids, backend="triton").clone()
            launched.clear()
            again = fused_moe(x, ex, w, ids, backend="triton")
        assert torch.equal(again, first)
        assert ("routing_quantize_kernel" in launched) == fused, launched
        assert ("routing_small_kernel" in launched) != fused, launched
        # The first quantization unless fused with the routing; the SiLU-and-mul one unless in the GEMM.
        assert launched.count("quantize_grouped_kernel") == (0 if fused else 1) + (0 if fuse_silu else 1), launched
    if not fuse_silu:
        return
    # A pinned tile that cannot take it (8 output columns: half a scale block) keeps its launch.
    with tb.operand_form("values"), tb.pinned_gemm_config(_tk().GemmConfig(16, 16, 64, True)):
        launched.clear()
        pinned = fused_moe(x, ex, w, ids, backend="triton")
    assert launched.count("quantize_grouped_kernel") == 2, launched  # the first quantization and the SiLU one
    rms, mx = errors(pinned, first)
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)  # another tile: another fp32 summation order


@pytest.mark.parametrize("in_gemm", [False, True], ids=["reduce-launch", "split-k-in-gemm"])
def test_fuse_silu_split_fuses_only_where_the_first_gemm_splits_k(device, monkeypatch, in_gemm):
    """``FUSE_SILU = "split"``: a values plan's first GEMM takes the SiLU-and-mul quantization only where it
    splits K (into its split-K reduce, the GEMM's own tiles unpaired, or with ``FUSE_SPLIT_K_IN_GEMM`` into its
    last K ranges, no reduce launch), and writes what the plan without the fusion writes, bit for bit; where it
    does not split, the quantization keeps its launch."""
    from moe_fp4.triton_kernels import _common

    launched: list[str] = []
    call = _common.Launch.__call__
    monkeypatch.setattr(_common.Launch, "__call__",
                        lambda self, *free: (launched.append(self._kernel.__name__), call(self, *free))[1])
    case = Case(2, 8, 8, 128, 64, routing="with_minus_one")
    gen = torch.Generator().manual_seed(case.seed)
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    split = _tk().GemmConfig(16, 32, 64, swap_ab=True, split_k=2)  # GEMM1 (K = 128): 2 ranges; GEMM2 none
    outs = {}
    monkeypatch.setattr(tb, "FUSE_SPLIT_K_IN_GEMM", in_gemm)
    for mode in (False, "split"):
        monkeypatch.setattr(tb, "FUSE_SILU", mode)
        experts = ex.to(device) if mode else ex  # (a copy: a plan per experts object, bound with the mode)
        with tb.operand_form("values"):
            fused_moe(x, experts, w, ids, backend="triton")  # the checked run: binds the plan
            for pinned in (False, True):
                launched.clear()
                with tb.pinned_gemm_config(split) if pinned else contextlib.nullcontext():
                    outs[mode, pinned] = fused_moe(x, experts, w, ids, backend="triton").clone()
                # the routing and first quantization fused; the SiLU-and-mul one unless in GEMM1's reduce
                fuses = mode == "split" and pinned
                assert launched.count("quantize_grouped_kernel") == (0 if fuses else 1), (mode, pinned, launched)
                assert ("split_k_reduce_kernel" in launched) == (pinned and not in_gemm), (mode, pinned, launched)
    for pinned in (False, True):
        assert torch.equal(outs["split", pinned], outs[False, pinned]), pinned


def test_whole_blocks_fall_back_where_k_is_not_a_multiple_of_16(device):
    """The launchers take any K; whole blocks need K % 16 == 0 (the stages require it), so a pinned
    ``whole_blocks`` configuration with K = 72 runs the 16-wide form: the same bytes as without it."""
    tk = _tk()
    gen = torch.Generator().manual_seed(72)
    m, topk, e, k = 3, 2, 4, 72
    r = stages.routing(routed_ids(m, topk, e, gen, "random").to(device), e)
    x = (torch.randn(m, k, generator=gen) * 3).to(torch.bfloat16).to(device)
    gs = (torch.rand(e, generator=gen) * 900 + 100).to(device)
    outs = []
    for cfg in (tk.QuantConfig(1, 512, 1), tk.QuantConfig(1, 512, 1, whole_blocks=True)):
        out = torch.full((m * topk, k), float("nan"), dtype=torch.float16, device=device)
        tk.quantize_rows_values_launcher(m, k, gs, r.expert_offsets, r.slot_to_flat, False, out, cfg)(x, None)
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


@pytest.mark.parametrize("quant", range(4), ids=WHOLE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_silu_mul_quantize_values_bit_exact(device, dtype, quant):
    """Stage 4's fp16 values equal the reference's values of ``silu(gate) * up`` (the table's launch and
    whole blocks per thread, whose SiLU rounds by the hardware's conversion on a GPU)."""
    m, topk, e, i = 6, 2, 5, 192
    gen = torch.Generator().manual_seed(7)
    ids = routed_ids(m, topk, e, gen, "minus_one").to(device)
    r = stages.routing(ids, e)
    h = (torch.randn(m * topk, 2 * i, generator=gen) * 2).to(dtype).to(device)
    gs = (torch.rand(e, generator=gen) * 900 + 100).to(device)
    want = stages.silu_mul_quantize(h, gs, r, out=Quantized.empty(m * topk, i, e, device, values=dtype))
    got = torch.full((m * topk, i), float("nan"), dtype=torch.float16, device=device)
    _tk().silu_mul_quantize_values_launcher(h, gs, r.expert_offsets, got, _whole_blocks_configs()[quant])()
    assert torch.equal(got.float(), want.values.float())


def test_values_hold_every_nvfp4_value_exactly():
    """The premise of fp16 values for any model dtype: every e2m1 x e4m3 product is an fp16 number."""
    scales = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every finite scale byte >= 0
    products = (E2M1_VALUES.float()[:, None] * scales[None, :]).flatten()
    assert torch.equal(products.half().float(), products)


# --------------------------------------------------------------------------- the values GEMM

VALUES_GEMM_CASES = [
    # (m, topk, e, N, K, sections, config or None, note)
    (5, 3, 4, 96, 192, 2, (16, 32, 128, True), "swap; K % BK != 0; gate/up sections of 48"),
    (9, 2, 3, 80, 64, 1, (16, 64, 128, False), "BK > K; N % BN != 0"),
    (40, 2, 3, 48, 128, 2, (32, 16, 64, True), "several row tiles per expert; sections straddle tiles"),
    (6, 2, 3, 64, 256, 1, (16, 32, 64, True, 4, 3, 2), "split-K"),
    (4, 2, 3, 32, 128, 1, (16, 32, 64, True, 4, 3, 1, "float"), "float32 decode"),
    (3, 1, 5, 32, 1024, 1, None, "the table's config; long K"),
    # The dense GEMM (dense_mib: weights dequantized into a scratch first); 1 MiB holds two experts of
    # 256 x 1024 fp16, so five experts are three chunks (2, 2, 1), each launch seeing its own experts.
    (40, 2, 5, 256, 1024, 2, (32, 64, 64, False, 4, 3, 1, "bits", 1), "dense: chunks of 2, 2, 1 experts"),
    (9, 2, 3, 80, 192, 1, (16, 64, 64, False, 4, 3, 1, "bits", 1), "dense; N % BN != 0; one chunk"),
    (5, 3, 4, 96, 192, 2, (16, 32, 64, True, 4, 3, 1, "bits", 1), "dense swap; gate/up sections of 48"),
    (4, 2, 3, 32, 128, 1, (16, 32, 64, True, 4, 3, 1, "float", 1), "dense, float32 decode"),
    # At most 96 registers a thread (GemmConfig.maxnreg): on the GPU ptxas fits the 32x128x128 swap tile in them
    # without spills (tests/results/2026-12-08-s48-no-gpu); the same numbers either way.
    (40, 2, 3, 160, 256, 2, (32, 128, 128, True, 4, 3, 1, "bits", 0, 96), "swap; maxnreg 96"),
]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,topk,e,N,K,sections,cfg,note", VALUES_GEMM_CASES, ids=[c[-1] for c in VALUES_GEMM_CASES])
def test_values_gemm_within_bound(device, out_dtype, m, topk, e, N, K, sections, cfg, note):
    """fp16 values x K16 weights: within gemm_error_bound of the exact reference on the same NVFP4
    operands (the products are the same numbers, only the fp32 summation order differs); rows past
    expert_offsets[E] untouched."""
    r, a, wt = gemm_operands(m, topk, e, N, K, sections, out_dtype, device, seed=N * K + m + 1, values=True)
    k16 = K16Weights(_tk().k16_codes(wt.packed), wt.scales, wt.alpha)
    values = Quantized(a.packed, a.scales, a.values.half())
    out = torch.full((r.num_slots, N), float("nan"), dtype=out_dtype, device=device)
    config = _tk().GemmConfig(*cfg) if cfg else None
    got = tb.STAGES_VALUES.grouped_gemm(values, k16, r, out_dtype, out=out, config=config)
    ref = stages.grouped_gemm(a, wt, r, out_dtype)
    valid = int(r.expert_offsets[-1])
    bound = gemm_error_bound(a, wt, r, ref[:valid], got[:valid])
    err = (got[:valid].float() - ref[:valid].float()).abs()
    assert got is out
    assert not got[:valid].isnan().any()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert bool(got[valid:].isnan().all())


SILU_GEMM_CASES = [
    # (m, topk, e, I, K, config fields, note)
    (5, 3, 4, 64, 192, (16, 32, 128, True), "swap; K % BK != 0"),
    (9, 2, 3, 80, 64, (16, 64, 128, False), "mma; I % (BN / 2) != 0"),
    (40, 2, 3, 48, 128, (32, 32, 64, True), "several row tiles per expert"),
    (6, 2, 3, 64, 256, (16, 32, 64, True, 4, 3, 2), "split-K: the reduce's epilogue"),
    (7, 2, 5, 64, 128, (16, 64, 64, False, 4, 3, 2), "split-K, mma"),
    (3, 1, 5, 64, 1024, None, "the table's config; long K"),
    (40, 2, 3, 48, 128, (32, 32, 64, True, 4, 3, 1, "bits", 1), "dense"),
    (12, 2, 3, 256, 1024, (32, 64, 64, False, 4, 3, 1, "bits", 1), "dense: chunks of one expert"),
]


@pytest.mark.parametrize("h_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,topk,e,i,K,cfg,note", SILU_GEMM_CASES, ids=[c[-1] for c in SILU_GEMM_CASES])
def test_gemm1_with_the_silu_quantization_writes_what_the_two_launches_write(device, h_dtype, m, topk, e, i, K,
                                                                              cfg, note):
    """The values GEMM of gate and up with the SiLU-and-mul quantization in its epilogue (or its split-K
    reduce's) writes, for every routed row, the bytes the GEMM (h of the model's dtype) and the values
    quantization stage write in two launches: the same per-element sums, the same rounding to h's dtype,
    the same SiLU and quantization arithmetic."""
    tk = _tk()
    r, a, wt = gemm_operands(m, topk, e, 2 * i, K, 2, h_dtype, device, seed=i * K + m, values=True)
    k16 = K16Weights(tk.k16_codes(wt.packed), wt.scales, wt.alpha)
    vals = a.values.half()
    config = tk.GemmConfig(*cfg) if cfg else None
    gs2 = (torch.rand(e, generator=torch.Generator().manual_seed(m)) * 900 + 100).to(device)
    h = torch.full((r.num_slots, 2 * i), float("nan"), dtype=h_dtype, device=device)
    tk.grouped_gemm_launcher(vals, None, k16.packed, k16.scales, k16.alpha, r.expert_offsets, r.blockscale_offsets, h,
                             config)()
    want = torch.full((r.num_slots, i), float("nan"), dtype=torch.float16, device=device)
    tk.silu_mul_quantize_values_launcher(h, gs2, r.expert_offsets, want)()
    got = torch.full((r.num_slots, i), float("nan"), dtype=torch.float16, device=device)
    tk.grouped_gemm_launcher(vals, None, k16.packed, k16.scales, k16.alpha, r.expert_offsets, r.blockscale_offsets,
                             got, config, silu=(gs2, h_dtype))()
    valid = int(r.expert_offsets[-1])
    assert torch.equal(got[:valid].view(torch.int16), want[:valid].view(torch.int16))
    assert bool(got[valid:].isnan().all())  # rows of no expert: not written


def test_gemm1_silu_refusals(device):
    tk = _tk()
    r, a, wt = gemm_operands(3, 2, 3, 64, 64, 1, torch.bfloat16, device, seed=1, values=True)
    out = torch.empty((r.num_slots, 32), dtype=torch.float16, device=device)
    gs = torch.ones(3, device=device)
    with pytest.raises(ValueError, match="silu: the fused SiLU-and-mul quantization needs"):  # one section
        tk.grouped_gemm_launcher(a.values.half(), None, tk.k16_codes(wt.packed), wt.scales, wt.alpha,
                                 r.expert_offsets, r.blockscale_offsets, out, tk.GemmConfig(16, 32, 64, True),
                                 silu=(gs, torch.bfloat16))
    assert not tk.silu_fusable(tk.GemmConfig(16, 16, 64, True), True, 64, 2)  # half a tile: 8 columns
    assert not tk.silu_fusable(tk.GemmConfig(16, 32, 64, True), False, 64, 2)  # the codes GEMM


def test_values_table_takes_its_narrow_tile_where_the_grid_is_small(monkeypatch):
    """At 9-24 rows per expert the values table's 32x128 tile, unless its E x N/128 grid has fewer than
    NARROW_BELOW tiles per SM: then the 32x64 one (no other row has a narrow tile). On an
    H200 (132 SMs): Llama-4-Scout's (E=16) second GEMM at M=256 (N=5120: 640 tiles) narrow, its first
    (N=16384) and Qwen3's (E=128) both not."""
    tk = _tk()
    from moe_fp4.triton_kernels import gemm as tg

    monkeypatch.setattr(tg, "_sm_count", lambda device: 132)
    monkeypatch.setattr(tg, "_major", lambda device: 9)
    mid, narrow, cuda = tk.GEMM_VALUES_CONFIGS[2][1], tk.GEMM_CONFIGS[2][1], torch.device("cuda")
    assert (mid.block_m, mid.block_n, narrow.block_m, narrow.block_n) == (32, 128, 32, 64)
    assert tk.gemm_config(256, 16, True, 5120, cuda) == narrow
    assert tk.gemm_config(256, 16, True, 16384, cuda) == mid
    assert tk.gemm_config(256 * 8, 128, True, 2048, cuda) == mid
    assert tk.gemm_config(256 * 8, 128, True, 1536, cuda) == mid
    assert tk.gemm_config(256, 16, True) == mid  # without N: the table's row
    assert tk.gemm_config(256, 16, False, 5120, cuda) == narrow  # the codes table's own row
    assert tk.gemm_config(16, 16, True, 5120, cuda) == tk.GEMM_VALUES_CONFIGS[0][1]  # other rows: unchanged
    assert narrow in tk.GEMM_VALUES_TILES and mid in tk.GEMM_VALUES_TILES
    assert len(set(tk.GEMM_VALUES_TILES)) == len(tk.GEMM_VALUES_TILES)  # each tile once (rows share tiles)
    # The split-K workspace follows the same choice (the launcher and the plan's scratch agree).
    assert tk.resolve_config(None, 256, 16, True, 5120, cuda) == narrow
    # 4-8 rows per expert (forty-sixth session, H100): the decode row's 16x64x256 tile whatever the grid, so
    # Llama-4-Scout's second GEMM at M=128 (640 tiles) takes it as its first and Qwen3's and DeepSeek-V3's do.
    # 25-96 rows: the 9-24 rows' 32x128 swap tile, without its narrow fallback (the fallback is the row's, not
    # the tile's), so Llama-4-Scout's second GEMM at M=1024 (640 tiles) keeps it.
    decode, row96 = tk.GEMM_VALUES_CONFIGS[0][1], tk.GEMM_VALUES_CONFIGS[3][1]
    assert (decode.block_m, decode.block_n, decode.block_k, decode.num_stages) == (16, 64, 256, 3)
    for rows, E, N in ((128, 16, 5120), (128, 16, 16384), (128 * 8, 128, 1536), (256 * 8, 256, 7168)):
        assert tk.gemm_config(rows, E, True, N, cuda) == decode
    assert tk.gemm_config(128, 16, False, 16384, cuda) == tk.GEMM_CONFIGS[1][1]  # the codes table's own row
    assert (row96.block_m, row96.block_n, row96.block_k, row96.swap_ab, row96.num_stages) == (32, 128, 128, True, 3)
    assert row96 == mid
    for rows, E, N in ((1024, 16, 5120), (1024 * 8, 256, 7168), (512 * 8, 128, 2048)):  # 64, 32, 32 rows (no K)
        assert tk.gemm_config(rows, E, True, N, cuda) == row96
    assert tk.gemm_config(1024, 16, False, 5120, cuda) == tk.GEMM_CONFIGS[3][1]  # the codes table's own row


def test_values_table_takes_the_decode_tile_for_a_long_k_at_9_to_16_rows(monkeypatch):
    """At 9-16 rows per expert a GEMM with K >= VALUES_LONG_K_MIN (6144) takes the decode row's 16x64x256 tile,
    ahead of the narrow fallback (forty-seventh session, H100): DeepSeek-V3's first GEMM at M=512 (K=7168) and
    Llama-4-Scout's second at M=256 (K=8192, a small grid: narrow without the rule); Llama-4-Scout's first
    (K=5120), DeepSeek-V3's second (K=2048) and Qwen3's keep theirs. Other rows and the codes table ignore K."""
    tk = _tk()
    from moe_fp4.triton_kernels import gemm as tg

    monkeypatch.setattr(tg, "_sm_count", lambda device: 132)
    monkeypatch.setattr(tg, "_major", lambda device: 9)
    decode, mid, narrow = tk.GEMM_VALUES_CONFIGS[0][1], tk.GEMM_VALUES_CONFIGS[2][1], tk.GEMM_CONFIGS[2][1]
    cuda = torch.device("cuda")
    assert tk.VALUES_LONG_K_MIN == 6144
    assert tk.gemm_config(512 * 8, 256, True, 4096, cuda, 7168) == decode  # DeepSeek-V3 gemm1
    assert tk.gemm_config(256, 16, True, 5120, cuda, 8192) == decode  # Llama-4-Scout gemm2
    assert tk.gemm_config(256, 16, True, 5120, cuda, 6144) == decode  # the bound itself
    assert tk.gemm_config(256, 16, True, 5120, cuda, 6143) == narrow  # below it: the narrow fallback
    assert tk.gemm_config(256, 16, True, 16384, cuda, 5120) == mid  # Llama-4-Scout gemm1
    assert tk.gemm_config(512 * 8, 256, True, 7168, cuda, 2048) == mid  # DeepSeek-V3 gemm2
    assert tk.gemm_config(256 * 8, 128, True, 1536, cuda, 2048) == mid  # Qwen3 gemm1
    assert tk.gemm_config(512 * 8, 256, True, 4096, None, 7168) == decode  # no device: as on Hopper
    # Past 16 rows per expert (DeepSeek-V3 M=768, Llama-4-Scout M=384: 24 rows) the row's own tiles.
    assert tk.VALUES_LONG_K_MAX_ROWS == 16
    assert tk.gemm_config(768 * 8, 256, True, 4096, cuda, 7168) == mid
    assert tk.gemm_config(384, 16, True, 5120, cuda, 8192) == narrow
    # Other rows have no long-K tile (32 rows: the 25-96 rows' wide tile or the row's own), nor has the codes table.
    assert tk.gemm_config(1024 * 8, 256, True, 4096, cuda, 7168).block_m == 64
    assert tk.gemm_config(512, 16, True, 5120, cuda, 8192) == tk.GEMM_VALUES_CONFIGS[3][1]
    assert tk.gemm_config(512 * 8, 256, False, 4096, cuda, 7168) == tk.GEMM_CONFIGS[2][1]
    # The workspace and the launch resolve the same way (K passes through resolve_config).
    assert tk.resolve_config(None, 512 * 8, 256, True, 4096, cuda, 7168) == decode
    # Off Hopper the portable table has no long-K tile.
    monkeypatch.setattr(tg, "_major", lambda device: 8)
    assert tk.gemm_config(512 * 8, 256, True, 4096, cuda, 7168) == tk.GEMM_VALUES_PORTABLE_CONFIGS[1][1]


def test_a_long_k_splits_in_two_where_the_grid_would_not(monkeypatch):
    """``split_k_for``'s long-K rule on an H200 (132 SMs): where the 6-programs-per-SM rule leaves a GEMM whole,
    at decode (at most 4 rows per expert) a K of at least LONG_K_MIN_STEPS steps on at most
    LONG_K_MAX_TILES_PER_SM tiles per SM takes two ranges. The cases are the twenty-fifth session's sweep
    and A/B: Llama-4-Scout's first GEMM at M = 4 (K = 5120: 20 steps of 256, 1024 tiles) and DeepSeek-V3's
    at M = 4 (K = 7168, 2048 tiles) split; Llama-4-Scout's first GEMM at M = 16 (4096 tiles) and at M = 128
    (8 rows per expert), and Qwen3's at M = 4 (8 steps) do not; each bound at its edge; the 6-per-SM rule's
    own splits and an explicit split_k stay as they were; LONG_K_SPLIT = False turns the rule off."""
    tk = _tk()
    from moe_fp4.triton_kernels import gemm as tg

    monkeypatch.setattr(tg, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    decode = tk.GEMM_VALUES_CONFIGS[0][1]
    assert (decode.block_n, decode.block_k, decode.split_k) == (64, 256, 0)
    assert tk.split_k_for(decode, 4, 16, 16384, 5120, cuda) == 2  # Llama-4-Scout gemm1, M = 4
    assert tk.split_k_for(decode, 32, 256, 4096, 7168, cuda) == 2  # DeepSeek-V3 gemm1, M = 4
    assert tk.split_k_for(decode, 16, 16, 5120, 8192, cuda) == 2  # Llama-4-Scout gemm2, M = 16
    assert tk.split_k_for(decode, 16, 16, 16384, 5120, cuda) == 1  # 4096 tiles: 31 per SM
    assert tk.split_k_for(decode, 32, 128, 1536, 2048, cuda) == 1  # Qwen3 gemm1, M = 4: 8 steps
    assert tk.split_k_for(decode, 1, 16, 16384, 5120, cuda) == 2  # M = 1: the 6-per-SM rule's split
    assert tk.split_k_for(decode, 4, 16, 5120, 8192, cuda) == 2  # Llama-4-Scout gemm2, M = 4: the same
    assert tk.split_k_for(dataclasses.replace(decode, split_k=1), 4, 16, 16384, 5120, cuda) == 1
    assert tk.k_ranges(decode, 4, 16, 16384, 5120, cuda) == (2, 10)
    # 8 rows per expert (Llama-4-Scout M = 128, the 4-8 rows' row, the decode tile since the forty-sixth
    # session: 4096 tiles, 20 steps): past the rows bound
    row8 = tk.GEMM_VALUES_CONFIGS[1][1]
    assert row8.split_k == 0 and tk.split_k_for(row8, 128, 16, 16384, 5120, cuda) == 1
    # The bounds themselves: 4 rows per expert split (Llama-4-Scout gemm2 M = 64), 4 and a sixteenth do not
    # (decode row still: 65 rows); 20 K steps split, 19 do not; 2048 tiles (15.5 per SM) split, 2304 do not.
    assert tk.split_k_for(decode, 64, 16, 5120, 8192, cuda) == 2
    assert tk.split_k_for(decode, 65, 16, 5120, 8192, cuda) == 1
    assert tk.split_k_for(decode, 4, 16, 16384, 19 * 256, cuda) == 1
    assert tk.split_k_for(decode, 8, 16, 16384, 5120, cuda) == 2
    assert tk.split_k_for(decode, 9, 16, 16384, 5120, cuda) == 1
    monkeypatch.setattr(tg, "LONG_K_SPLIT", False)
    assert tk.split_k_for(decode, 4, 16, 16384, 5120, cuda) == 1
    assert tk.split_k_for(decode, 1, 16, 16384, 5120, cuda) == 2


def _padded_to_64(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """16-element rows ``(packed [n, 8], scales [n, 1])`` as 64-element rows (zero codes and scales after)."""
    n = packed.shape[0]
    return (torch.cat([packed, torch.zeros(n, 24, dtype=torch.uint8)], 1),
            torch.cat([scales, torch.zeros(n, 3, dtype=torch.uint8)], 1))


@pytest.mark.parametrize("config,note", VALUES_EXHAUSTIVE_CONFIGS, ids=[n for _, n in VALUES_EXHAUSTIVE_CONFIGS])
@pytest.mark.parametrize("hot", ONE_HOTS, ids=["min", "one", "max-negative"])
@pytest.mark.parametrize("side", ["weights", "activations"])
def test_values_gemm_exact_for_every_code_and_scale(device, side, hot, config, note):
    """As test_triton_stages.py's exhaustive check, for the values GEMM: all 16 codes under each of the
    127 finite scales on ``side`` (K16 weights, or fp16 activation values) times one-hot rows of
    ``hot``; every output is one product, so it must equal the reference bit for bit."""
    every_q, every_s = _padded_to_64(*every_code_and_scale())
    hot_q, hot_s = _padded_to_64(*_one_hot_rows(*hot))
    (a_q, a_s), (b_q, b_s) = ((hot_q, hot_s), (every_q, every_s)) if side == "weights" else \
        ((every_q, every_s), (hot_q, hot_s))
    n = a_q.shape[0]
    a_sf, bso = swizzle_scales_grouped(a_s.view(torch.float8_e4m3fn), torch.tensor([0, n], dtype=torch.int32))
    values = decode_scaled(a_q, a_s.view(torch.float8_e4m3fn)).half()
    a = Quantized(a_q.to(device), a_sf.to(device), values.to(device))
    wt = WeightOperand.build(b_q[None].contiguous().to(device), b_s.view(torch.float8_e4m3fn)[None].to(device),
                             torch.ones(1, 1, device=device))
    k16 = K16Weights(_tk().k16_codes(wt.packed), wt.scales, wt.alpha)
    r = _grouped([0, n], bso.tolist(), device)
    got = tb.STAGES_VALUES.grouped_gemm(a, k16, r, torch.bfloat16, config=_tk().GemmConfig(*config))
    want = stages.grouped_gemm(a, wt, r, torch.bfloat16)
    bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
    assert bad.shape[0] == 0, [(r, c, float(got[r, c]), float(want[r, c])) for r, c in bad[:8].tolist()]


# --------------------------------------------------------------------------- the whole forward

VALUES_CASES = [
    Case(7, 8, 2, 64, 64, note="plain multi-token top-2"),
    Case(8, 8, 3, 128, 64, routing="with_minus_one", note="-1 ids"),
    Case(5, 6, 2, 64, 128, split_gate_up=True, note="gate and up with different global scales"),
    Case(6, 8, 2, 64, 64, on_input=True, note="router weights on the input"),
    Case(5, 8, 2, 64, 64, dtype=torch.float16, note="fp16"),
]


@pytest.mark.parametrize("case", VALUES_CASES, ids=str)
def test_fused_moe_values_matches_reference(device, case):
    """``operand_form("values")``: the whole forward against the exact reference, with the tolerance of
    the codes path (tests/test_triton_moe.py: the same products, another fp32 summation order)."""
    gen = torch.Generator().manual_seed(case.seed)
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    with tb.operand_form("values"):
        out = torch.full_like(x, float("nan"))
        got = fused_moe(x, ex, w, ids, backend="triton", apply_router_weight_on_input=case.on_input, out=out)
        assert tb.stages_for_problem(MoEProblem(x, ex, w, ids, case.on_input, None)) is tb.STAGES_VALUES
    ref = fused_moe(x, ex, w, served_ids(ids, ex.num_experts), backend="reference",
                    apply_router_weight_on_input=case.on_input)
    assert got is out and not bool(got.isnan().any())
    rms, mx = errors(got, ref)
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)


def test_values_table_takes_the_dense_gemm_past_dense_from():
    """Past DENSE_FROM (256) rows per expert the values table's GEMM is the dense one, with a chunk of
    1 GiB: the whole of Qwen3's gate/up weights (128 experts x 1536 x 2048 fp16 = 768 MiB) in one chunk,
    DeepSeek-V3's (4096 x 7168: 56 MiB an expert) in chunks of 16 experts; at 256 and below the in-loop
    64x256 tile. The codes table has no dense tile, and neither needs a scratch but the dense one."""
    tk = _tk()
    cpu = torch.device("cpu")
    assert tk.DENSE_FROM == 256
    assert tk.gemm_config(256 * 128, 128, True).dense_mib == 0  # Qwen3 M=4096: 256 rows per expert
    dense = tk.gemm_config(257 * 128, 128, True)
    assert (dense.block_m, dense.block_n, dense.block_k, dense.dense_mib) == (128, 256, 64, 1024)
    assert not any(cfg.dense_mib for _, cfg in tk.GEMM_CONFIGS)
    assert tk.gemm_config(16384 * 8, 128, False).dense_mib == 0
    assert tk.dense_experts(dense, 128, 1536, 2048) == 128
    assert tk.dense_experts(dense, 256, 4096, 7168) == 16
    assert tk.dense_nbytes(None, 16384 * 8, 128, 1536, 2048, cpu) == 128 * 1536 * 2048 * 2
    assert tk.dense_nbytes(None, 4096 * 8, 128, 1536, 2048, cpu) == 0
    assert tk.dense_nbytes(None, 16384 * 8, 128, 1536, 2048, cpu, values=False) == 0
    assert tk.dense_experts(tk.GemmConfig(16, 16, 64, False, dense_mib=1), 9, 1024, 1024) == 1  # 2 MiB each
    assert tk.dense_experts(tk.GemmConfig(16, 16, 64, False, dense_mib=1), 9, 256, 256) == 8  # 8 of 9 (x4)


def test_fused_moe_values_dense_gemm_matches_reference(device, monkeypatch):
    """A plan whose GEMMs take the dense form (pinned here; the table's beyond DENSE_FROM rows per expert):
    the weights dequantized into the workspace's ``dense_weights`` scratch, expert chunk by chunk, then fp16
    GEMMs; the whole forward against the exact reference, twice (the second call runs the plan's prepared
    launches; a pinned configuration is never replayed). With 1 MiB chunks GEMM1's 640 x 512 fp16 experts
    (640 KiB) go one by one and GEMM2's 512 x 320 ones (320 KiB) three at a time, so GEMM2's chunk is the
    larger: the plan takes one scratch buffer of that size for both (a workspace keeps every buffer it
    hands out)."""
    case = Case(12, 5, 2, 512, 320, routing="with_minus_one")
    gen = torch.Generator().manual_seed(41)
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    from moe_fp4.triton_kernels import _common

    launched = []
    call = _common.Launch.__call__
    monkeypatch.setattr(_common.Launch, "__call__",
                        lambda self, *free: (launched.append(self._kernel.__name__), call(self, *free))[1])
    dense = _tk().GemmConfig(32, 64, 64, False, 4, 3, 1, "bits", 1)
    assert (_tk().dense_experts(dense, 5, 640, 512), _tk().dense_experts(dense, 5, 512, 320)) == (1, 3)
    ref = fused_moe(x, ex, w, served_ids(ids, ex.num_experts), backend="reference")
    with tb.operand_form("values"), tb.pinned_gemm_config(dense):
        for _ in range(2):
            launched.clear()
            got = fused_moe(x, ex, w, ids, backend="triton", out=torch.full_like(x, float("nan")))
            rms, mx = errors(got, ref)
            assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)
        ws = cached_workspace(tb.STAGES_VALUES, MoEProblem(x, ex, w, ids, False, None))
    assert launched.count("dequantize_k16_kernel") == 5 + 2, launched  # GEMM1: 5 chunks, GEMM2: 3 + 2 experts
    assert launched.count("grouped_gemm_kernel") == 7, launched
    assert [t.numel() for t in ws._scratch["dense_weights"]] == [3 * 512 * 320 * 2]


def test_values_layout_replaces_the_canonical_weights_and_restores_them(device):
    """The K16 layout takes the canonical tensors' place (the same storage: no second copy of the
    codes) and the canonical attributes read back exactly what was loaded."""
    case = Case(3, 4, 2, 128, 128)  # 128-row sections: the swizzled scales need no padding
    gen = torch.Generator().manual_seed(3)
    ex = make_experts(case, gen, device)
    w13_c, s13_c, _, w2_c, s2_c, *_ = ex.stored()  # reading them hands nothing out
    before = [t.view(torch.uint8).clone() for t in (w13_c, s13_c, w2_c, s2_c)]
    w13, w2 = tb.STAGES_VALUES.weights(ex)
    assert ex.layout == "triton-k16"
    assert isinstance(w13, K16Weights) and isinstance(w2, K16Weights)
    assert w13.packed.data_ptr() == w13_c.data_ptr() and w2.packed.data_ptr() == w2_c.data_ptr()
    assert torch.equal(w13.packed, _tk().k16_codes(before[0])) and torch.equal(w2.packed, _tk().k16_codes(before[2]))
    c = ex.canonical_tensors()
    got = [c[k].view(torch.uint8) for k in ("w13", "w13_scale", "w2", "w2_scale")]
    assert all(torch.equal(a, b) for a, b in zip(got, before, strict=True))


# --------------------------------------------------------------------------- refusals


def test_values_refusals(device):
    case = Case(2, 4, 2, 64, 32)  # I = 32: not a multiple of 64
    gen = torch.Generator().manual_seed(5)
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    with tb.operand_form("values"), pytest.raises(ValueError, match="multiples of 64"):
        fused_moe(x, ex, w, ids, backend="triton")
    # "auto" falls back to the codes where the values cannot run, on any device.
    assert tb.stages_for_problem(MoEProblem(x, ex, w, ids, False, None)) is tb.STAGES
    with pytest.raises(ValueError, match="form: expected one of"):
        with tb.operand_form("fp16"):
            pass
    with pytest.raises(ValueError, match="K16 layout needs K a multiple of 64"):
        K16Weights(torch.zeros(1, 16, 16, dtype=torch.uint8, device=device),
                   torch.zeros(1, 1, 128, 4, dtype=torch.uint8, device=device), torch.ones(1, 1, device=device))
    with pytest.raises(ValueError, match="values_dtype"):
        StageSet.from_kernels("bad", tb.STAGES.grouped_gemm.stage_kernels, values_dtype=torch.float16)
    # Each GEMM refuses the other's weights: canonical codes are not K16 codes.
    r = stages.routing(torch.zeros(1, 1, dtype=torch.int32, device=device), 1)
    codes = WeightOperand.build(torch.zeros(1, 32, 32, dtype=torch.uint8, device=device),
                                torch.ones(1, 32, 4, device=device).to(torch.float8_e4m3fn),
                                torch.ones(1, 1, device=device))
    k16 = K16Weights(codes.packed, codes.scales, codes.alpha)
    a = Quantized.empty(1, 64, 1, device, values=torch.float16)
    with pytest.raises(TypeError, match="expected a K16Weights"):
        tb.STAGES_VALUES.grouped_gemm(a, codes, r, torch.bfloat16)
    with pytest.raises(TypeError, match="expected a WeightOperand"):
        tb.STAGES.grouped_gemm(a, k16, r, torch.bfloat16)
    with pytest.raises(ValueError, match="values .* of dtype float16"):
        tb.STAGES_VALUES.grouped_gemm(Quantized.empty(1, 64, 1, device, values=torch.bfloat16), k16, r,
                                      torch.bfloat16)
    # The dense GEMM multiplies values only; it never splits K.
    dense = _tk().GemmConfig(16, 16, 64, False, dense_mib=1)
    with pytest.raises(ValueError, match="config: the dense GEMM .* multiplies the activation values"):
        tb.STAGES.grouped_gemm(Quantized.empty(1, 64, 1, device), codes, r, torch.bfloat16, config=dense)
    dense_k128 = _tk().GemmConfig(16, 16, 128, False, dense_mib=1)
    with pytest.raises(ValueError, match="config: the dense GEMM needs K a multiple of block_k .* K = 64"):
        tb.STAGES_VALUES.grouped_gemm(a, k16, r, torch.bfloat16, config=dense_k128)
    with pytest.raises(ValueError, match="GemmConfig.split_k: the dense GEMM"):
        _tk().GemmConfig(16, 16, 64, False, split_k=0, dense_mib=1)
    with pytest.raises(ValueError, match="GemmConfig.dense_mib: expected an int >= 0, got -1"):
        _tk().GemmConfig(16, 16, 64, False, dense_mib=-1)
    for maxnreg in (16, 100, 256, 96.0):
        with pytest.raises(ValueError, match=f"GemmConfig.maxnreg: expected 0 .* a multiple of 8 from 32 to 248, "
                                             f"got {maxnreg!r}"):
            _tk().GemmConfig(16, 16, 64, False, maxnreg=maxnreg)


def test_operand_form_from_the_environment(monkeypatch, device):
    case = Case(2, 4, 2, 64, 64)
    gen = torch.Generator().manual_seed(6)
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    problem = MoEProblem(x, ex, w, ids, False, None)
    monkeypatch.setenv("MOE_FP4_TRITON_OPERAND", "values")
    assert tb.stages_for_problem(problem) is tb.STAGES_VALUES
    with tb.operand_form("codes"):
        assert tb.stages_for_problem(problem) is tb.STAGES
    monkeypatch.setenv("MOE_FP4_TRITON_OPERAND", "nibbles")
    with pytest.raises(ValueError, match="MOE_FP4_TRITON_OPERAND: expected one of"):
        tb.stages_for_problem(problem)
    monkeypatch.delenv("MOE_FP4_TRITON_OPERAND")
    # "auto", the default: the values on a 9.x GPU, the codes elsewhere (the CPU interpreter included).
    sm90 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    auto = tb.STAGES_VALUES if sm90 else tb.STAGES
    assert tb.stages_for_problem(problem) is auto
    with tb.operand_form("auto"):
        assert tb.stages_for_problem(problem) is auto
    # The benchmark's stage rows ask by device (the signature cutlass.stages_for has).
    with tb.operand_form("values"):
        assert tb.stages_for(device) is tb.STAGES_VALUES
    with tb.operand_form("codes"):
        assert tb.stages_for(device) is tb.STAGES
    assert tb.stages_for(device) is auto
    assert tb.stages_for(device, "w4a16") is tb.STAGES_VALUES_W4A16  # (tests/test_triton_w4a16.py)


# --------------------------------------------------------------------------- on the H200


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,e,nk,m,topk", GRID, ids=GRID_IDS)
def test_issue_grid_values_gpu(dtype, e, nk, m, topk):
    """The 640-case grid (every (n, k) of it is a multiple of 64) with the values operand, poisoned
    workspace and output, against the reference within the codes path's tolerance; a second call (the
    shape's plan, with its fused launches) equals the first (the stage functions) bit for bit, and so
    do a third and a fourth on copies of the inputs (on a GPU with the CUDA library: the third learns
    the plan's launches, the fourth replays them with the copies' addresses)."""
    ex, x, w, ids = grid_case(dtype, e, nk, m, topk)
    with tb.operand_form("values"):
        poison(*cached_workspace(tb.STAGES_VALUES, MoEProblem(x, ex, w, ids, False, None)).tensors())
        out = torch.full_like(x, float("nan"))
        got = fused_moe(x, ex, w, ids, backend="triton", out=out)
        again = fused_moe(x, ex, w, ids, backend="triton")
        learned = fused_moe(x.clone(), ex, w.clone(), ids.clone(), backend="triton")
        replayed = fused_moe(x.clone(), ex, w.clone(), ids.clone(), backend="triton")
    ref = fused_moe(x, ex, w, ids, backend="reference")
    assert got is out and not bool(got.isnan().any())
    assert torch.equal(again, got) and torch.equal(learned, got) and torch.equal(replayed, got)
    rms, mx = errors(got, ref)
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 512, 4096])
def test_values_cuda_graph_replays_the_eager_result_gpu(m):
    """Captured once after an eager call, a replay on new inputs equals an eager call on them, bit for bit
    (m = 4096: 512 rows per expert, the table's dense GEMM, its weight scratch allocated before capture)."""
    ex, x, w, ids = grid_case(torch.bfloat16, 64, (768, 2048), m, 8)
    x2 = torch.randn_like(x) / 10
    with tb.operand_form("values"):
        out = torch.empty_like(x)
        fused_moe(x, ex, w, ids, backend="triton", out=out, validate=False)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused_moe(x, ex, w, ids, backend="triton", out=out, validate=False)
        x.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        eager = fused_moe(x2, ex, w, ids, backend="triton", validate=False)
    assert torch.equal(out, eager)


def test_the_host_cost_benchmark_runs_the_values_plans_launches_one_by_one():
    """``benchmarks/pipeline_host_cost.py`` times a plan's launches one by one with the kernels stubbed:
    the values form's fused routing-and-quantization launch too, at decode (fused) and M=64 (not)."""
    import importlib.util
    from pathlib import Path

    from moe_fp4.bench.hostcost import stubbed_launches

    if torch.cuda.is_available():
        pytest.skip("the CPU tool's check; on a GPU the tool itself runs")
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "pipeline_host_cost.py"
    spec = importlib.util.spec_from_file_location("pipeline_host_cost", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    ex = tool._experts()
    with stubbed_launches(sm90=False), tb.operand_form("values"):
        for M in (1, 64):
            rows = tool.components(ex, "triton", M, reps=1, rounds=1)
            assert rows["launch quantize_rows"] > 0 and rows["launch gemm1"] > 0, rows
