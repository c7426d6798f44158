"""``backend="cutlass"`` on Hopper: the CUDA pipeline kernels with the library's sm_90a GEMM.

On compute capability 9.x the cutlass backend runs ``cutlass.STAGES_SM90``: the quantization
kernels also write the rows' exact 16-bit values and the sm_90a GEMM multiplies them with the
NVFP4 weights dequantized in registers (16-bit wgmma, fp32 accumulation). Every test compares
against an independent reference (the reference backend, the reference stages); all are
GPU tests (marked ``gpu`` and ``sm90``), skipped elsewhere. The CPU side of the same code
(the weight re-layout's host mode, argument checks) is in tests/test_native.py.
"""

from __future__ import annotations

import pytest
import torch
from moe_cases import GRID as ISSUE_GRID
from moe_cases import GRID_IDS as ISSUE_GRID_IDS
from moe_cases import gpu_experts, grid_case, sm90_row_order_stages

from moe_fp4 import fused_moe, stages
from moe_fp4.buffers import Quantized
from moe_fp4.testing import assert_same_buffers, errors, routed_ids

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

# The whole forward against the exact reference: both compute the same products; only the fp32
# summation order of the two GEMMs differs, which moves a 16-bit GEMM output by at most one ulp
# (2^-8 relative in bf16) and, rarely, an element of the re-quantized intermediate across an
# E2M1 rounding boundary (a few percent of one row's output). Same bounds as the Triton tests.
RMS_TOL = 1e-2
MAX_TOL = 0.1

GRID = [
    # (m, e, topk, h, i, dtype, split_gate_up, pattern, apply_router_weight_on_input)
    (1, 128, 8, 2048, 768, torch.bfloat16, False, "random", False),  # Qwen3-30B-A3B decode
    (4, 128, 8, 2048, 768, torch.float16, False, "random", False),
    (64, 128, 8, 2048, 768, torch.bfloat16, True, "skewed", False),  # gate != up global scales, skewed routing
    (300, 40, 6, 1024, 512, torch.bfloat16, False, "skip", True),  # an empty expert, weights on the input
    (7, 17, 3, 256, 128, torch.float16, False, "minus_one", False),  # prime E, -1 ids
    (1024, 8, 2, 512, 256, torch.bfloat16, False, "random", False),  # 256 rows per expert: 96-token tiles
    (256, 8, 2, 512, 256, torch.float16, True, "random", False),  # 64: 80-token tiles
    (128, 8, 2, 512, 256, torch.bfloat16, True, "random", False),  # 32: 48-token tiles
    (4096, 8, 2, 512, 256, torch.bfloat16, False, "skewed", False),  # 1024: 112-token tiles, skewed
    (33, 8, 8, 160, 96, torch.bfloat16, True, "one_expert", False),  # topk == E, K % 64 != 0
    # 128 experts hit: the GEMMs' 128-row CTAs (RB = 2) with a partial last tile (n = 192, 160) and K % 64 != 0
    (64, 128, 8, 160, 96, torch.float16, False, "random", False),
    # Long K at decode: both GEMMs split K across clusters of 4 CTAs (M = 1: GEMM1 64 tiles of
    # 128 rows over K = 4096, GEMM2 32), GEMM2 across clusters of 2 (M = 3, 6 slots over 8
    # experts); the plans are checked on the CPU in tests/test_native.py::test_sm90_gemm_plan.
    (1, 4, 1, 4096, 4096, torch.bfloat16, False, "random", False),
    (3, 8, 2, 4096, 4096, torch.float16, True, "random", False),
    # K = 8192 (128 chunks) at decode: GEMM2 (~112 tiles) splits K in 2 through the plan's workspace
    # (GS, in place of a cluster of 2; test_native.py::SM90_GS).
    (2, 4, 1, 8192, 8192, torch.bfloat16, False, "random", False),
]


_experts = gpu_experts


@pytest.mark.parametrize("precision", ["w4a4", "w4a16"])
@pytest.mark.parametrize("m,e,topk,h,i,dtype,split,pattern,on_input", GRID,
                         ids=[f"m{c[0]}-e{c[1]}-k{c[2]}-h{c[3]}-i{c[4]}-{str(c[5])[6:]}-{c[7]}" for c in GRID])
