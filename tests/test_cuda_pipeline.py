"""The CUDA pipeline kernels on a GPU (any from SM90; run on the H200) against the stage references
of moe_fp4.stages and against the Triton backend's stages, on the same buffers.

* routing: exact (all four outputs), its three paths (one block; one block per tile, each counting
  every id; three launches) at their bounds, prime E, E > 1024, -1 and out-of-range ids, empty
  experts, all ids on one expert;
* quantize_rows: bit-exact, every byte of NaN-poisoned output buffers included (gather, router
  weight on the input, K not a multiple of 64);
* silu_mul_quantize: bit-exact up to SiLU's exp (tolerance in test_native.assert_silu_quantized_close);
* moe_reduce: exact;
* the MoE on the cutlass stage set with its GEMM swapped for the exact torch GEMM of stages.py
  (the only stage that cannot run here; ``dataclasses.replace`` of the StageSet, run in a
  poisoned workspace) against the reference backend;
* CUDA-graph capture of the pipeline stages; backend="cutlass" refused with a clear message on a
  GPU without the NVFP4 GEMM.

One command writes a JSON summary (pass counts, worst errors, timings, GPU, versions, commit)::

    PYTHONPATH=. python tests/test_cuda_pipeline.py OUT_DIR
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from moe_cases import EDGE_CASES, make_experts, make_inputs
from test_native import (
    CUTLASS_CASES,
    ENV_REQUIRE,
    assert_silu_quantized_close,
    assert_stage_exact,
    cutlass_with_reference,
    fused_against_reference,
    native_library,
    routing_of,
    zero_gemm_operands,
)

from moe_fp4 import fused_moe, stages
from moe_fp4.backends import cutlass
from moe_fp4.backends.registry import select_backend
from moe_fp4.buffers import RoutingData
from moe_fp4.errors import BackendUnavailableError
from moe_fp4.testing import assert_same_buffers, poisoned_like, routed_ids, served_ids

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
    """The Triton backend's stage set (same stages, same buffers)."""
    from moe_fp4.backends import triton as triton_backend

    return triton_backend.STAGES


def tensors(*bufs) -> list[torch.Tensor]:
    """The tensors of ``bufs`` (tensors or buffer dataclasses), in field order."""
    fields = [[b] if isinstance(b, torch.Tensor) else [getattr(b, f.name) for f in dataclasses.fields(b)] for b in bufs]
    return [t for ts in fields for t in ts if t is not None]  # a Quantized without values has None there


def to_cpu(buf):
    """A copy of ``buf`` (a tensor or buffer dataclass) on the host."""
    if isinstance(buf, torch.Tensor):
        return buf.cpu()
    tensors = [f.name for f in dataclasses.fields(buf) if getattr(buf, f.name) is not None]
    return dataclasses.replace(buf, **{name: getattr(buf, name).cpu() for name in tensors})


