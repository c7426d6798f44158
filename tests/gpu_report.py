"""Run the Triton backend's tests on a GPU and write a JSON summary (``python tests/gpu_report.py OUT_DIR``).

On the H200, from the repository root::

    PYTHONPATH=. python tests/gpu_report.py $OUT

runs ``tests/test_triton_*.py`` (the interpreter-sized cases on CUDA plus everything marked
``gpu``: the issue's grid, per-stage checks at model sizes, CUDA-graph capture and replay,
the no-sync check, ``python -m moe_fp4 demo``) and writes ``OUT_DIR/triton_gpu_report.json``:
pass/fail/skip counts, the failures, the worst error each stage reached (recorded by the
tests through :func:`record`), per-stage timings of the Qwen3-30B-A3B layer (informational),
the GPU, torch, triton, the date and the git commit. Exit status is pytest's.

Imported by the tests for :func:`record` only; recording is a no-op cost when no report runs.
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

_WORST: dict[str, dict[str, float]] = {}
_EXTRA: dict[str, object] = {}


def record(stage: str, **metrics: float) -> None:
    """Keep the largest value seen of each metric of ``stage`` (e.g. ``record("gemm", rel_to_bound=0.3)``)."""
    worst = _WORST.setdefault(stage, {})
    for name, value in metrics.items():
        value = float(value)
        if name not in worst or not value <= worst[name]:  # NaN sticks
            worst[name] = value


def attach(name: str, value: object) -> None:
    """Attach an informational entry (e.g. timings) to the report."""
    _EXTRA[name] = value


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


def _git_commit(root: Path) -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return sha.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/gpu_report.py OUT_DIR", file=sys.stderr)
        return 2
    import pytest
    import torch
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
        **_EXTRA,
    }
    path = out_dir / "triton_gpu_report.json"
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    print(f"wrote {path}: {collector.counts}")
    return int(status)


if __name__ == "__main__":
    # Let the test modules (imported by pytest) see this module's state, not a second copy.
    sys.modules.setdefault("gpu_report", sys.modules[__name__])
    raise SystemExit(main(sys.argv[1:]))