def test_fused_moe_cutlass_equals_reference(m, e, topk, h, i, dtype, split, pattern, on_input, precision):
    """Both precisions against the reference of the same precision (W4A16 has no re-quantization,
    so only the fp32 summation order differs and the W4A4 bounds hold with margin)."""
    ex = _experts(e, h, i, dtype, split, seed=m * 7 + e)
    gen = torch.Generator().manual_seed(m + e)
    x = (torch.randn(m, h, generator=gen) / 3).to(dtype).cuda()
    ids = routed_ids(m, topk, e, gen, pattern).cuda()
    w = torch.rand(m, topk, generator=gen).cuda()
    out = torch.full_like(x, float("nan"))
    kw = {"apply_router_weight_on_input": on_input, "precision": precision}
    got = fused_moe(x, ex, w, ids, backend="cutlass", out=out, **kw)
    ref = fused_moe(x, ex, w, ids, backend="reference", **kw)
    assert got is out and not bool(got.isnan().any())
    unserved = (ids < 0).all(dim=1)
    assert bool((got[unserved] == 0).all())
    rms, mx = errors(got, ref)
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)
    if precision == "w4a16":  # and the W4A4 result of the same call is further from it
        rms4, _ = errors(fused_moe(x, ex, w, ids, backend="cutlass", apply_router_weight_on_input=on_input), ref)
        assert rms < rms4, (rms, rms4)


@pytest.mark.parametrize("dtype,e,nk,m,topk", ISSUE_GRID, ids=ISSUE_GRID_IDS)
def test_issue_grid(dtype, e, nk, m, topk):
    """The established grid (640 cases, the Triton backend's: vLLM's NVFP4 MoE test grid), poisoned output."""
    ex, x, w, ids = grid_case(dtype, e, nk, m, topk)
    out = torch.full_like(x, float("nan"))
    got = fused_moe(x, ex, w, ids, backend="cutlass", out=out)
    assert got is out and not bool(got.isnan().any())
    rms, mx = errors(got, fused_moe(x, ex, w, ids, backend="reference"))
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)


# (E, M, topk, K, dtype, pattern): the values-only kernel's paths: one unit per thread (small), many
# units per thread with the expert kept from the last slot (Qwen3, Llama-like top-1 with long rows,
# skewed routing), E > 1024, E past the offsets the kernel stages in shared memory (12288: every
# unit searches the offsets in global memory), and -1 ids (slots past the routed rows: zeros).
VALUES_CASES = [
    (9, 40, 4, 320, torch.bfloat16, "minus_one"),
    (128, 4096, 8, 2048, torch.bfloat16, "random"),
    (16, 3000, 1, 5120, torch.float16, "skewed"),
    (1031, 64, 8, 128, torch.float16, "random"),
    (13000, 700, 2, 64, torch.bfloat16, "minus_one"),
]


def _row_stage_sets(precision: str):
    """(the sm_90a stage set, the reference stage set) whose row stages write ``precision``'s GEMM operand:
    W4A4 the exactly dequantized NVFP4 rows, W4A16 the rows themselves (the same kernels without gs)."""
    from moe_fp4.backends import cutlass

    if precision == "w4a16":
        return cutlass.STAGES_SM90_W4A16, stages.STAGES_W4A16
    return cutlass.STAGES_SM90, stages.STAGES


@pytest.mark.parametrize("order", ["token", "slot"])
@pytest.mark.parametrize("precision", ["w4a4", "w4a16"])
@pytest.mark.parametrize("e, m, topk, k, dtype, pattern", VALUES_CASES,
                         ids=["small", "qwen3-m4096", "top1-k5120-skewed", "e1031", "e13000-unstaged"])
def test_quantized_values_equal_the_reference_stage(e, m, topk, k, dtype, pattern, precision, order):
    """The quantization kernels' 16-bit values are exactly the reference's (W4A4: codes times block scale;
    W4A16: the rows); the sm_90a stage sets write no codes (their GEMM multiplies the values), so only the
    values are compared, poisoned before. Both gather kernels: in token order (the stage sets') and in slot
    order (moe_fp4_quantize_rows without codes)."""
    got_set, want_set = _row_stage_sets(precision)
    got_set = sm90_row_order_stages(precision, order)
    gen = torch.Generator().manual_seed(3)
    ids = routed_ids(m, topk, e, gen, pattern).cuda()
    r = stages.routing(ids, e)
    x = (torch.randn(m, k, generator=gen) * 4).to(dtype).cuda()
    gs = (2688.0 / (0.3 + torch.rand(e, generator=gen))).cuda()
    row_scale = torch.rand(m * topk, generator=gen).cuda() if pattern == "skewed" else None
    out = Quantized.empty(m * topk, k, e, x.device, values=x.dtype)
    out.values.fill_(float("nan"))
    got = got_set.quantize_rows(x, gs, r, row_scale=row_scale, out=out)
    want = want_set.quantize_rows(x, gs, r, row_scale=row_scale,
                                  out=Quantized.empty(m * topk, k, e, x.device, values=x.dtype))
    assert got.values is not None and not got_set.activation_codes
    assert_same_buffers(got.values, want.values, "quantize_rows values")


