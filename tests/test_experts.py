"""NvFp4Experts: construction checks, quantize(), per-half global scales, alphas."""

from __future__ import annotations

import pytest
import torch

from moe_fp4 import NvFp4Experts, dequantize_nvfp4, quantize_nvfp4

E, H, I = 3, 64, 32


@pytest.fixture(scope="module")
def experts() -> NvFp4Experts:
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 15).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / 15).bfloat16()
    return NvFp4Experts.quantize(w13, w2, a13_gs=100.0, a2_gs=torch.tensor([1.0, 2.0, 3.0]))


def _fields(ex: NvFp4Experts) -> dict:
    return {k: getattr(ex, k) for k in ("w13", "w13_scale", "w13_gs", "w2", "w2_scale", "w2_gs", "a13_gs", "a2_gs")}


def test_shapes_and_quantize_matches_format_core(experts):
    ex = experts
    assert (ex.num_experts, ex.hidden_size, ex.intermediate_size) == (E, H, I)
    assert ex.w13.shape == (E, 2 * I, H // 2) and ex.w13_scale.shape == (E, 2 * I, H // 16)
    assert ex.w2.shape == (E, H, I // 2) and ex.w2_scale.shape == (E, H, I // 16)
    assert ex.w13_gs.shape == (E,) and ex.a2_gs.tolist() == [1.0, 2.0, 3.0]
    assert ex.a13_gs.tolist() == [100.0] * E
    # gate and up share one scale per expert by default, from their joint amax
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 15).bfloat16()
    torch.testing.assert_close(ex.w13_gs, 2688.0 / w13.float().abs().amax(dim=(1, 2)))
    q, s = quantize_nvfp4(w13, ex.w13_gs)
    assert torch.equal(q, ex.w13) and torch.equal(s.view(torch.uint8), ex.w13_scale.view(torch.uint8))


def test_separate_gate_up_scales_are_exact():
    g = torch.Generator().manual_seed(1)
    w13 = torch.randn(E, 2 * I, H, generator=g) / 15
    w13[:, I:] *= 4
    w2 = torch.randn(E, H, I, generator=g) / 15
    ex = NvFp4Experts.quantize(w13, w2, a13_gs=1.0, a2_gs=1.0, separate_gate_up_scales=True)
    assert ex.w13_gs.shape == (E, 2) and ex.gate_up_scales_differ
    torch.testing.assert_close(ex.w13_gs[:, 1], 2688.0 / w13[:, I:].abs().amax(dim=(1, 2)))
    d13, _ = ex.dequantize()
    # each half dequantizes with its own scale: both halves have NVFP4-level error (~10%);
    # applying the gate's scale to up would be off by 4x
    for half in (slice(0, I), slice(I, 2 * I)):
        rel = float((d13[:, half] - w13[:, half]).norm() / w13[:, half].norm())
        assert rel < 0.13, rel
    alpha13, alpha2 = ex.alphas()
    torch.testing.assert_close(alpha13, 1.0 / (ex.a13_gs[:, None] * ex.w13_gs), rtol=0, atol=0)
    torch.testing.assert_close(alpha2, 1.0 / (ex.a2_gs * ex.w2_gs), rtol=0, atol=0)


def test_dequantize_matches_format_core(experts):
    d13, d2 = experts.dequantize()
    torch.testing.assert_close(d2, dequantize_nvfp4(experts.w2, experts.w2_scale, experts.w2_gs), rtol=0, atol=0)
    torch.testing.assert_close(d13, dequantize_nvfp4(experts.w13, experts.w13_scale, experts.w13_gs), rtol=0, atol=0)


def test_prepared_cache_builds_once(experts):
    calls = []
    build = lambda ex: calls.append(1) or ("layout", ex.num_experts)  # noqa: E731
    assert experts.prepared(("test", 1), build) == ("layout", E)
    assert experts.prepared(("test", 1), build) == ("layout", E)
    assert len(calls) == 1


def test_prepared_cache_builds_once_across_threads(experts):
    """Eight threads asking for a layout at once: one build, one shared result (a forward on another
    thread must not run its own build, or use one that is still being written)."""
    import threading
    import time

    builds = []

    def build(ex):
        builds.append(1)
        time.sleep(0.05)  # every other thread arrives while this build runs
        return object()

    got = []
    threads = [threading.Thread(target=lambda: got.append(experts.prepared("threads", build))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(got) == 8 and len({id(g) for g in got}) == 1


BAD = [
    ("w13", lambda f: f["w13"].to(torch.int8), TypeError, "w13: expected dtype uint8, got int8"),
    ("w13", lambda f: f["w13"][:, :-1].contiguous(), ValueError, "w13: expected an even number of rows"),
    ("w13", lambda f: f["w13"][:, :, :4].contiguous(), ValueError,
     "w13: the hidden size H .2 . w13.shape.2.. must be a multiple of 16, got 8"),
    ("w13_scale", lambda f: f["w13_scale"].view(torch.uint8), TypeError,
     "w13_scale: expected dtype float8_e4m3fn, got uint8"),
    ("w13_scale", lambda f: f["w13_scale"][:, :, :2].contiguous(), ValueError,
     r"w13_scale: expected shape \[3, 64, 4\]"),
    ("w13_gs", lambda f: f["w13_gs"][:2], ValueError, r"w13_gs: expected shape \[3\] or \[3, 2\]"),
    ("w13_gs", lambda f: f["w13_gs"].double(), TypeError, "w13_gs: expected dtype float32"),
    ("w13_gs", lambda f: -f["w13_gs"], ValueError, "w13_gs: expected finite positive"),
    ("w2", lambda f: f["w2"][:, :-2].contiguous(), ValueError, r"w2: expected shape \[3, 64, 16\]"),
    ("w2_scale", lambda f: torch.full_like(f["w2_scale"].view(torch.uint8), 0x7F).view(torch.float8_e4m3fn),
     ValueError, "w2_scale: expected finite float8_e4m3fn block scales, got NaN"),
    ("w2_scale", lambda f: torch.full_like(f["w2_scale"].view(torch.uint8), 0xB8).view(torch.float8_e4m3fn),
     ValueError, "w2_scale: expected non-negative block scales"),
    ("w2_gs", lambda f: torch.full_like(f["w2_gs"], float("inf")), ValueError, "w2_gs: expected finite positive"),
    ("a13_gs", lambda f: f["a13_gs"].reshape(3, 1), ValueError, r"a13_gs: expected shape \[3\]"),
    ("a2_gs", lambda f: torch.zeros_like(f["a2_gs"]), ValueError, "a2_gs: expected finite positive"),
    ("a2_gs", lambda f: f["a2_gs"].to("meta"), ValueError, "a2_gs: expected a tensor on cpu, got one on meta"),
    ("w2", lambda f: f["w2"].transpose(1, 2), ValueError, "w2: expected shape"),
    ("w13", lambda f: torch.cat([f["w13"], f["w13"]], 2)[:, :, ::2], ValueError, "w13: expected a contiguous tensor"),
]


@pytest.mark.parametrize("name,mutate,exc,pattern", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_construction_rejects_bad_tensors(experts, name, mutate, exc, pattern):
    f = _fields(experts)
    f[name] = mutate(f)
    with pytest.raises(exc, match=pattern):
        NvFp4Experts(**f)


def test_quantize_rejects_bad_weights():
    with pytest.raises(ValueError, match=r"w2: expected shape \[2, 32, 16\]"):
        NvFp4Experts.quantize(torch.zeros(2, 32, 32), torch.zeros(2, 32, 8), a13_gs=1.0, a2_gs=1.0)
    with pytest.raises(TypeError, match="w13: expected dtype"):
        NvFp4Experts.quantize(torch.zeros(2, 32, 32, dtype=torch.int32), torch.zeros(2, 32, 16), a13_gs=1.0, a2_gs=1.0)
    with pytest.raises(ValueError, match=r"a13_gs: expected shape \[2\]"):
        NvFp4Experts.quantize(torch.ones(2, 32, 32), torch.ones(2, 32, 16), a13_gs=torch.ones(3), a2_gs=1.0)
    nan = torch.ones(2, 32, 32)
    nan[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="w13: expected finite weights"):
        NvFp4Experts.quantize(nan, torch.ones(2, 32, 16), a13_gs=1.0, a2_gs=1.0)
