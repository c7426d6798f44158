"""The CUDA pipeline kernels on a GPU (any from SM90; run on the H200) against the stage references
of moe_fp4.stages and against the Triton backend's stages, on the same buffers.

* routing: exact (all four outputs), one-launch and multi-block paths, prime E, E > 1024, -1 and
  out-of-range ids, empty experts, all ids on one expert;
* quantize_rows: bit-exact, every byte of NaN-poisoned output buffers included (gather, router
  weight on the input, K not a multiple of 64);
* silu_mul_quantize: bit-exact up to SiLU's exp (tolerance in test_native.assert_silu_quantized_close);
* moe_reduce: exact;
* cutlass.fused_moe end to end with the GEMM stage replaced by the exact torch GEMM of stages.py
  (the only stage that cannot run here) against the reference backend;
* CUDA-graph capture of the pipeline stages; backend="cutlass" refused with a clear message on a
  GPU without the NVFP4 GEMM.

One command writes a JSON summary (pass counts, worst errors, timings, GPU, versions, commit)::

    PYTHONPATH=. python tests/test_cuda_pipeline.py OUT_DIR
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from moe_cases import EDGE_CASES, make_experts, make_inputs
from moe_fp4 import BackendUnavailableError, fused_moe, stages
from moe_fp4.backends import cutlass
from moe_fp4.backends.registry import select_backend
from test_native import (
    CUTLASS_CASES,
    ENV_REQUIRE,
    assert_quantized_equal,
    assert_silu_quantized_close,
    fused_with_reference_gemm,
    native_library,
    poisoned_like,
)

pytestmark = pytest.mark.gpu

# Worst value seen of each metric, written to the JSON summary by the runner at the bottom.
WORST: dict[str, float] = {}
TIMINGS: dict[str, float] = {}


def record(name: str, value: float) -> None:
    WORST[name] = max(WORST.get(name, float("-inf")), float(value))


@pytest.fixture(scope="module")
def dev() -> torch.device:
    native_library()
    return torch.device("cuda")


@pytest.fixture(scope="module")
def tri():
    """The Triton backend's stage functions (same names and buffers)."""
    from moe_fp4.backends import triton as triton_backend

    return triton_backend


def _cpu(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.cpu() for t in tensors)


def _invalid_to_minus_one(ids: torch.Tensor, E: int) -> torch.Tensor:
    return torch.where((ids >= 0) & (ids < E), ids, torch.full_like(ids, -1))


def _ids(M: int, topk: int, E: int, pattern: str, gen: torch.Generator) -> torch.Tensor:
    if pattern == "topk_of_E":  # distinct experts per token, as a router gives
        ids = torch.rand(M, E, generator=gen).argsort(dim=1)[:, :topk]
    else:
        ids = torch.randint(0, E, (M, topk), generator=gen)
    ids = ids.to(torch.int32)
    if pattern == "minus_one":
        ids[::3, 0] = -1
    elif pattern == "out_of_range":  # what validate=False may let through: not served, never read
        bad = torch.tensor([E, -2, 2**31 - 1, -(2**31), E + 5], dtype=torch.int32)
        where = torch.arange(1, ids.numel(), 7)
        ids.view(-1)[where] = bad[torch.arange(where.numel()) % bad.numel()]
    elif pattern == "one_expert":
        ids[:, 0] = E - 1
    elif pattern == "skip_even":
        ids = ids | 1  # every even expert is empty
        ids[ids >= E] = E - 1 if (E - 1) % 2 else E - 2
    return ids


ROUTING_CASES = [
    # (M, topk, E, pattern, note)
    (0, 2, 4, "random", "no tokens"),
    (1, 1, 4, "random", "one id"),
    (7, 3, 8, "minus_one", "-1 ids"),
    (5, 5, 5, "topk_of_E", "topk == E"),
    (33, 3, 17, "random", "prime E"),
    (64, 8, 1031, "random", "E > 1024, most experts empty"),
    (9, 4, 2053, "out_of_range", "E > 2048 with out-of-range ids"),
    (100, 6, 40, "one_expert", "every token's first id on one expert"),
    (50, 4, 16, "skip_even", "every even expert empty"),
    (512, 8, 128, "random", "4096 ids: the largest one-launch case"),
    (4097, 1, 128, "random", "4097 ids: the smallest multi-block case"),
    (16384, 8, 128, "topk_of_E", "Qwen3-30B-A3B prefill, 131072 ids"),
    (4096, 8, 1031, "minus_one", "multi-block with E > 1024 and -1 ids"),
    (200_000, 8, 256, "random", "1.6M ids: several tiles per chunk"),
]


