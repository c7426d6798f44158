"""libmoe_fp4_cuda on a machine without a GPU: the C ABI, its preconditions, the host oracle of
the pipeline kernels against moe_fp4.stages (bit for bit), and the GEMM wiring against the
format core's swizzled layout.

The host oracle (``device = MOE_FP4_HOST``) runs the very kernel bodies of quantize.cu and
reduce.cu serially on the host, so these tests check the kernels' indexing, padding, gather,
router-weight and SiLU arithmetic in CI; the GPU tests (test_cuda_pipeline.py) add the
parallel launch and the device conversion instructions.

Without the library these tests fail where the install should have built it (nvcc on PATH and
``MOE_FP4_BUILD_CUDA`` not ``0``, as in CI) and skip elsewhere; ``MOE_FP4_REQUIRE_LIB=1`` or
``=0`` overrides that choice.
"""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest
import torch

from moe_cases import EDGE_CASES, Case, make_experts, make_inputs
from moe_fp4 import _native, fused_moe, stages
from moe_fp4.backends import cutlass
from moe_fp4.backends.registry import BackendUnavailableError
from moe_fp4.moe import MoEProblem
from moe_fp4.format import (
    E2M1_VALUES,
    grouped_scale_rows_bound,
    swizzled_offset,
    swizzled_shape,
    unpack_e2m1,
    unswizzle_scales_grouped,
)

ENV_REQUIRE = "MOE_FP4_REQUIRE_LIB"


def library_required() -> bool:
    """Must the CUDA library (and its test tools) be present? See the module docstring."""
    forced = os.environ.get(ENV_REQUIRE)
    if forced in ("0", "1"):
        return forced == "1"
    build = os.environ.get("MOE_FP4_BUILD_CUDA", "auto").lower() not in ("0", "off", "no", "false")
    return build and (shutil.which("nvcc") is not None or bool(os.environ.get("CUDACXX")))


def skip_or_fail(reason: str) -> None:
    if library_required():
        pytest.fail(f"{reason} (nvcc is available, so the install should have built and checked the library; "
                    f"{ENV_REQUIRE}=0 allows skipping)")
    pytest.skip(reason)


def native_library() -> _native.NativeLibrary:
    """The built library, else skip or fail (see :func:`library_required`)."""
    try:
        return _native.library()
    except _native.LibraryUnavailable as exc:
        skip_or_fail(f"the CUDA library is unusable: {exc}")


@pytest.fixture(scope="module")
def lib() -> _native.NativeLibrary:
    return native_library()


def gemm_archs(lib: _native.NativeLibrary) -> list[int]:
    """The GEMM translation units this build holds (100 and/or 120)."""
    return sorted({100 if a.startswith("sm_10") else 120 for a in lib.archs(_native.GEMM)})


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """A buffer like ``t`` whose every byte is 0xFF (e4m3 NaN, e2m1 -6 twice): what a kernel leaves unwritten shows."""
    return torch.full_like(t.view(torch.uint8), 0xFF).view(t.dtype)