@pytest.mark.parametrize("precision", ["w4a4", "w4a16"])
@pytest.mark.parametrize("e, m, topk, i, dtype", [(9, 40, 4, 320, torch.float16), (128, 2048, 8, 768, torch.bfloat16)],
                         ids=["small", "qwen3-m2048"])
def test_silu_values_equal_the_reference_stage(e, m, topk, i, dtype, precision):
    """The SiLU-and-mul quantization's 16-bit values, as above (the same values-only kernel, the other row
    source): bit for bit, CUDA's expf and torch's CUDA exp giving the same silu (measured: equal on every case)."""
    got_set, want_set = _row_stage_sets(precision)
    gen = torch.Generator().manual_seed(4)
    r = stages.routing(routed_ids(m, topk, e, gen, "minus_one").cuda(), e)
    h = (torch.randn(m * topk, 2 * i, generator=gen) * 4).to(dtype).cuda()
    gs = (2688.0 / (0.5 + torch.rand(e, generator=gen))).cuda()
    out = Quantized.empty(m * topk, i, e, h.device, values=h.dtype)
    out.values.fill_(float("nan"))
    got = got_set.silu_mul_quantize(h, gs, r, out=out)
    want = want_set.silu_mul_quantize(h, gs, r, out=Quantized.empty(m * topk, i, e, h.device, values=h.dtype))
    assert got.values is not None
    assert_same_buffers(got.values, want.values, "silu_mul_quantize values")


# The routing and the first quantization in one launch (moe_fp4_routing_quantize_values, a decode plan's
# first launch): (m, e, topk, k, dtype, pattern, router weights on the input).
FUSED_ROUTING_CASES = [
    (0, 5, 2, 64, torch.bfloat16, "random", False),  # no slots: the offsets are still written (zeros)
    (1, 128, 8, 2048, torch.bfloat16, "random", False),  # Qwen3-30B-A3B decode
    (1, 16, 1, 5120, torch.float16, "random", True),  # Llama-4-Scout decode, one slot
    (5, 3, 3, 192, torch.bfloat16, "minus_one", True),  # -1 ids (slots past the routed rows: zeros)
    (6, 9, 2, 64, torch.float16, "out_of_range", False),  # ids outside [-1, E): never routed
    (32, 8, 8, 64, torch.bfloat16, "one_expert", False),  # 256 slots, the most; 32 rows on expert 1
    (256, 4, 1, 96, torch.float16, "one_expert", False),  # one expert holding 256 rows: two 128-row scale blocks
    (8, 5000, 8, 128, torch.float16, "random", False),  # E + 1 offsets past one CTA's routing writes
    (4, 256, 8, 7168, torch.bfloat16, "skewed", True),  # DeepSeek-V3-like decode, skewed routing
]


@pytest.mark.parametrize("m, e, topk, k, dtype, pattern, on_input", FUSED_ROUTING_CASES,
                         ids=["no-slots", "qwen3-m1", "llama-m1-weighted", "minus-one", "out-of-range", "256-slots",
                              "256-rows-one-expert", "e5000", "deepseek-m4-skewed"])
