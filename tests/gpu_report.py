"""Run the Triton backend's tests on a GPU and write a JSON summary (``python tests/gpu_report.py OUT_DIR``).

On the H200, from the repository root::

    PYTHONPATH=. python tests/gpu_report.py $OUT              # add --no-timings to skip the timings

runs ``tests/test_triton_*.py`` (the interpreter-sized cases on CUDA plus everything marked
``gpu``: the 640-case grid, per-stage checks at model sizes, CUDA-graph capture and replay,
the no-sync check, ``python -m moe_fp4 demo``) and writes ``OUT_DIR/triton_gpu_report.json``:
pass/fail/skip counts, the failures, the worst error each stage reached (recorded by the
tests through :func:`record`), the GPU, torch, triton, the date and the git commit; then
times the Qwen3-30B-A3B layer (whole forward, each stage, a sweep of GEMM configurations;
informational, for tuning). Exit status is pytest's.

Imported by the tests for :func:`record` only; recording is a no-op cost when no report runs.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

_WORST: dict[str, dict[str, float]] = {}


def record(stage: str, **metrics: float) -> None:
    """Keep the largest value seen of each metric of ``stage`` (e.g. ``record("gemm", rel_to_bound=0.3)``)."""
    worst = _WORST.setdefault(stage, {})
    for name, value in metrics.items():
        value = float(value)
        if name not in worst or not value <= worst[name]:  # NaN sticks
            worst[name] = value


class _Collector:
    """pytest plugin: outcome counts and failure details."""

    def __init__(self) -> None:
        self.counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
        self.failures: list[dict[str, str]] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            key = "error" if report.when == "setup" and report.failed else report.outcome
            self.counts[key] += 1
            if report.failed:
                self.failures.append({"test": report.nodeid, "message": str(report.longrepr)[-2000:]})


def _time_us(fn, stream, reps: int = 20) -> float:
    """Median microseconds per call of ``fn`` replayed from a CUDA graph of ``reps`` calls (warm L2)."""
    import torch

    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                fn()
        times = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / reps)
    return round(sorted(times)[len(times) // 2], 2)


def _timings() -> dict:
    """Per-stage and whole-forward times of the Qwen3-30B-A3B MoE layer, and a GEMM config sweep (informational)."""
    import dataclasses

    import torch

    import moe_fp4.backends.triton as tb
    from moe_fp4 import NvFp4Experts, fused_moe

    tk = tb.kernels()
    E, topk, H, I = 128, 8, 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, generator=gen, device="cuda", dtype=torch.bfloat16) / 15
    w2 = torch.randn(E, H, I, generator=gen, device="cuda", dtype=torch.bfloat16) / 15
    ex = NvFp4Experts.quantize(w13, w2, a13_gs=2688.0 / 0.5, a2_gs=2688.0 / 1.0)
    del w13, w2
    w13_op, w2_op = tb.STAGES.weights(ex)
    G = tk.GemmConfig
    candidates = [cfg for _, cfg in tk.GEMM_CONFIGS] + [
        G(16, 64, 128, True, 4, 4), G(16, 128, 128, True, 4, 4), G(32, 128, 64, True, 4, 4),
        G(16, 128, 128, False, 4, 4),
    ]
    stream = torch.cuda.Stream()
    results = []
    bf16 = torch.bfloat16
    for M in (1, 8, 32, 128, 512, 2048, 8192):
        x = (torch.randn(M, H, generator=gen, device="cuda") / 10).bfloat16()
        w, ids = torch.softmax(torch.randn(M, E, generator=gen, device="cuda"), -1).topk(topk, -1)
        ids = ids.to(torch.int32)
        out = torch.empty_like(x)
        fused = _time_us(lambda: fused_moe(x, ex, w, ids, backend="triton", validate=False, out=out), stream)
        touched = int(torch.unique(ids).numel())
        r = tb.routing(ids, E)
        a1 = tb.quantize_rows(x, ex.a13_gs, r)
        h = tb.grouped_gemm(a1, w13_op, r, bf16)
        a2 = tb.silu_mul_quantize(h, ex.a2_gs, r)
        y = tb.grouped_gemm(a2, w2_op, r, bf16)
        stage_fns = {
            "routing": lambda: tb.routing(ids, E, out=r),
            "quantize_rows": lambda: tb.quantize_rows(x, ex.a13_gs, r, out=a1),
            "gemm1": lambda: tb.grouped_gemm(a1, w13_op, r, bf16, out=h),
            "silu_mul_quantize": lambda: tb.silu_mul_quantize(h, ex.a2_gs, r, out=a2),
            "gemm2": lambda: tb.grouped_gemm(a2, w2_op, r, bf16, out=y),
            "moe_reduce": lambda: tb.moe_reduce(y, r, w, M, bf16, out=out),
        }
        sweep = []
        for cfg in candidates:
            g1 = _time_us(lambda: tb.grouped_gemm(a1, w13_op, r, bf16, out=h, config=cfg), stream)
            g2 = _time_us(lambda: tb.grouped_gemm(a2, w2_op, r, bf16, out=y, config=cfg), stream)
            sweep.append({"config": dataclasses.asdict(cfg), "gemm1_us": g1, "gemm2_us": g2})
        weight_bytes = touched * 3 * H * I * 4.5 / 8
        results.append({
            "M": M, "experts_touched": touched, "fused_moe_us": fused,
            "weight_TB_per_s": round(weight_bytes / (fused * 1e-6) / 1e12, 3),
            "table_config": dataclasses.asdict(tk.gemm_config(M * topk, E)),
            "stages_us": {name: _time_us(fn, stream) for name, fn in stage_fns.items()},
            "gemm_config_sweep": sweep,
        })
    return {
        "layer": {"E": E, "topk": topk, "H": H, "I": I, "dtype": "bfloat16"},
        "method": "median of 7 replays of a CUDA graph of 20 calls, warm L2, random routing (informational)",
        "results": results,
    }


def _git_commit(root: Path) -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return sha.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str]) -> int:
    timings = "--no-timings" not in argv
    argv = [a for a in argv if a != "--no-timings"]
    if len(argv) != 1:
        print("usage: python tests/gpu_report.py OUT_DIR [--no-timings]", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():  # as conftest.py does, before triton creates any jit function
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import pytest
    import triton

    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parent.parent
    tests = sorted(str(p) for p in (root / "tests").glob("test_triton_*.py"))
    collector = _Collector()
    started = datetime.datetime.now(datetime.timezone.utc)
    status = pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", *tests], plugins=[collector])
    report = {
        "what": "moe_fp4 Triton backend tests (tests/test_triton_*.py) incl. the gpu-marked grid",
        "date_utc": started.isoformat(timespec="seconds"),
        "duration_s": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1),
        "git_commit": _git_commit(root),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "capability": list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "pytest_exit_status": int(status),
        "counts": collector.counts,
        "failures": collector.failures,
        "worst_errors": _WORST,
    }
    if timings and torch.cuda.is_available():
        try:
            report["timings_qwen3_30b_a3b"] = _timings()
        except Exception as exc:  # noqa: BLE001 - informational; the failure is reported, not hidden
            report["timings_qwen3_30b_a3b"] = {"error": f"{type(exc).__name__}: {exc}"}
    path = out_dir / "triton_gpu_report.json"
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    print(f"wrote {path}: {collector.counts}")
    return int(status)


if __name__ == "__main__":
    # Let the test modules (imported by pytest) see this module's state, not a second copy.
    sys.modules.setdefault("gpu_report", sys.modules[__name__])
    raise SystemExit(main(sys.argv[1:]))