def assert_quantized_equal(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Packed rows and the whole grouped scale buffer, byte for byte (padding included)."""
    assert got[0].shape == ref[0].shape and got[1].shape == ref[1].shape
    bad_rows = (got[0] != ref[0]).any(dim=1).nonzero().flatten().tolist()
    assert not bad_rows, f"packed rows differ: {bad_rows[:10]}"
    g, r = got[1].view(torch.uint8), ref[1].view(torch.uint8)
    bad = (g != r).nonzero().tolist()
    assert not bad, f"{len(bad)} scale bytes differ, first at {bad[:5]}: got {[int(g[i, j]) for i, j in bad[:5]]}"


# --------------------------------------------------------------------------- the library itself


def test_abi_version_and_targets(lib):
    assert lib._lib.moe_fp4_abi_version() == _native.ABI_VERSION
    pipeline, gemm = lib.archs(_native.PIPELINE), lib.archs(_native.GEMM)
    # The H200 path: SASS for sm_90a, plus compute_90 PTX for any newer GPU without SASS here.
    assert "sm_90a" in pipeline and "compute_90" in pipeline, pipeline
    for target in pipeline + gemm:
        number = target.split("_")[1]
        assert number[-1] in "af" or target == "compute_90", f"{target}: plain Blackwell targets compile to stubs"
    assert set(gemm) <= {"sm_100a", "sm_100f", "sm_120a", "sm_120f", "sm_121a", "sm_121f"}, gemm
    assert set(gemm) <= set(pipeline), "every GEMM target also carries the pipeline kernels"


@pytest.mark.parametrize(
    "capability, pipeline_ok",
    [((9, 0), True), ((10, 0), True), ((12, 0), True), ((12, 1), True), ((8, 9), False), ((8, 0), False)],
)
def test_pipeline_serves_every_gpu_from_sm90(lib, capability, pipeline_ok):
    why = lib.serves(_native.PIPELINE, capability)
    if pipeline_ok:
        assert why is None
    else:
        assert f"does not run on sm_{capability[0]}{capability[1]}" in why and "9.0 or newer" in why


def test_gemm_served_only_where_built(lib):
    gemm = lib.archs(_native.GEMM)
    for cap in ((9, 0), (8, 9)):
        why = lib.serves(_native.GEMM, cap)
        assert why.startswith(f"no NVFP4 tensor-core path on sm_{cap[0]}{cap[1]}") and "use backend='triton'" in why
    expect = {
        (10, 0): bool({"sm_100a", "sm_100f"} & set(gemm)),
        (10, 3): "sm_100f" in gemm,  # sm_100a SASS does not run on 10.3
        (12, 0): bool({"sm_120a", "sm_120f"} & set(gemm)),
        (12, 1): bool({"sm_121a", "sm_120f", "sm_121f"} & set(gemm)),
        (11, 0): False,
    }
    for cap, ok in expect.items():
        why = lib.serves(_native.GEMM, cap)
        assert (why is None) == ok, (cap, why)


def test_availability_and_summary(lib):
    assert cutlass.availability(torch.device("cpu"), None) == "runs on CUDA devices only"
    reason = cutlass.availability(torch.device("cuda", 0), (9, 0))
    assert reason.startswith("no NVFP4 tensor-core path on sm_90"), reason
    summary = cutlass.library_summary()
    assert str(lib.path) in summary and "sm_90a" in summary


def test_missing_library_is_explained(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere" / "libmoe_fp4_cuda.so"
    monkeypatch.setenv("MOE_FP4_LIB", str(missing))
    expected = f"library not built: {missing} does not exist (MOE_FP4_LIB points to it)"
    assert cutlass.availability(torch.device("cuda", 0), (12, 0)) == expected
    assert cutlass.library_summary() == f"CUDA library: unavailable: {expected}"
    with pytest.raises(_native.LibraryUnavailable, match="library not built"):
        cutlass.quantize_rows(torch.zeros(1, 16, dtype=torch.bfloat16), torch.ones(1),
                              torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 128], dtype=torch.int32))


def test_a_file_that_is_not_the_library_is_explained(monkeypatch, tmp_path):
    bogus = tmp_path / "libmoe_fp4_cuda.so"
    bogus.write_bytes(b"not an ELF file")
    monkeypatch.setenv("MOE_FP4_LIB", str(bogus))
    assert cutlass.availability(torch.device("cuda", 0), (12, 0)).startswith("library not loadable:")


# --------------------------------------------------------------------------- preconditions of the C entries

NULL = None
FAKE = 0x10000  # an aligned address that is never dereferenced: every call below fails a check first
MISALIGNED = 0x10004


def _quantize_args(**kw):
    args = dict(x=FAKE, x_dtype=_native.BF16, x_rows=4, k=64, slot_to_flat=NULL, topk=1, row_scale=NULL, num_slots=4,
                gs=FAKE, eo=FAKE, bso=FAKE, E=2, packed=FAKE, scales=FAKE, scale_rows=384, device=0, stream=NULL)
    args.update(kw)
    return list(args.values())


def _gemm_args(**kw):
    args = dict(a=FAKE, a_sf=FAKE, a_rows=8, a_sf_rows=256, b=FAKE, b_sf=FAKE, alpha=FAKE, E=2, S=2, n=64, k=64,
                eo=FAKE, bso=FAKE, out=FAKE, dtype=_native.BF16, ws=FAKE, ws_bytes=1 << 20, device=0, stream=NULL)
    args.update(kw)
    return list(args.values())


PRECONDITIONS = [
    ("moe_fp4_routing", [FAKE, 8, 0, FAKE, FAKE, FAKE, FAKE, FAKE, 1 << 20, 0, NULL], "num_experts: expected at least 1, got 0"),
    ("moe_fp4_routing", [FAKE, -1, 4, FAKE, FAKE, FAKE, FAKE, FAKE, 1 << 20, 0, NULL], r"num_slots: expected a count in \[0, 2\^31\), got -1"),
    ("moe_fp4_routing", [NULL, 8, 4, FAKE, FAKE, FAKE, FAKE, FAKE, 1 << 20, 0, NULL], "topk_ids: expected a pointer, got NULL"),
    ("moe_fp4_routing", [MISALIGNED + 2, 8, 4, FAKE, FAKE, FAKE, FAKE, FAKE, 1 << 20, 0, NULL], "topk_ids: expected a 4-byte aligned address"),
    ("moe_fp4_routing", [FAKE, 8, 4, FAKE, FAKE, FAKE, FAKE, FAKE, 4, 0, NULL], r"workspace_bytes: expected at least 20 \(moe_fp4_routing_workspace_size\), got 4"),
    ("moe_fp4_routing", [FAKE, 8, 4, FAKE, FAKE, FAKE, FAKE, FAKE, 1 << 20, 99, NULL], r"device: expected a CUDA device ordinal in \[0, 64\)"),
    ("moe_fp4_quantize_rows", _quantize_args(x_dtype=2), r"x_dtype: expected MOE_FP4_BF16 \(0\) or MOE_FP4_FP16 \(1\), got 2"),
    ("moe_fp4_quantize_rows", _quantize_args(k=40), r"k: expected a positive multiple of 16 \(at most 2\^30\), got 40"),
    ("moe_fp4_quantize_rows", _quantize_args(x=MISALIGNED), "x: expected a 16-byte aligned address"),
    ("moe_fp4_quantize_rows", _quantize_args(num_slots=5), "num_slots: expected x_rows = 4 without slot_to_flat"),
    ("moe_fp4_quantize_rows", _quantize_args(row_scale=FAKE), "row_scale: expected NULL without slot_to_flat"),
    ("moe_fp4_quantize_rows", _quantize_args(slot_to_flat=FAKE, topk=2, num_slots=7), r"num_slots: expected x_rows \* topk = 4 \* 2 slots"),
    ("moe_fp4_quantize_rows", _quantize_args(slot_to_flat=FAKE, topk=0), "topk: expected at least 1, got 0"),
    ("moe_fp4_quantize_rows", _quantize_args(scale_rows=128), r"scale_rows: expected a multiple of 128 of at least 384 \(the grouped bound for 4 slots over 2 experts\), got 128"),
    ("moe_fp4_quantize_rows", _quantize_args(scale_rows=400), "scale_rows: expected a multiple of 128"),
    ("moe_fp4_quantize_rows", _quantize_args(E=0), "num_experts: expected at least 1, got 0"),
    ("moe_fp4_quantize_rows", _quantize_args(gs=NULL), "gs: expected a pointer, got NULL"),
    ("moe_fp4_quantize_rows", _quantize_args(packed=MISALIGNED), "packed: expected a 16-byte aligned address"),
    ("moe_fp4_silu_mul_quantize", [FAKE, 0, 4, 24, FAKE, FAKE, FAKE, 2, FAKE, FAKE, 384, 0, NULL], r"inter: expected a positive multiple of 16"),
    ("moe_fp4_silu_mul_quantize", [NULL, 0, 4, 32, FAKE, FAKE, FAKE, 2, FAKE, FAKE, 384, 0, NULL], "h: expected a pointer, got NULL"),
    ("moe_fp4_moe_reduce", [FAKE, 0, 8, 60, FAKE, NULL, 4, 2, FAKE, 0, 0, NULL], r"hidden: expected a positive multiple of 8"),
    ("moe_fp4_moe_reduce", [FAKE, 0, 8, 64, FAKE, NULL, 4, 2, FAKE, 7, 0, NULL], r"out_dtype: expected MOE_FP4_BF16 \(0\), MOE_FP4_FP16 \(1\) or MOE_FP4_FP32 \(2\), got 7"),
    ("moe_fp4_moe_reduce", [FAKE, 0, 8, 64, FAKE, NULL, 4, 0, FAKE, 0, 0, NULL], "topk: expected at least 1, got 0"),
    ("moe_fp4_moe_reduce", [FAKE, 0, 8, 64, FAKE, MISALIGNED + 2, 4, 2, FAKE, 0, 0, NULL], "topk_weights: expected a 4-byte aligned address"),
    ("moe_fp4_grouped_gemm", _gemm_args(k=48), r"k: expected a positive multiple of 32 \(16-byte rows of packed e2m1, as TMA needs\), got 48"),
    ("moe_fp4_grouped_gemm", _gemm_args(n=72, S=2), r"n: expected each of the 2 sections to be a positive multiple of 8 columns"),
    ("moe_fp4_grouped_gemm", _gemm_args(S=3), r"sections: expected 1 \(w2\) or 2 \(w13: gate, up\), got 3"),
    ("moe_fp4_grouped_gemm", _gemm_args(a_sf_rows=200), "a_scale_rows: expected a multiple of 128"),
    ("moe_fp4_grouped_gemm", _gemm_args(dtype=_native.FP32), r"out_dtype: expected MOE_FP4_BF16 \(0\) or MOE_FP4_FP16 \(1\), got 2"),
    ("moe_fp4_grouped_gemm", _gemm_args(b_sf=MISALIGNED), "b_sf|b_scales: expected a 16-byte aligned address"),
    ("moe_fp4_grouped_gemm", _gemm_args(ws=NULL), "workspace: expected a pointer, got NULL"),
    ("moe_fp4_grouped_gemm", _gemm_args(E=0), "num_experts: expected at least 1, got 0"),
]


@pytest.mark.parametrize("entry, args, message", PRECONDITIONS, ids=[f"{e}-{i}" for i, (e, _, _) in enumerate(PRECONDITIONS)])
def test_precondition_messages(lib, entry, args, message):
    with pytest.raises(ValueError, match=f"^{entry}: ({message})"):
        lib.call(entry, *args)


def test_workspace_queries(lib):
    assert lib.size_query("moe_fp4_routing_workspace_size", 100, 7) == 8 * 4  # one row of E+1 counters
    # 100000 ids: one row of counters per chunk of whole 256-id tiles, plus the totals row.
    big = lib.size_query("moe_fp4_routing_workspace_size", 100_000, 7)
    assert big >= 3 * 8 * 4 and big % (8 * 4) == 0
    with pytest.raises(ValueError, match="num_experts: expected at least 1"):
        lib.size_query("moe_fp4_routing_workspace_size", 10, 0)


def test_host_mode_is_pipeline_only(lib):
    with pytest.raises(BackendUnavailableError, match="routing has no host mode"):
        lib.call("moe_fp4_routing", FAKE, 8, 4, FAKE, FAKE, FAKE, FAKE, FAKE, 1 << 20, _native.HOST, NULL)
    with pytest.raises(BackendUnavailableError, match="the grouped GEMM has no host mode"):
        lib.call("moe_fp4_grouped_gemm", *_gemm_args(device=_native.HOST))


def test_python_side_validation():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    eo, bso = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 128], dtype=torch.int32)
    with pytest.raises(TypeError, match="x: expected dtype one of bfloat16, float16, got float32"):
        cutlass.quantize_rows(x.float(), torch.ones(1), eo, bso)
    with pytest.raises(ValueError, match=r"gs: expected shape \[1\], got \[2\]"):
        cutlass.quantize_rows(x, torch.ones(2), eo, bso)
    with pytest.raises(ValueError, match="row_scale: expected None without slot_to_flat"):
        cutlass.quantize_rows(x, torch.ones(1), eo, bso, row_scale=torch.ones(4))
    with pytest.raises(ValueError, match=r"out\[1\] \(scales\): expected 4 columns"):
        cutlass.quantize_rows(x, torch.ones(1), eo, bso, out=(torch.empty(4, 32, dtype=torch.uint8), torch.empty(256, 8, dtype=torch.uint8)))
    with pytest.raises(ValueError, match=r"out\[1\] \(scales\): expected a multiple of 128 of at least 256 rows .*, got shape \[128, 4\]"):
        cutlass.quantize_rows(x, torch.ones(1), eo, bso, out=(torch.empty(4, 32, dtype=torch.uint8), torch.empty(128, 4, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="x: the quantized width must be a multiple of 16, got 40"):
        cutlass.quantize_rows(x[:, :40].contiguous(), torch.ones(1), eo, bso)
    with pytest.raises(ValueError, match="topk_ids: expected a CUDA tensor"):
        cutlass.routing(torch.zeros(2, 2, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="h: expected an even row length"):
        cutlass.silu_mul_quantize(torch.zeros(4, 33, dtype=torch.float16), torch.ones(1), eo, bso)
    with pytest.raises(ValueError, match=r"flat_to_slot: expected num_tokens \* topk entries \(a positive multiple of num_tokens = 4\), got 6"):
        cutlass.moe_reduce(torch.zeros(6, 64, dtype=torch.bfloat16), torch.zeros(6, dtype=torch.int32), None, 4, torch.bfloat16)
    a, b = torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(1, 32, 32, dtype=torch.uint8)
    b_sf = torch.zeros(1, 1, 128, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="a: expected a CUDA tensor"):
        cutlass.grouped_gemm(a, torch.zeros(256, 4, dtype=torch.float8_e4m3fn), b, b_sf, torch.ones(1), eo, bso, torch.bfloat16)
    with pytest.raises(TypeError, match="out_dtype: expected bfloat16 or float16"):
        cutlass.grouped_gemm(a, torch.zeros(256, 4, dtype=torch.float8_e4m3fn), b, b_sf, torch.ones(1), eo, bso, torch.float32)
    b3, b3_sf = torch.zeros(1, 48, 32, dtype=torch.uint8), torch.zeros(1, 3, 128, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"b_sf: expected 1 \(w2\) or 2 \(w13: gate, up\) sections .*, got 3"):
        cutlass.grouped_gemm(a, torch.zeros(256, 4, dtype=torch.float8_e4m3fn), b3, b3_sf, torch.ones(1, 3), eo, bso, torch.bfloat16)


# --------------------------------------------------------------------------- the host oracle of the pipeline kernels


def _routed(M: int, topk: int, E: int, gen: torch.Generator, minus_one: bool = True, empty: int | None = 1):
    ids = torch.randint(0, E, (M, topk), generator=gen, dtype=torch.int32)
    if empty is not None:
        ids[ids == empty] = (empty + 1) % E
    if minus_one:
        ids[::3, 0] = -1
    return ids, stages.routing(ids, E)


# Each case names what it covers: (M, topk, E, K, dtype)
GATHER_CASES = [
    pytest.param(5, 2, 3, 64, torch.bfloat16, id="small-bf16"),
    pytest.param(9, 3, 7, 80, torch.float16, id="fp16-K80-not-a-multiple-of-64-prime-E"),
    pytest.param(40, 4, 5, 48, torch.bfloat16, id="an-expert-over-128-rows-K48"),
    pytest.param(3, 2, 1031, 32, torch.bfloat16, id="E-over-1024-mostly-empty"),
]


@pytest.mark.parametrize("M, topk, E, K, dtype", GATHER_CASES)
@pytest.mark.parametrize("router_weight", [False, True], ids=["plain", "router-weight-on-input"])
def test_quantize_rows_host_oracle_is_exact(lib, M, topk, E, K, dtype, router_weight):
    gen = torch.Generator().manual_seed(M * 1000 + E)
    ids, r = _routed(M, topk, E, gen)
    x = (torch.randn(M, K, generator=gen) * 3).to(dtype)
    x[0, :16] = 0  # an all-zero block: scale 0, codes 0
    x[1, 3] = -0.0
    gs = 2688.0 / (0.5 + torch.rand(E, generator=gen) * 8)
    row_scale = torch.rand(M * topk, generator=gen) if router_weight else None
    ref = stages.quantize_rows(x, gs, r.expert_offsets, r.blockscale_offsets, r.slot_to_flat, topk, row_scale)
    out = tuple(poisoned_like(t) for t in ref)
    got = cutlass.quantize_rows(x, gs, r.expert_offsets, r.blockscale_offsets, r.slot_to_flat, topk, row_scale, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert_quantized_equal(got, ref)


def test_quantize_rows_without_gather_host_oracle_is_exact(lib):
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([0, 130, 3, 0, 1])  # an empty first expert, one over 128 rows, an empty one between
    eo = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    bso = torch.cat([torch.zeros(1, dtype=torch.int64), ((counts + 127) // 128 * 128).cumsum(0)]).to(torch.int32)
    x = torch.randn(int(eo[-1]), 96, generator=gen).to(torch.bfloat16)
    gs = torch.full((5,), 300.0)
    ref = stages.quantize_rows(x, gs, eo, bso)
    got = cutlass.quantize_rows(x, gs, eo, bso, out=tuple(poisoned_like(t) for t in ref))
    assert_quantized_equal(got, ref)


def test_quantizer_ties_saturation_and_subnormal_scales(lib):
    """One block per row, chosen so every E2M1 tie, the 6.0 saturation and e4m3 subnormal scales occur."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
    rows = [ties, ties * 2.0**-8, ties * 2.0**-12, torch.linspace(-7, 7, 16), torch.full((16,), 1e-3)]
    x = torch.stack(rows).to(torch.float16)
    eo = torch.tensor([0, x.shape[0]], dtype=torch.int32)
    bso = torch.tensor([0, 128], dtype=torch.int32)
    for gs in (1.0, 2688.0 / 7.0, 1e4):
        g = torch.tensor([gs])
        ref = stages.quantize_rows(x, g, eo, bso)
        assert_quantized_equal(cutlass.quantize_rows(x, g, eo, bso), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_quantize_host_oracle(lib, dtype):
    """Bit-exact except where the host's expf and torch's CPU exp round differently (see the comparator)."""
    gen = torch.Generator().manual_seed(11)
    E, I = 6, 80
    _, r = _routed(12, 3, E, gen)
    h = (torch.randn(36, 2 * I, generator=gen) * 4).to(dtype)
    h[int(r.expert_offsets[-1]):] = float("nan")  # rows past the routed ones must be ignored
    gs = 2688.0 / (0.5 + torch.rand(E, generator=gen))
    ref = stages.silu_mul_quantize(h, gs, r.expert_offsets, r.blockscale_offsets)
    got = cutlass.silu_mul_quantize(h, gs, r.expert_offsets, r.blockscale_offsets, out=tuple(poisoned_like(t) for t in ref))
    assert_silu_quantized_close(got, ref, h, gs, r)


def assert_silu_quantized_close(got, ref, h, gs, r, max_block_fraction: float = 0.01) -> float:
    """Compare SiLU-mul-quantize outputs; returns the fraction of blocks that are not bit-identical.

    Tolerance: silu's exp comes from different libraries (CUDA expf: at most 2 ulp; torch's
    CPU exp and the host's expf: about 1 ulp). After the float32 division and the rounding of
    silu to 16 bits, a difference survives only for a value within 2 float32 ulp of a 16-bit
    rounding boundary, and then moves one activation by one 16-bit ulp. That can change that
    element's E2M1 code by one step or, if it is the block's maximum, the e4m3 scale by one
    step (re-quantizing the block). So: every byte outside the routed rows' blocks is exact
    (padding, zero rows), at most ``max_block_fraction`` of the blocks differ, and in a
    differing block every dequantized value is within the two quantizations' half steps,
    ``(sf_got + sf_ref) / gs`` (the largest E2M1 gap is 2 scale units), plus that one ulp.
    """
    valid, inter = int(r.expert_offsets[-1]), h.shape[1] // 2
    assert torch.equal(got[0][valid:], ref[0][valid:]), "rows past expert_offsets[E] must be zero"
    C = inter // 16
    sf_got = unswizzle_scales_grouped(got[1], r.expert_offsets, r.blockscale_offsets, C).float()
    sf_ref = unswizzle_scales_grouped(ref[1], r.expert_offsets, r.blockscale_offsets, C).float()
    # The padding of the scale buffer, byte for byte: blank the logical scales' bytes in both.
    expert = torch.searchsorted(r.expert_offsets[1:].long(), torch.arange(valid), right=True)
    local = torch.arange(valid) - r.expert_offsets[expert].long()
    cols = torch.arange(C)
    cp = got[1].shape[1]
    held = (r.blockscale_offsets[expert].long() * cp).unsqueeze(1) + swizzled_offset(local.unsqueeze(1), cols, C)
    pad_got, pad_ref = got[1].view(torch.uint8).flatten().clone(), ref[1].view(torch.uint8).flatten().clone()
    pad_got[held.flatten()] = 0
    pad_ref[held.flatten()] = 0
    assert torch.equal(pad_got, pad_ref), "scale padding differs"
    codes_got, codes_ref = unpack_e2m1(got[0][:valid]), unpack_e2m1(ref[0][:valid])
    g = gs[expert].unsqueeze(1)
    deq_got = E2M1_VALUES[codes_got.long()].reshape(valid, C, 16) * sf_got.unsqueeze(-1) / g.unsqueeze(-1)
    deq_ref = E2M1_VALUES[codes_ref.long()].reshape(valid, C, 16) * sf_ref.unsqueeze(-1) / g.unsqueeze(-1)
    same = (codes_got.reshape(valid, C, 16) == codes_ref.reshape(valid, C, 16)).all(-1) & (sf_got == sf_ref)
    differing = 1.0 - float(same.float().mean()) if valid else 0.0
    assert differing <= max_block_fraction, f"{differing:.3%} of the blocks differ"
    act = stages.silu_mul(h[:valid]).float().reshape(valid, C, 16)
    ulp = act.abs().clamp_min(2.0**-24) * (2.0**-7 if h.dtype == torch.bfloat16 else 2.0**-10)
    bound = ((sf_got + sf_ref) / g).unsqueeze(-1) + ulp
    excess = ((deq_got - deq_ref).abs() - bound).max() if valid else torch.tensor(-1.0)
    assert float(excess) <= 0, f"a differing block exceeds its bound by {float(excess)}"
    return differing


@pytest.mark.parametrize("weights", [True, False], ids=["weighted", "plain-sum"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_moe_reduce_host_oracle_is_exact(lib, weights, out_dtype):
    gen = torch.Generator().manual_seed(5)
    M, topk, E = 7, 3, 5
    _, r = _routed(M, topk, E, gen)
    y = torch.randn(M * topk, 72, generator=gen).to(torch.float16)
    y[int(r.expert_offsets[-1]):] = float("nan")  # never read: only routed slots are summed
    w = torch.rand(M, topk, generator=gen) if weights else None
    ref = stages.moe_reduce(y, r.flat_to_slot, w, M, out_dtype)
    out = torch.full((M, 72), float("nan"), dtype=out_dtype)
    got = cutlass.moe_reduce(y, r.flat_to_slot, w, M, out_dtype, out=out)
    assert got is out and torch.equal(got, ref)


def fused_with_reference_gemm(case: Case, dev: torch.device, monkeypatch) -> float:
    """cutlass.fused_moe with its GEMM stage swapped for stages.grouped_gemm (exact, same buffers) against
    the reference backend; returns the worst row's relative error.

    Every other stage is the library's. The only possible difference is SiLU's exp (libm vs torch's
    exp on CPU; CUDA expf in both on a GPU): an intermediate E2M1 code moved by one step changes an
    output row by far less than 1e-3 of its norm, while a wrong row, scale, section or expert moves
    it by the order of the row itself.
    """
    gen = torch.Generator().manual_seed(7)
    ex = make_experts(case, gen, dev)
    x, w, ids = make_inputs(case, gen, dev)
    monkeypatch.setattr(cutlass, "grouped_gemm", stages.grouped_gemm)
    got = cutlass.fused_moe(MoEProblem(x, ex, w, ids, case.on_input, None))
    ref = fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=case.on_input)
    err = float(((got.float() - ref.float()).norm(dim=1) / ref.float().norm(dim=1).clamp_min(1e-30)).max())
    assert err <= 1e-3, f"worst row relative error {err:.3e}"
    return err


# The shared edge cases whose H and I the CUTLASS GEMM takes (multiples of 32), plus fp16.
CUTLASS_CASES = [c for c in EDGE_CASES if c.h % 32 == 0 and c.i % 32 == 0] + [
    Case(5, 8, 2, 96, 64, dtype=torch.float16, note="fp16; H = 96 is not a multiple of 64"),
]


@pytest.mark.parametrize("case", CUTLASS_CASES, ids=[str(c) for c in CUTLASS_CASES])
def test_fused_moe_on_the_host_oracle(lib, monkeypatch, case):
    """The backend's stage sequence on CPU: host-oracle kernels, stages.routing standing in for the
    GPU routing (whose outputs are compared exactly with it on the GPU) and the exact torch GEMM."""
    monkeypatch.setattr(cutlass, "routing", lambda ids, E: stages.routing(ids, E))
    fused_with_reference_gemm(case, torch.device("cpu"), monkeypatch)


def test_fused_moe_rejects_sizes_the_gemm_cannot_take(lib):
    case = Case(3, 3, 2, 48, 16)
    gen = torch.Generator().manual_seed(0)
    ex = make_experts(case, gen)
    x, w, ids = make_inputs(case, gen)
    with pytest.raises(ValueError, match=r"experts: the CUTLASS grouped GEMM needs .* got H = 48, I = 16; use backend='triton'"):
        cutlass.fused_moe(MoEProblem(x, ex, w, ids, False, None))


def test_inconsistent_offsets_never_write_out_of_bounds(lib):
    """Corrupt offsets (e.g. from validate=False misuse) may give wrong values, never stray writes."""
    x = torch.randn(4, 32).to(torch.bfloat16)
    eo = torch.tensor([0, 100, 4], dtype=torch.int32)  # past the 4 rows, and decreasing
    bso = torch.tensor([0, 4096, 128], dtype=torch.int32)  # past the buffer
    bound = grouped_scale_rows_bound(4, 2)
    guard = 64
    packed = torch.zeros(4 + guard, 16, dtype=torch.uint8)
    scales = torch.zeros(bound + guard, 4, dtype=torch.uint8)
    cutlass.quantize_rows(x, torch.ones(2), eo, bso, out=(packed[:4], scales[:bound]))
    assert not packed[4:].any() and not scales[bound:].any()


# --------------------------------------------------------------------------- the GEMM wiring, evaluated on the host


@pytest.mark.parametrize("rows, k", [(1, 64), (100, 32), (130, 80), (300, 192), (257, 320)])
@pytest.mark.parametrize("operand", [0, 1], ids=["SFA", "SFB"])
def test_gemm_scale_layout_is_the_swizzled_layout(lib, rows, k, operand):
    """CUTLASS's tile_atom_to_shape_SF{A,B} of the compiled GEMMs reads scale (r, c) at format.swizzled_offset."""
    archs = gemm_archs(lib)
    if not archs:
        pytest.skip("this build has no grouped GEMM")
    C = k // 16
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(C), indexing="ij")
    expected = swizzled_offset(r, c, C).flatten()
    for arch in archs:
        got = torch.empty(rows * C, dtype=torch.int64)
        lib.call("moe_fp4_gemm_scale_offsets", arch, operand, rows, k, got.data_ptr())
        assert torch.equal(got, expected), f"sm{arch}: first mismatch at {int((got != expected).nonzero()[0])}"


def _expected_group_args(eo, bso, E, S, N, K, a_rows, a_sf_rows):
    rows = []
    ns, cp = N // S, swizzled_shape(1, K // 16)[1]
    nps = swizzled_shape(ns, 1)[0]
    for e in range(E):
        for h in range(S):
            m = eo[e + 1] - eo[e]
            fits = m > 0 and eo[e] >= 0 and eo[e + 1] <= a_rows and bso[e] >= 0 and bso[e] + -(-m // 128) * 128 <= a_sf_rows
            m = m if fits else 0
            rows.append([m, ns, K, eo[e] * K // 2 if m else 0, (e * N + h * ns) * K // 2, bso[e] * cp if m else 0,
                         (e * S + h) * nps * cp, (eo[e] * N + h * ns) * 2 if m else 0, N])
    return rows


@pytest.mark.parametrize("sections", [1, 2])
def test_gemm_group_arguments(lib, sections):
    """Per-group sizes and offsets of the device setup kernel (same code, run on the host); groups of
    empty experts and of offsets that do not fit the buffers get M = 0 (no tiles)."""
    archs = gemm_archs(lib)
    if not archs:
        pytest.skip("this build has no grouped GEMM")
    counts = [3, 0, 130, 1, 0]
    eo = [0] + torch.tensor(counts).cumsum(0).tolist()
    bso = [0] + torch.tensor([-(-c // 128) * 128 for c in counts]).cumsum(0).tolist()
    E, N, K = len(counts), 96, 160
    a_rows, a_sf_rows = eo[-1], grouped_scale_rows_bound(eo[-1], E)
    for eo_case, bso_case, label in ((eo, bso, "consistent"), (eo[:3] + [999] + eo[4:], bso, "expert 2 past a_rows")):
        expected = _expected_group_args(eo_case, bso_case, E, sections, N, K, a_rows, a_sf_rows)
        eo_t, bso_t = torch.tensor(eo_case, dtype=torch.int32), torch.tensor(bso_case, dtype=torch.int32)
        for arch in archs:
            out = torch.empty(E * sections * 9, dtype=torch.int64)
            lib.call("moe_fp4_gemm_group_args", arch, eo_t.data_ptr(), bso_t.data_ptr(), E, sections, N, K, a_rows,
                     a_sf_rows, out.data_ptr())
            assert out.reshape(-1, 9).tolist() == expected, (arch, label)


@pytest.mark.parametrize("out_dtype", [_native.BF16, _native.FP16], ids=["bf16", "fp16"])
def test_gemm_plan_is_implementable(lib, out_dtype):
    """CUTLASS's can_implement accepts the configuration (host-side), and the workspace grows with the
    groups (per-group arrays) and with the SMs (a tensormap set per persistent CTA)."""
    archs = gemm_archs(lib)
    if not archs:
        pytest.skip("this build has no grouped GEMM")
    for arch in archs:
        size = {key: lib.size_query("moe_fp4_gemm_plan", arch, out_dtype, *key) for key in
                ((128, 1, 148), (128, 2, 148), (1031, 2, 148), (128, 2, 188))}
        assert size[1031, 2, 148] > size[128, 2, 148] > size[128, 1, 148] > 0, (arch, size)
        assert size[128, 2, 188] > size[128, 2, 148], (arch, size)


def test_gemm_hooks_reject_missing_arch(lib):
    with pytest.raises(ValueError, match=r"arch: expected 100 \(SM100\) or 120"):
        lib.call("moe_fp4_gemm_scale_offsets", 90, 0, 4, 64, ctypes.c_void_p(FAKE))