@pytest.mark.parametrize("precision", ["w4a4", "w4a16"])
def test_fused_routing_quantize_equals_the_reference_stages(m, e, topk, k, dtype, pattern, on_input, precision):
    """moe_fp4_routing_quantize_values writes, into poisoned buffers, exactly the reference routing's four
    outputs and the reference quantization's 16-bit values (the bytes the two launches it replaces write;
    W4A16, gs NULL: the rows unquantized, stages.w4a16_rows)."""
    from moe_fp4 import _native
    from moe_fp4.backends import cutlass
    from moe_fp4.buffers import RoutingData
    from moe_fp4.testing import served_ids

    gen = torch.Generator().manual_seed(m * 31 + e)
    ids = routed_ids(m, topk, e, gen, pattern).cuda()
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype).cuda()
    gs = (2688.0 / (0.3 + torch.rand(e, generator=gen))).cuda()
    row_scale = torch.rand(m * topk, generator=gen).cuda() if on_input else None
    want_r = stages.routing(served_ids(ids, e), e)
    want_q = _row_stage_sets(precision)[1].quantize_rows(x, gs, want_r, row_scale=row_scale,
                                                         out=Quantized.empty(m * topk, k, e, x.device, values=dtype))
    got_r = RoutingData.empty(m * topk, e, x.device)
    for t in (got_r.expert_offsets, got_r.blockscale_offsets, got_r.slot_to_flat, got_r.flat_to_slot):
        t.fill_(0x7F7F7F7F)  # not 0xFF: its -1 is a legitimate value of the two slot maps
    values = torch.full((m * topk, k), float("nan"), dtype=dtype, device=x.device)
    p = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    _native.library().call(
        "moe_fp4_routing_quantize_values", topk_ids=p(ids), x=p(x), x_dtype=cutlass._ROW_DTYPES[dtype], x_rows=m, k=k,
        topk=topk, row_scale=p(row_scale), gs=p(gs) if precision == "w4a4" else None, num_experts=e,
        expert_offsets=p(got_r.expert_offsets),
        blockscale_offsets=p(got_r.blockscale_offsets), slot_to_flat=p(got_r.slot_to_flat),
        flat_to_slot=p(got_r.flat_to_slot), values=p(values), device=x.device.index,
        stream=torch.cuda.current_stream().cuda_stream)
    assert_same_buffers(got_r, want_r, "routing")
    assert_same_buffers(values, want_q.values, "quantize_rows values")


@pytest.mark.parametrize("precision", ["w4a4", "w4a16"])
def test_decode_plans_route_and_quantize_in_one_launch(monkeypatch, precision):
    """A repeated shape of at most FUSED_ROUTING_MAX slots runs its plan with the routing and the first row
    stage as one launch (W4A16: gs NULL, the rows unquantized), with the output of the first (stage by stage,
    unfused) call bit for bit; past it, the plan keeps the two launches."""
    from moe_fp4 import _native
    from moe_fp4.backends import cutlass

    bound: list[str] = []
    bind = _native.NativeLibrary.bind
    monkeypatch.setattr(_native.NativeLibrary, "bind", lambda self, name, **kw: (bound.append(name),
                                                                                  bind(self, name, **kw))[1])
    ex = _experts(16, 256, 128, torch.bfloat16, True, seed=21)
    for m, topk in ((1, 8), (32, 8), (33, 8), (3, 4)):  # 8, 256 (the limit), 264 and 12 slots
        gen = torch.Generator().manual_seed(m)
        x = (torch.randn(m, 256, generator=gen) / 3).bfloat16().cuda()
        ids = routed_ids(m, topk, 16, gen, "minus_one").cuda()
        w = torch.rand(m, topk, generator=gen).cuda()
        kw = {"backend": "cutlass", "precision": precision, "apply_router_weight_on_input": m == 3}
        bound.clear()
        first = fused_moe(x, ex, w, ids, **kw).clone()  # the checked stages; binds the plan
        again = fused_moe(x, ex, w, ids, **kw)  # the plan
        fused = m * topk <= cutlass.FUSED_ROUTING_MAX
        assert ("moe_fp4_routing_quantize_values" in bound) == fused, (m, topk, bound)
        assert torch.equal(again, first), (m, topk)
        rms, mx = errors(again, fused_moe(x, ex, w, ids, backend="reference", precision=precision,
                                          apply_router_weight_on_input=m == 3))
        assert rms <= RMS_TOL and mx <= MAX_TOL, (m, topk, rms, mx)