def case_ids(M: int, topk: int, E: int, pattern: str, gen: torch.Generator) -> torch.Tensor:
    """int32 ``[M, topk]`` ids: a :func:`moe_fp4.testing.routed_ids` pattern, or one of three it has no name for."""
    if pattern == "duplicates":  # an id repeated within a token (no router gives it; routing must not care)
        return torch.randint(0, E, (M, topk), generator=gen, dtype=torch.int32)
    if pattern == "odd_experts":  # every even expert empty
        return routed_ids(M, topk, E // 2, gen) * 2 + 1
    if pattern == "extreme_ids":  # what validate=False may let through, E and the ends of int32: never read
        ids = routed_ids(M, topk, E, gen, "out_of_range")
        bad = torch.tensor([E, -2, 2**31 - 1, -(2**31)], dtype=torch.int32)
        where = torch.arange(2, ids.numel(), 5)
        ids.view(-1)[where] = bad[torch.arange(where.numel()) % bad.numel()]
        return ids
    return routed_ids(M, topk, E, gen, pattern)


ROUTING_CASES = [
    # (M, topk, E, pattern, note)
    (0, 2, 4, "random", "no tokens"),
    (1, 1, 4, "random", "one id"),
    (7, 3, 8, "minus_one", "-1 ids"),
    (5, 5, 5, "random", "topk == E"),
    (33, 3, 17, "duplicates", "prime E, ids repeated within a token"),
    (64, 8, 1031, "random", "E > 1024, most experts empty"),
    (9, 4, 2053, "extreme_ids", "E > 2048 with out-of-range ids"),
    (100, 6, 40, "one_expert", "one expert in every token"),
    (50, 4, 16, "odd_experts", "every even expert empty"),
    (32, 8, 128, "skewed", "256 ids: the largest one-block case for E + 1 <= 2048 keys"),
    (257, 1, 128, "random", "257 ids: the smallest one-block-per-tile case, a tile of one id"),
    (128, 8, 128, "skewed", "1024 ids: four tiles"),
    (512, 8, 128, "skewed", "4096 ids: 16 tiles"),
    (100, 5, 64, "extreme_ids", "500 ids, out-of-range ids, one block per tile"),
    (700, 6, 33, "duplicates", "4200 ids, ids repeated within a token, one block per tile"),
    (300, 7, 2047, "minus_one", "E + 1 = 2048 keys: the largest E of one block per tile"),
    (300, 7, 2048, "minus_one", "E + 1 = 2049 keys: three launches"),
    (100, 8, 3000, "random", "E + 1 > 2048 keys, 800 ids: one block over four tiles"),
    (128, 8, 2048, "minus_one", "E + 1 > 2048 keys, 1024 ids: the largest one-block case there"),
    (1025, 1, 2048, "random", "E + 1 > 2048 keys, 1025 ids: three launches"),
    (40, 8, 5000, "skewed", "E + 1 > 4096 keys, 320 ids: one block over two tiles, counters in the workspace"),
    (2048, 8, 128, "one_expert", "16384 ids: the largest one-block-per-tile case"),
    (4352, 1, 16, "random", "E = 16, 4352 ids: the largest one-block-per-tile case for 17 keys (256 per key)"),
    (4353, 1, 16, "skewed", "E = 16, 4353 ids: three launches (past 256 ids per key)"),
    (16385, 1, 128, "random", "16385 ids: the smallest three-launch case"),
    (3, 2, 5000, "random", "E >= 4096: the one-block counters in the workspace, not in shared memory"),
    (16384, 8, 128, "random", "Qwen3-30B-A3B prefill, 131072 ids"),
    (4096, 8, 1031, "minus_one", "three launches with E > 1024 and -1 ids"),
    (200_000, 8, 256, "duplicates", "1.6M ids: several tiles per chunk"),
]


@pytest.mark.parametrize("M, topk, E, pattern, note", ROUTING_CASES, ids=[c[4] for c in ROUTING_CASES])
def test_routing_is_exact(dev, tri, M, topk, E, pattern, note):
    gen = torch.Generator().manual_seed(11)
    ids = case_ids(M, topk, E, pattern, gen).to(dev)
    ref = stages.routing(served_ids(ids, E), E)
    # Not testing.poison: its 0xFF bytes are -1, a value slot_to_flat and flat_to_slot legitimately hold.
    out = RoutingData.empty(M * topk, E, dev)
    for t in tensors(out):
        t.fill_(0x7F7F7F7F)
    got = cutlass.routing(ids, E, out=out)
    assert got is out
    assert_same_buffers(got, ref, what="routing")
    if pattern != "extreme_ids" and M:  # the Triton stage is specified for ids in [-1, E) and M >= 1
        assert_same_buffers(tri.routing(ids, E), got, what="triton routing")


QUANT_CASES = [
    # (M, topk, E, K, dtype, pattern, note)
    (5, 2, 3, 64, torch.bfloat16, "minus_one", "small, -1 ids"),
    (9, 3, 17, 80, torch.float16, "duplicates", "prime E, K % 64 != 0"),
    (140, 4, 5, 48, torch.bfloat16, "one_expert", "an expert over 128 rows, K = 48"),
    (64, 8, 1031, 128, torch.bfloat16, "random", "E > 1024"),
    (50, 4, 16, 96, torch.float16, "odd_experts", "empty experts"),
    (4096, 8, 128, 2048, torch.bfloat16, "random", "Qwen3-30B-A3B input, 32768 rows"),
    (1, 8, 128, 2048, torch.float16, "random", "decode: one token"),
]


@pytest.mark.parametrize("M, topk, E, K, dtype, pattern, note", QUANT_CASES, ids=[c[6] for c in QUANT_CASES])
@pytest.mark.parametrize("on_input", [False, True], ids=["plain", "router-weight"])
def test_quantize_rows_is_bit_exact(dev, tri, M, topk, E, K, dtype, pattern, note, on_input):
    gen = torch.Generator().manual_seed(12)
    r = stages.routing(case_ids(M, topk, E, pattern, gen).to(dev), E)
    x = (torch.randn(M, K, generator=gen) * 3).to(dtype).to(dev)
    gs = (2688.0 / (0.5 + 8 * torch.rand(E, generator=gen))).to(dev)
    row_scale = torch.rand(M * topk, generator=gen).to(dev) if on_input else None
    got = assert_stage_exact("quantize_rows", x, gs, r, row_scale=row_scale)
    assert_same_buffers(tri.quantize_rows(x, gs, r, row_scale=row_scale), got, what="triton quantize_rows")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, topk, E, I", [(9, 3, 17, 80), (64, 8, 1031, 64), (2048, 8, 128, 768)],
                         ids=["prime-E-I80", "E-over-1024", "Qwen3-30B-A3B"])