@pytest.mark.parametrize("M, topk, E, pattern, note", ROUTING_CASES, ids=[c[4] for c in ROUTING_CASES])
def test_routing_is_exact(dev, tri, M, topk, E, pattern, note):
    gen = torch.Generator().manual_seed(M + E)
    ids = _ids(M, topk, E, pattern, gen).to(dev)
    ref = stages.routing(_invalid_to_minus_one(ids, E), E)
    n = M * topk
    poison = stages.RoutingData(*(torch.full((s,), 0x7F7F7F7F, dtype=torch.int32, device=dev) for s in (E + 1, E + 1, n, n)))
    got = cutlass.routing(ids, E, out=poison)
    for field in ("expert_offsets", "blockscale_offsets", "slot_to_flat", "flat_to_slot"):
        assert torch.equal(getattr(got, field), getattr(ref, field)), field
    if pattern != "out_of_range" and n:  # the Triton stage is specified for ids in [-1, E) and M >= 1
        other = tri.routing(ids, E)
        for field in ("expert_offsets", "blockscale_offsets", "slot_to_flat", "flat_to_slot"):
            assert torch.equal(getattr(other, field), getattr(got, field)), f"triton {field}"


QUANT_CASES = [
    # (M, topk, E, K, dtype, pattern, note)
    (5, 2, 3, 64, torch.bfloat16, "minus_one", "small, -1 ids"),
    (9, 3, 17, 80, torch.float16, "random", "prime E, K % 64 != 0"),
    (40, 4, 5, 48, torch.bfloat16, "one_expert", "an expert over 128 rows, K = 48"),
    (64, 8, 1031, 128, torch.bfloat16, "random", "E > 1024"),
    (50, 4, 16, 96, torch.float16, "skip_even", "empty experts"),
    (4096, 8, 128, 2048, torch.bfloat16, "topk_of_E", "Qwen3-30B-A3B input, 32768 rows"),
    (1, 8, 128, 2048, torch.float16, "topk_of_E", "decode: one token"),
]


@pytest.mark.parametrize("M, topk, E, K, dtype, pattern, note", QUANT_CASES, ids=[c[6] for c in QUANT_CASES])
@pytest.mark.parametrize("on_input", [False, True], ids=["plain", "router-weight"])
def test_quantize_rows_is_bit_exact(dev, tri, M, topk, E, K, dtype, pattern, note, on_input):
    gen = torch.Generator().manual_seed(M * 7 + E)
    ids = _ids(M, topk, E, pattern, gen).to(dev)
    r = stages.routing(ids, E)
    x = (torch.randn(M, K, generator=gen) * 3).to(dtype).to(dev)
    gs = (2688.0 / (0.5 + 8 * torch.rand(E, generator=gen))).to(dev)
    row_scale = torch.rand(M * topk, generator=gen).to(dev) if on_input else None
    args = (x, gs, r.expert_offsets, r.blockscale_offsets, r.slot_to_flat, topk, row_scale)
    ref = stages.quantize_rows(*args)
    got = cutlass.quantize_rows(*args, out=tuple(poisoned_like(t) for t in ref))
    assert_quantized_equal(got, ref)
    assert_quantized_equal(tri.quantize_rows(*args), got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, topk, E, I", [(9, 3, 17, 80), (64, 8, 1031, 64), (2048, 8, 128, 768)],
                         ids=["prime-E-I80", "E-over-1024", "Qwen3-30B-A3B"])