@pytest.mark.parametrize("m", [1, 256])
def test_gemm_stage_within_bound_of_the_reference(m):
    """The sm_90a GEMM stage against stages.grouped_gemm on the same activations and weights."""
    from test_triton_stages import gemm_error_bound

    from moe_fp4.backends import cutlass

    ex = _experts(128, 2048, 768, torch.bfloat16, True, seed=m)
    gen = torch.Generator().manual_seed(m)
    ids = routed_ids(m, 8, 128, gen).cuda()
    r = stages.routing(ids, 128)
    x = (torch.randn(m, 2048, generator=gen) / 3).bfloat16().cuda()
    # The reference quantization with values: codes and scales for stages.grouped_gemm, the values
    # (bitwise the sm_90a stage's, test above) for the sm_90a GEMM.
    a = stages.quantize_rows(x, ex.a13_gs, r, out=Quantized.empty(m * 8, 2048, 128, x.device, values=x.dtype))
    w90, _ = cutlass.STAGES_SM90.weights(ex)
    w_ref, _ = stages.STAGES.weights(ex)
    got = cutlass.STAGES_SM90.grouped_gemm(a, w90, r, torch.bfloat16)
    ref = stages.grouped_gemm(a, w_ref, r, torch.bfloat16)
    bound = gemm_error_bound(a, w_ref, r, ref, got)
    ratio = float(((got.float() - ref.float()).abs() / bound).max())
    assert ratio <= 1.0, ratio


# The first GEMM with SiLU-and-mul in its epilogue (moe_fp4_sm90_gemm_silu) against the GEMM and the SiLU
# stage it replaces, on one configuration each. Every tile width and K split of the GEMM (one-tile and
# persistent CTAs, two K-slices per CTA, clusters, splits through the workspace), on E = 8, top-2, I = 96
# (a partial last weight tile, n = 192) and H = 160 (a partial K chunk; 1040 for the split through the
# workspace): {tile_tokens: [(slices, cta_splits, gs_splits, m, dtype), ...]} (the 8-token tile, the one the
# epilogue is built for); then Qwen3-30B-A3B's first GEMM at M = 1 and 64 on the heuristic's configuration.
_BF, _FP = torch.bfloat16, torch.float16
_SILU_CONFIGS = {
    8: [(1, 1, 1, 3, _BF), (2, 1, 1, 3, _FP), (1, 4, 1, 5, _BF), (1, 2, 1, 9, _FP), (1, 1, 3, 9, _BF),
        (0, 0, 1, 40, _BF), (0, 2, 1, 40, _FP)],
}
# (m, e, topk, h, i, dtype, tile_tokens, slices, cta_splits, gs_splits)
SILU_CASES = [(m, 8, 2, 1040 if g > 1 else 160, 96, dt, t, s, c, g)
              for t, configs in _SILU_CONFIGS.items() for s, c, g, m, dt in configs]
SILU_CASES += [(m, 128, 8, 2048, 768, _BF, 0, 0, 0, 0) for m in (1, 64)]  # the heuristic's 8-token tile


@pytest.mark.parametrize("precision", ["w4a4", "w4a16"])
@pytest.mark.parametrize("m, e, topk, h, i, dtype, tile, slices, splits, gsplits", SILU_CASES,
                         ids=[f"m{c[0]}-e{c[1]}-h{c[3]}-i{c[4]}-{str(c[5])[6:]}-t{c[6]}-s{c[7]}-c{c[8]}-g{c[9]}"
                              for c in SILU_CASES])