def test_silu_mul_quantize(dev, tri, dtype, M, topk, E, I):
    gen = torch.Generator().manual_seed(13)
    r = stages.routing(case_ids(M, topk, E, "minus_one", gen).to(dev), E)
    h = (torch.randn(M * topk, 2 * I, generator=gen) * 4).to(dtype).to(dev)
    h[int(r.expert_offsets[-1]):] = float("nan")  # rows past the routed ones are never read
    gs = (2688.0 / (0.5 + torch.rand(E, generator=gen))).to(dev)
    ref = stages.silu_mul_quantize(h, gs, r)
    out = poisoned_like(ref)
    got = cutlass.silu_mul_quantize(h, gs, r, out=out)
    assert got is out
    host = (to_cpu(h), to_cpu(gs), to_cpu(r))
    record("silu_mul_quantize_vs_stages_differing_block_fraction",
           assert_silu_quantized_close(to_cpu(got), to_cpu(ref), *host))
    other = tri.silu_mul_quantize(h, gs, r)
    record("silu_mul_quantize_vs_triton_differing_block_fraction",
           assert_silu_quantized_close(to_cpu(got), to_cpu(other), *host))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "plain-sum"])
@pytest.mark.parametrize("M, topk, E, H", [(7, 3, 5, 72), (4096, 8, 128, 2048)], ids=["small", "Qwen3-30B-A3B"])
def test_moe_reduce_is_exact(dev, tri, out_dtype, weighted, M, topk, E, H):
    gen = torch.Generator().manual_seed(14)
    r = stages.routing(case_ids(M, topk, E, "minus_one", gen).to(dev), E)
    y = torch.randn(M * topk, H, generator=gen).to(out_dtype).to(dev)
    y[int(r.expert_offsets[-1]):] = float("nan")
    w = torch.rand(M, topk, generator=gen).to(dev) if weighted else None
    got = assert_stage_exact("moe_reduce", y, r, w, M, out_dtype)
    assert_same_buffers(tri.moe_reduce(y, r, w, M, out_dtype), got, what="triton moe_reduce")


@pytest.mark.parametrize("case", CUTLASS_CASES, ids=[str(c) for c in CUTLASS_CASES])
def test_fused_moe_with_the_reference_gemm(dev, case):
    """The cutlass stages on this GPU, routing included, with the GEMM swapped for the exact torch one."""
    record("fused_moe_reference_gemm_max_row_rel_error",
           fused_against_reference(cutlass_with_reference("grouped_gemm"), case, dev))


