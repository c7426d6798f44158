"""The MoE at a token count whose intermediates pass 2^31 elements, and a size that cannot be served.

A DeepSeek-V3-like layer (E = 256, top-8, H = 7168, I = 2048; random NVFP4 experts made on the
GPU as the benchmark makes them) at M = 40000 tokens: 320000 slots, so the GEMM2 output ``y`` and
the sm_90a path's activation values (``[slots, H]`` 16-bit) hold 2.29e9 elements (4.59e9 bytes),
and the GEMM1 output ``h`` (``[slots, 2I]``) 2.62e9 bytes. An index or offset computed in 32 bits
wraps there: int32 element indices at element 2^31, int32 byte offsets at byte 2^31, uint32 byte
offsets at byte 2^32. The token rows whose slots straddle (or sit next to) each such boundary of
each intermediate, the first and the last token and a few between are held, each on its own, to
the grid tests' bounds against the exact W4A4 forward (``moe_fp4.reference.exact_moe``, which
computes every token independently of the others); the whole output is held to them as a whole.

GPU memory (H200: 139 GiB; no test passes ~46 GB): the experts 6.3 GB (NVFP4 codes and scales)
and, once cutlass has run, their sm_90a layout another 6.3 GB; x, the output and the reference
0.57 GB each; the exact reference of all tokens, made once before any backend runs, ~8 GB while
it runs (its [M, topk, H] 16-bit expert outputs 4.6 GB, float32 sums 2.3 GB); the workspace of the
2^19-slot bucket, 10.3 GB for triton (``h``/``y`` 7.5 GB, NVFP4 activations 2.7 GB) and 19.9 GB for
cutlass (its 16-bit activation values 9.7 GB more), dropped after each test; the float64
comparison of the whole output, up to 11 GB while it runs. Peak: cutlass, ~46 GB. The refusal test
holds 17 GiB of inputs and caps the process's allocations at 60 GB while it runs.

The GPU tests are ``gpu`` and ``slow`` (a few seconds of GPU time, ~20 s with the reference; cutlass
on 9.x); the choice of the checked rows is checked on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from moe_cases import GPU_BACKENDS, gpu_experts
from test_triton_moe import MAX_TOL, RMS_TOL

from moe_fp4 import fused_moe, pipeline
from moe_fp4.bench.shapes import MODELS
from moe_fp4.bench.workload import random_experts
from moe_fp4.reference import exact_moe
from moe_fp4.testing import errors

SHAPE = MODELS["deepseek-v3"]
M = 40_000


def wrap_points(rows: int, width: int, itemsize: int) -> list[tuple[int, str]]:
    """``(element offset, what)`` of the 32-bit wrap points inside a ``[rows, width]`` buffer of
    ``itemsize``-byte elements: element 2^31, byte 2^31 and byte 2^32, those below its end."""
    points = [(2**31, "element 2^31"), (2**31 // itemsize, "byte 2^31"), (2**32 // itemsize, "byte 2^32")]
    return [(p, what) for p, what in points if p < rows * width]


def rows_at_wraps(rows: int, buffers: dict[str, tuple[int, int]]) -> dict[int, str]:
    """Row -> why, for the row holding each wrap point of each ``name: (width, itemsize)`` buffer and its
    two neighbours (a row that straddles the point, or the last and first rows on either side)."""
    why: dict[int, list[str]] = {}
    for name, (width, itemsize) in buffers.items():
        for point, what in wrap_points(rows, width, itemsize):
            r = point // width
            for row in (r - 1, r, r + 1):
                if 0 <= row < rows:
                    why.setdefault(row, []).append(f"{name} {what} in row {r}")
    return {row: ", ".join(reasons) for row, reasons in why.items()}


def checked_tokens(ids: torch.Tensor, hidden: int, inter: int) -> dict[int, str]:
    """Token -> why it is checked: the tokens of the slots at the wrap points of the per-slot intermediates,
    the tokens at those of the per-token buffers, the first and last token and a spread between (16 or so).

    Slot ``s`` (the routing contract of moe_fp4.pipeline: grouped by expert, ascending flat index
    ``t * topk + j`` within an expert) belongs to token ``order[s] // topk``, ``order`` the stable sort
    of the flat ids by expert; token t's output row sums the GEMM2 rows of its slots.
    """
    m, topk = ids.shape
    slot_buffers = {
        "a1 codes [n, H/2]": (hidden // 2, 1), "a1 values [n, H]": (hidden, 2), "h [n, 2I]": (2 * inter, 2),
        "a2 codes [n, I/2]": (inter // 2, 1), "a2 values [n, I]": (inter, 2), "y [n, H]": (hidden, 2),
    }
    order = torch.sort(ids.flatten().long(), stable=True).indices.cpu()
    n = order.numel()
    why = {int(order[s]) // topk: f"slot {s}: {reason}" for s, reason in rows_at_wraps(n, slot_buffers).items()}
    for t, reason in rows_at_wraps(m, {"x, out [M, H]": (hidden, 2)}).items():
        why.setdefault(t, reason)
    why.setdefault(int(order[0]) // topk, "the first slot")
    why.setdefault(int(order[-1]) // topk, "the last slot")
    for t in torch.linspace(0, m - 1, max(2, 16 - len(why))).round().long().tolist():
        why.setdefault(int(t), "spread")
    return dict(sorted(why.items()))


@pytest.fixture(scope="module")
def layer():
    """(experts, x, topk weights, int32 ids, the exact W4A4 output of every token)."""
    dev = torch.device("cuda")
    ex = random_experts(SHAPE, dev, seed=7)
    gen = torch.Generator(device=dev).manual_seed(11)
    x = torch.randn((M, SHAPE.H), generator=gen, device=dev).to(torch.bfloat16)
    w, ids = torch.softmax(torch.randn((M, SHAPE.E), generator=gen, device=dev), dim=-1).topk(SHAPE.topk, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).contiguous()
    ids = ids.to(torch.int32).contiguous()
    ref = exact_moe(x, ex, w, ids)
    torch.cuda.empty_cache()
    return ex, x, w, ids, ref


@pytest.fixture(autouse=True)
def drop_new_workspaces():
    """Free the workspaces a test made: the cache keeps them for CUDA graphs (none is captured here), and
    the two backends' 10 and 20 GB need not add up. (If the cache is reorganized and this finds no
    ``pipeline._WORKSPACES``, nothing is freed and the file peaks ~10 GB higher, still under 60 GB.)"""
    cache = getattr(pipeline, "_WORKSPACES", None)
    before = set(cache) if isinstance(cache, dict) else set()
    yield
    if isinstance(cache, dict):
        for key in [k for k in cache if k not in before]:
            del cache[key]
    torch.cuda.empty_cache()


def test_the_checked_tokens_cover_the_wrap_points():
    """The premise: at this M the intermediates do pass 2^31 elements, and the chosen slots straddle it."""
    n = M * SHAPE.topk
    assert n * max(SHAPE.H, 2 * SHAPE.I) > 2**31
    y_rows = rows_at_wraps(n, {"y": (SHAPE.H, 2)})
    straddling = 2**31 // SHAPE.H
    assert straddling * SHAPE.H < 2**31 < (straddling + 1) * SHAPE.H and straddling in y_rows
    assert wrap_points(M, SHAPE.H, 2) == []  # x and the output stay below 2^31 bytes at M = 40000


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_rows_past_2_31_elements_equal_the_exact_forward(layer, backend):
    ex, x, w, ids, ref = layer
    out = torch.full_like(x, float("nan"))
    got = fused_moe(x, ex, w, ids, backend=backend, out=out)
    assert got is out
    assert bool(torch.isfinite(got).all()), "unwritten (NaN) or non-finite output rows"
    # Each checked token on its own, as the grid's M = 1 cases hold a single token (tests/test_triton_moe.py:
    # same products, another float32 summation order; RMS relative 1e-2, max 0.1 of the row's largest).
    bad = []
    for t, why in checked_tokens(ids, SHAPE.H, SHAPE.I).items():
        rms, mx = errors(got[t], ref[t])
        if not (rms <= RMS_TOL and mx <= MAX_TOL):
            bad.append(f"token {t} ({why}): rms {rms:.3g}, max {mx:.3g}")
    assert not bad, "; ".join(bad)
    rms, mx = errors(got, ref)  # and every token, as the grid tests hold a whole output
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)


# --------------------------------------------------------------------------- a size that cannot be served


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_2_31_slots_are_refused_before_any_allocation(backend):
    """M * topk = 2^31 slots (every one of 2^23 tokens routed to all 256 experts): expert_offsets[E] would
    be 2^31, past the int32 offsets and slot indices of the routing buffers (the library's check_slots
    takes at most 2^31 - 1 slots, and fewer grouped scale rows). The call must raise ValueError saying so
    before it allocates a workspace (which would take over 100 GB here) or launches a kernel.

    Inputs: ids and weights 8 GiB each, x 1 GiB (H = I = 64). Allocations are capped at 60 GB meanwhile,
    so that an implementation without the check fails with an out-of-memory error instead of taking
    the GPU. validate=False: the value checks (which would allocate 8 GiB) are not what is tested.
    """
    e = topk = 256
    m = 2**31 // topk
    ex = gpu_experts(e, 64, 64, torch.bfloat16, False, seed=5)
    x = torch.zeros(m, 64, dtype=torch.bfloat16, device="cuda")
    ids = torch.arange(topk, dtype=torch.int32, device="cuda").repeat(m, 1)
    w = torch.full((m, topk), 1.0 / topk, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_per_process_memory_fraction(min(1.0, 60e9 / torch.cuda.get_device_properties(0).total_memory))
    try:
        with pytest.raises(ValueError, match=r"2\^31|2147483648|slots"):
            fused_moe(x, ex, w, ids, backend=backend, validate=False)
    except torch.OutOfMemoryError as exc:
        pytest.fail(f"{backend}: M * topk = 2^31 slots ran out of memory instead of being refused: {exc}")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 2**30, f"{backend}: {extra / 2**30:.1f} GiB allocated before the refusal"