def test_gemm_silu_equals_the_gemm_then_the_silu_stage(m, e, topk, h, i, dtype, tile, slices, splits, gsplits,
                                                       precision):
    """moe_fp4_sm90_gemm_silu writes, bit for bit, what moe_fp4_sm90_grouped_gemm_config (the same
    configuration: the same fp32 sums) followed by the SiLU-and-mul stage write for the routed rows (W4A4:
    quantized with gs and dequantized; W4A16: h itself), and leaves the rows past them (poisoned) alone.
    The GEMM reads w13 in the gate/up-interleaved layout and writes its output canonical (gate | up), so
    this also checks that the unfused GEMM's columns come back in order (its bound against the reference
    GEMM: test_gemm_stage_within_bound_of_the_reference)."""
    from moe_fp4 import _native
    from moe_fp4.backends import cutlass

    got_set, _ = _row_stage_sets(precision)
    ex = _experts(e, h, i, dtype, True, seed=m + i)
    gen = torch.Generator().manual_seed(m)
    ids = routed_ids(m, topk, e, gen, "minus_one").cuda()
    r = stages.routing(ids, e)
    slots = m * topk
    x = (torch.randn(m, h, generator=gen) / 3).to(dtype).cuda()
    a = got_set.quantize_rows(x, ex.a13_gs, r, out=Quantized.empty(slots, h, e, x.device, values=dtype))
    w13, _ = got_set.weights(ex)
    gs = ex.a2_gs if precision == "w4a4" else None
    lib, p = _native.library(), (lambda t: None if t is None else t.data_ptr())
    nbytes = 0
    if gsplits > 1:
        nbytes = lib.size_query("moe_fp4_sm90_gemm_workspace_size", a_rows=slots, num_experts=e, n=2 * i, k=h,
                                tile_tokens=tile, sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
        nbytes = max(nbytes, 4 << 20)  # the GS layout: 64 KiB of counters and every unit's partial sums
    common = dict(a=p(a.values), a_dtype=cutlass._ROW_DTYPES[dtype], a_rows=slots, k=h, w=p(w13.packed),
                  w_scales=p(w13.scales), alpha=p(w13.alpha), num_experts=e, n=2 * i,
                  expert_offsets=p(r.expert_offsets), tile_tokens=tile, slices=slices, cta_splits=splits,
                  gs_splits=gsplits, device=0, stream=torch.cuda.current_stream().cuda_stream)

    def workspace():
        ws = torch.zeros(nbytes, dtype=torch.uint8, device="cuda") if nbytes else None
        return dict(workspace=p(ws), workspace_bytes=nbytes), ws

    kw, ws1 = workspace()
    hbuf = torch.full((slots, 2 * i), float("nan"), dtype=dtype, device="cuda")
    lib.call("moe_fp4_sm90_grouped_gemm_config", **common, **kw, sections=2, out=p(hbuf))
    want = got_set.silu_mul_quantize(hbuf, ex.a2_gs, r, out=Quantized.empty(slots, i, e, x.device, values=dtype))
    kw, ws2 = workspace()
    got = torch.full((slots, i), float("nan"), dtype=dtype, device="cuda")
    lib.call("moe_fp4_sm90_gemm_silu", **common, **kw, gs=p(gs), values=p(got))
    torch.cuda.synchronize()
    routed = int(r.expert_offsets[-1])
    assert routed < slots  # the -1 ids leave rows past the routed ones
    assert_same_buffers(got[:routed], want.values[:routed], "gemm_silu values")
    assert bool(got[routed:].isnan().all()), "rows past expert_offsets[E] were written"
    assert not bool(got[:routed].isnan().any())


@pytest.mark.parametrize("tile", [16, 32, 48, 64, 96, 128, 0])
def test_gemm_silu_refuses_the_wide_tiles(tile):
    """The epilogue is built for the 8-token tile: a wider one, forced or the heuristic's (0: 300 slots over 8
    experts, 38 rows each: the 48-token tile), is refused with a message naming the tile, before any launch."""
    from moe_fp4.backends import cutlass

    ex = _experts(8, 160, 96, torch.bfloat16, False, seed=3)
    r = stages.routing(routed_ids(150, 2, 8, torch.Generator().manual_seed(3)).cuda(), 8)
    a = Quantized.empty(300, 160, 8, torch.device("cuda"), values=torch.bfloat16)
    out = Quantized.empty(300, 96, 8, torch.device("cuda"), values=torch.bfloat16)
    out.values.fill_(float("nan"))
    w13, _ = cutlass.STAGES_SM90.weights(ex)
    with pytest.raises(ValueError, match="tile_tokens: SiLU-and-mul in the GEMM's epilogue is built for the 8-token "
                                         r"tile \(at most 4 rows per expert with the heuristic\), "
                                         f"this call's tile is {tile or 48} tokens"):
        cutlass._Sm90Kernels().gemm1_silu(a, w13, ex.a2_gs, r, out, (tile, 0, 0))
    torch.cuda.synchronize()
    assert bool(out.values.isnan().all())
    assert not cutlass.fuses_silu(300, 8)


def test_plans_run_the_first_gemm_with_silu(monkeypatch):
    """A plan binds moe_fp4_sm90_gemm_silu for its first GEMM where cutlass.fuses_silu (which launches it in
    place of the GEMM and the SiLU stage: test_host_path's launch equality), with the checked stages'
    (unfused) output bit for bit; with FUSE_SILU off it binds the two."""
    from moe_fp4 import _native
    from moe_fp4.backends import cutlass

    bound: list[str] = []
    bind = _native.NativeLibrary.bind
    monkeypatch.setattr(_native.NativeLibrary, "bind", lambda self, name, **kw: (bound.append(name),
                                                                                  bind(self, name, **kw))[1])
    for on in (True, False):
        monkeypatch.setattr(cutlass, "FUSE_SILU", on)
        ex = _experts(16, 256, 128, torch.bfloat16, True, seed=22)
        for m in (1, 16, 40, 700):
            gen = torch.Generator().manual_seed(m)
            x = (torch.randn(m, 256, generator=gen) / 3).bfloat16().cuda()
            ids = routed_ids(m, 4, 16, gen, "minus_one").cuda()
            w = torch.rand(m, 4, generator=gen).cuda()
            bound.clear()
            first = fused_moe(x, ex, w, ids, backend="cutlass").clone()  # the checked stages; binds the plan
            again = fused_moe(x, ex, w, ids, backend="cutlass")
            fused = on and m * 4 <= 4 * 16  # at most 4 rows per expert of 16
            assert cutlass.fuses_silu(m * 4, 16) == fused, (on, m)
            assert ("moe_fp4_sm90_gemm_silu" in bound) == fused, (on, m, bound)
            assert fused or "moe_fp4_silu_mul_quantize" in bound, (on, m, bound)
            assert torch.equal(again, first), (on, m)


def test_fused_first_gemm_beside_a_second_gemm_split_through_its_workspace(monkeypatch):
    """Where the second GEMM's plan splits K through its workspace (w2's K of 8192 at one row per expert, as
    Llama-4-Scout's at M = 2-4), a plan still fuses SiLU-and-mul into the first GEMM, which the library runs
    in the second GEMM's kernel (launch_small in gemm_sm90.cu): the fused forward equals the unfused one
    (FUSE_SILU off) bit for bit, as test_plans_run_the_first_gemm_with_silu holds where nothing splits."""
    from moe_fp4 import _native
    from moe_fp4.backends import cutlass

    if cutlass.sm90_gemm_plan(4, 4, 5120, 8192, torch.device("cuda")).gs_splits <= 1:
        pytest.skip("on this GPU's SMs the second GEMM's plan does not split K through the workspace")
    bound: list[str] = []
    bind = _native.NativeLibrary.bind
    monkeypatch.setattr(_native.NativeLibrary, "bind", lambda self, name, **kw: (bound.append(name),
                                                                                  bind(self, name, **kw))[1])
    gen = torch.Generator().manual_seed(36)
    x = (torch.randn(4, 5120, generator=gen) / 3).bfloat16().cuda()
    ids = torch.tensor([[0], [1], [2], [3]], dtype=torch.int32).cuda()
    w = torch.rand(4, 1, generator=gen).cuda()
    outs = []
    for on in (True, False):
        monkeypatch.setattr(cutlass, "FUSE_SILU", on)
        ex = _experts(4, 5120, 8192, torch.bfloat16, False, seed=36)
        bound.clear()
        first = fused_moe(x, ex, w, ids, backend="cutlass").clone()  # the checked stages; binds the plan
        outs.append(fused_moe(x, ex, w, ids, backend="cutlass").clone())  # the plan
        assert ("moe_fp4_sm90_gemm_silu" in bound) == on, (on, bound)
        assert torch.equal(outs[-1], first), on
        del ex
    assert bool(outs[0].isfinite().all())
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("precision", ["w4a4", "w4a16"])
def test_cuda_graph_and_no_host_sync(precision):
    ex = _experts(128, 2048, 768, torch.bfloat16, False, seed=11)
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(16, 2048, generator=gen) / 3).bfloat16().cuda()
    ids = routed_ids(16, 8, 128, gen).cuda()
    w = torch.rand(16, 8, generator=gen).cuda()
    out = torch.empty_like(x)
    kw = {"backend": "cutlass", "out": out, "precision": precision}
    fused_moe(x, ex, w, ids, **kw)  # warm-up: prepares weights, makes the workspace
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(x, ex, w, ids, validate=False, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, ex, w, ids, validate=False, **kw)
    x.copy_((torch.randn(16, 2048, generator=gen) / 3).bfloat16())
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    rms, mx = errors(out, fused_moe(x, ex, w, ids, backend="reference", precision=precision))
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_forward_on_another_device_keeps_the_current_device():
    """The library's entries make the tensors' device current while they run and put the caller's
    context back: with cuda:0 current, a forward on cuda:1 leaves torch's current device at 0."""
    ex = _experts(8, 256, 128, torch.bfloat16, False, seed=5).to("cuda:1")
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 256, generator=gen) / 3).bfloat16().to("cuda:1")
    ids = routed_ids(3, 2, 8, gen).to("cuda:1")
    w = torch.rand(3, 2, generator=gen).to("cuda:1")
    with torch.cuda.device(0):
        got = fused_moe(x, ex, w, ids, backend="cutlass")
        assert torch.cuda.current_device() == 0
    rms, mx = errors(got, fused_moe(x, ex, w, ids, backend="reference"))
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)