def test_silu_mul_quantize(dev, tri, dtype, M, topk, E, I):
    gen = torch.Generator().manual_seed(M + I)
    r = stages.routing(_ids(M, topk, E, "minus_one", gen).to(dev), E)
    h = (torch.randn(M * topk, 2 * I, generator=gen) * 4).to(dtype).to(dev)
    h[int(r.expert_offsets[-1]):] = float("nan")  # rows past the routed ones are never read
    gs = (2688.0 / (0.5 + torch.rand(E, generator=gen))).to(dev)
    ref = stages.silu_mul_quantize(h, gs, r.expert_offsets, r.blockscale_offsets)
    got = cutlass.silu_mul_quantize(h, gs, r.expert_offsets, r.blockscale_offsets, out=tuple(poisoned_like(t) for t in ref))
    host = (h.cpu(), gs.cpu(), stages.RoutingData(*(getattr(r, f.name).cpu() for f in fields(r))))
    record("silu_mul_quantize_vs_stages_differing_block_fraction",
           assert_silu_quantized_close(_cpu(got), _cpu(ref), *host))
    other = tri.silu_mul_quantize(h, gs, r.expert_offsets, r.blockscale_offsets)
    record("silu_mul_quantize_vs_triton_differing_block_fraction",
           assert_silu_quantized_close(_cpu(got), _cpu(other), *host))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "plain-sum"])
@pytest.mark.parametrize("M, topk, E, H", [(7, 3, 5, 72), (4096, 8, 128, 2048)], ids=["small", "Qwen3-30B-A3B"])
def test_moe_reduce_is_exact(dev, tri, out_dtype, weighted, M, topk, E, H):
    gen = torch.Generator().manual_seed(M + H)
    r = stages.routing(_ids(M, topk, E, "minus_one", gen).to(dev), E)
    y = torch.randn(M * topk, H, generator=gen).to(out_dtype).to(dev)
    y[int(r.expert_offsets[-1]):] = float("nan")
    w = torch.rand(M, topk, generator=gen).to(dev) if weighted else None
    ref = stages.moe_reduce(y, r.flat_to_slot, w, M, out_dtype)
    got = cutlass.moe_reduce(y, r.flat_to_slot, w, M, out_dtype, out=torch.full_like(ref, float("nan")))
    assert torch.equal(got, ref)
    assert torch.equal(tri.moe_reduce(y, r.flat_to_slot, w, M, out_dtype), got)


@pytest.mark.parametrize("case", CUTLASS_CASES, ids=[str(c) for c in CUTLASS_CASES])
def test_fused_moe_with_the_reference_gemm(dev, monkeypatch, case):
    """cutlass.fused_moe on this GPU with every stage but the GEMM (swapped for the exact torch one)."""
    record("fused_moe_reference_gemm_max_row_rel_error", fused_with_reference_gemm(case, dev, monkeypatch))


def test_stages_capture_in_a_cuda_graph(dev):
    """Routing, both quantizers and the reduce replay from a graph: no host sync, no launch-time allocation."""
    gen = torch.Generator().manual_seed(1)
    M, topk, E, H, I = 64, 8, 128, 256, 128
    ids = _ids(M, topk, E, "topk_of_E", gen).to(dev)
    x = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(dev)
    h = torch.randn(M * topk, 2 * I, generator=gen).to(torch.bfloat16).to(dev)
    y = torch.randn(M * topk, H, generator=gen).to(torch.bfloat16).to(dev)
    w = torch.rand(M, topk, generator=gen).to(dev)
    gs = torch.full((E,), 500.0, device=dev)

    def run():
        r = cutlass.routing(ids, E)
        a = cutlass.quantize_rows(x, gs, r.expert_offsets, r.blockscale_offsets, r.slot_to_flat, topk)
        b = cutlass.silu_mul_quantize(h, gs, r.expert_offsets, r.blockscale_offsets)
        out = cutlass.moe_reduce(y, r.flat_to_slot, w, M, torch.bfloat16)
        return (r.slot_to_flat, *a, *b, out)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()  # warm-up (loads the kernels)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = run()
    ids.copy_(_ids(M, topk, E, "minus_one", gen).to(dev))
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, run()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_cutlass_backend_is_refused_clearly_without_a_native_fp4_gemm(dev):
    cap = torch.cuda.get_device_capability(dev)
    if cap[0] in (10, 12):
        pytest.skip("this GPU has an NVFP4 tensor-core path")
    reason = cutlass.availability(dev, cap)
    assert reason.startswith(f"no NVFP4 tensor-core path on sm_{cap[0]}{cap[1]}"), reason
    case = EDGE_CASES[0]
    gen = torch.Generator().manual_seed(0)
    ex = make_experts(case, gen, dev)
    x, w, ids = make_inputs(case, gen, dev)
    with pytest.raises(BackendUnavailableError, match=r"backend='cutlass' cannot run on cuda"):
        fused_moe(x, ex, w, ids, backend="cutlass")
    assert select_backend("auto", dev) == "triton"
    a = torch.zeros(4, 32, dtype=torch.uint8, device=dev)
    a_sf = torch.zeros(256, 4, dtype=torch.float8_e4m3fn, device=dev)
    b = torch.zeros(1, 32, 32, dtype=torch.uint8, device=dev)
    b_sf = torch.zeros(1, 1, 128, 4, dtype=torch.float8_e4m3fn, device=dev)
    offs = torch.tensor([0, 4], dtype=torch.int32, device=dev), torch.tensor([0, 128], dtype=torch.int32, device=dev)
    with pytest.raises(BackendUnavailableError, match=f"device {dev.index or 0}: no NVFP4 tensor-core path on sm_"):
        cutlass.grouped_gemm(a, a_sf, b, b_sf, torch.ones(1, device=dev), *offs, torch.bfloat16)