def test_stages_capture_in_a_cuda_graph(dev):
    """Routing, both quantizers and the reduce replay from a graph: no host sync, no launch-time allocation."""
    gen = torch.Generator().manual_seed(15)
    M, topk, E, H, I = 64, 8, 128, 256, 128
    ids = case_ids(M, topk, E, "random", gen).to(dev)
    x = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(dev)
    h = torch.randn(M * topk, 2 * I, generator=gen).to(torch.bfloat16).to(dev)
    y = torch.randn(M * topk, H, generator=gen).to(torch.bfloat16).to(dev)
    w = torch.rand(M, topk, generator=gen).to(dev)
    gs = torch.full((E,), 500.0, device=dev)

    def run() -> list[torch.Tensor]:
        r = cutlass.routing(ids, E)
        a = cutlass.quantize_rows(x, gs, r)
        b = cutlass.silu_mul_quantize(h, gs, r)
        return tensors(r, a, b, cutlass.moe_reduce(y, r, w, M, torch.bfloat16))

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()  # warm-up (loads the kernels)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = run()
    ids.copy_(case_ids(M, topk, E, "minus_one", gen).to(dev))
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert_same_buffers(captured, run(), what="replayed")


def test_the_fp4_gemm_is_refused_clearly_where_it_cannot_run(dev):
    """On Hopper the FP4 x FP4 (Blackwell) GEMM stage refuses and names the sm_90a GEMM; the backend
    itself runs there (with ``STAGES_SM90``, tests/test_cutlass_sm90.py); below sm_90 it is unavailable."""
    cap = torch.cuda.get_device_capability(dev)
    if cap[0] in (10, 12):
        pytest.skip("this GPU has an NVFP4 tensor-core path")
    a, w = zero_gemm_operands(dev)
    if cap[0] == 9:
        assert cutlass.why_unavailable(dev, cap) is None
        assert cutlass.stages_for(dev) is cutlass.STAGES_SM90
        with pytest.raises(BackendUnavailableError, match=r"needs SM100 or SM120/SM121; on sm_90 use "
                                                          r"moe_fp4_sm90_grouped_gemm"):
            cutlass.grouped_gemm(a, w, routing_of([4], dev), torch.bfloat16)
        return
    reason = cutlass.why_unavailable(dev, cap)
    assert reason.startswith(f"no NVFP4 GEMM path on sm_{cap[0]}{cap[1]}"), reason
    case = EDGE_CASES[0]
    gen = torch.Generator().manual_seed(16)
    ex = make_experts(case, gen, dev)
    x, weights, ids = make_inputs(case, gen, dev)
    with pytest.raises(BackendUnavailableError, match=r"backend='cutlass' cannot run on cuda"):
        fused_moe(x, ex, weights, ids, backend="cutlass")
    assert select_backend("auto", dev) == "triton"


def test_stage_timings_qwen3_30b_a3b(dev):
    """Informational: median GPU time of each stage at the Qwen3-30B-A3B layer shape (E=128, top-8, H=2048, I=768)."""
    E, topk, H, I = 128, 8, 2048, 768
    for M in (16, 4096):
        gen = torch.Generator().manual_seed(17)
        ids = case_ids(M, topk, E, "random", gen).to(dev)
        x = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(dev)
        h = torch.randn(M * topk, 2 * I, generator=gen).to(torch.bfloat16).to(dev)
        y = torch.randn(M * topk, H, generator=gen).to(torch.bfloat16).to(dev)
        w = torch.rand(M, topk, generator=gen).to(dev)
        gs = torch.full((E,), 500.0, device=dev)
        r = cutlass.routing(ids, E)
        stages_to_time = {
            "routing": lambda: cutlass.routing(ids, E),
            "quantize_rows": lambda: cutlass.quantize_rows(x, gs, r),
            "silu_mul_quantize": lambda: cutlass.silu_mul_quantize(h, gs, r),
            "moe_reduce": lambda: cutlass.moe_reduce(y, r, w, M, torch.bfloat16),
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