@pytest.fixture(scope="module")
def llama_w2():
    """Llama-4-Scout-sized experts (E = 16, H = 5120, I = 8192), for its second GEMM's tail split."""
    return _experts(16, 5120, 8192, torch.bfloat16, False, seed=38)


# Llama-4-Scout's second GEMM at M = 16 (top-1): ~10.3 x 40 expected tiles of 8 tokens x 128 columns (at most
# 16 x 40) on the GS kernel's 3 x 132 CTAs, so the plan splits only the tiles of the grid's last round (the tail
# split): the kernel counts the tiles from the routing, 40 per expert hit, and each tail tile takes
# min(8, CTAs / tail) K ranges. The experts hit, 1 to 16, give one round of 40 / 80 / 120 / 160 tiles, all split
# 8 / 4 / 3 / 2 ways, one round of 200 to 360 (no split), and 400 / 440 / 480 / 520 / 560 / 600 / 640 tiles: a
# tail of 4 / 44 / 84 / 124 / 164 / 204 / 244 tiles in 8 / 8 / 4 / 3 / 2 / 1 / 1 ranges.
@pytest.mark.parametrize("hit", range(1, 17))
def test_second_gemm_tail_split_within_bound_of_the_reference(llama_w2, hit):
    """The GEMM stage on the tail split's plan against stages.grouped_gemm, within the GEMM bound (any fp32
    summation order), and the same bits on a second call (each call sums the splits in the same order)."""
    from test_triton_stages import gemm_error_bound

    from moe_fp4.backends import cutlass

    dev = torch.device("cuda")
    if cutlass.sm90_gemm_plan(16, 16, 5120, 8192, dev).gs_splits != 8:
        pytest.skip("on this GPU's SMs the second GEMM at M = 16 does not take the tail split")
    ex = llama_w2
    ids = (torch.arange(16, dtype=torch.int32) % hit).view(16, 1).cuda()
    r = stages.routing(ids, 16)
    gen = torch.Generator().manual_seed(hit)
    x = (torch.randn(16, 8192, generator=gen) / 3).bfloat16().cuda()
    a = stages.quantize_rows(x, ex.a2_gs, r, out=Quantized.empty(16, 8192, 16, dev, values=x.dtype))
    _, w90 = cutlass.STAGES_SM90.weights(ex)
    _, w_ref = stages.STAGES.weights(ex)
    got = cutlass.STAGES_SM90.grouped_gemm(a, w90, r, torch.bfloat16)
    again = cutlass.STAGES_SM90.grouped_gemm(a, w90, r, torch.bfloat16)
    ref = stages.grouped_gemm(a, w_ref, r, torch.bfloat16)
    assert torch.equal(got, again), hit
    bound = gemm_error_bound(a, w_ref, r, ref, got)
    ratio = float(((got.float() - ref.float()).abs() / bound).max())
    assert ratio <= 1.0, (hit, ratio)


def test_forward_through_the_tail_split_equals_the_reference(llama_w2):
    """The whole Llama-4-Scout-sized forward at M = 16 with 11 experts hit (the second GEMM's 440 tiles: 44 in
    the tail, each in 8 K ranges): the first call (the checked stages) and the plan's two calls (the second on
    the counters the first left) give the same bits, and equal the reference within the forward's bound."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(16, 5120, generator=gen) / 3).bfloat16().cuda()
    ids = (torch.arange(16, dtype=torch.int32) % 11).view(16, 1).cuda()
    w = torch.rand(16, 1, generator=gen).cuda()
    first = fused_moe(x, llama_w2, w, ids, backend="cutlass").clone()
    again = fused_moe(x, llama_w2, w, ids, backend="cutlass").clone()
    third = fused_moe(x, llama_w2, w, ids, backend="cutlass").clone()
    assert torch.equal(again, first) and torch.equal(third, first)
    rms, mx = errors(again, fused_moe(x, llama_w2, w, ids, backend="reference"))
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)