def test_stage_timings_qwen3_30b_a3b(dev):
    """Informational: median GPU time of each stage at the Qwen3-30B-A3B layer shape (E=128, top-8, H=2048, I=768)."""
    E, topk, H, I = 128, 8, 2048, 768
    for M in (16, 4096):
        gen = torch.Generator().manual_seed(M)
        ids = _ids(M, topk, E, "topk_of_E", gen).to(dev)
        x = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(dev)
        h = torch.randn(M * topk, 2 * I, generator=gen).to(torch.bfloat16).to(dev)
        y = torch.randn(M * topk, H, generator=gen).to(torch.bfloat16).to(dev)
        w = torch.rand(M, topk, generator=gen).to(dev)
        gs = torch.full((E,), 500.0, device=dev)
        r = cutlass.routing(ids, E)
        stages_to_time = {
            "routing": lambda: cutlass.routing(ids, E),
            "quantize_rows": lambda: cutlass.quantize_rows(x, gs, r.expert_offsets, r.blockscale_offsets, r.slot_to_flat, topk),
            "silu_mul_quantize": lambda: cutlass.silu_mul_quantize(h, gs, r.expert_offsets, r.blockscale_offsets),
            "moe_reduce": lambda: cutlass.moe_reduce(y, r.flat_to_slot, w, M, torch.bfloat16),
        }
        for name, fn in stages_to_time.items():
            times = []
            for i in range(23):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                if i >= 3:
                    times.append(start.elapsed_time(end) * 1e3)
            TIMINGS[f"{name}_M{M}_us"] = round(sorted(times)[len(times) // 2], 1)


# --------------------------------------------------------------------------- the one command for the lead


def _git_commit(root: Path) -> str:
    """The checked-out commit, with "-dirty" when tracked files differ from it."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"], cwd=root,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: PYTHONPATH=. python tests/test_cuda_pipeline.py OUT_DIR", file=sys.stderr)
        return 2
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(ENV_REQUIRE, "1")  # a missing library fails the run instead of skipping it
    started = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        status = pytest.main([__file__, "-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={junit}"])
        suite = ET.parse(junit).getroot().find("testsuite")
    cases = suite.findall("testcase")
    failures = [
        {"test": f"{c.get('classname')}::{c.get('name')}", "message": (bad.get("message") or "")[:2000]}
        for c in cases for bad in c if bad.tag in ("failure", "error")
    ]
    tested = sys.modules.get("test_cuda_pipeline")  # the copy pytest imported holds the records
    report = {
        "what": "moe_fp4 CUDA pipeline kernels (tests/test_cuda_pipeline.py) vs moe_fp4.stages and the Triton stages",
        "date_utc": started.isoformat(timespec="seconds"),
        "git_commit": _git_commit(Path(__file__).resolve().parent.parent),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "capability": list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "library": cutlass.library_summary(),
        "pytest_exit_status": int(status),
        "counts": {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")},
        "failures": failures,
        "worst": tested.WORST if tested else {},
        "timings_us": tested.TIMINGS if tested else {},
    }
    path = out_dir / "cuda_pipeline_gpu_report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}: {report['counts']}")
    return int(status)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
