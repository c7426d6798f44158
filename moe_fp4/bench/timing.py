"""Timing that can be trusted: CUDA-graph replays, cold L2, warm-up excluded, median and spread.

:class:`GpuTimer` is what every number in a report comes from, for moe_fp4's paths and the
peers alike:

1. :meth:`~GpuTimer.prepare` calls the function eagerly a few times (Triton JIT, autotuning,
   Marlin's PTX JIT and cached layouts happen here), then captures one call in a CUDA graph
   on the same stream (so per-stream workspaces exist before capture).
   A function that cannot be captured (it synchronizes with the host) is timed eagerly, and
   the row says so (``mode="eager"`` and the reason).
2. :meth:`~GpuTimer.time` replays it twice more untimed, then ``reps`` times, each replay
   preceded by a write of a buffer four times the L2 size so that no weight is served from
   L2, and each replay alone bracketed by CUDA events. ``reps`` follows a time budget
   (between ``min_reps`` and ``max_reps``).
3. :class:`Timing` keeps the median and the 20th/80th percentiles in µs.

:class:`WallTimer` runs the same protocol eagerly with the host clock on CPU; it exists to
exercise the benchmark's plumbing in CPU tests, and its numbers are not GPU measurements.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .roofline import Ceilings

__all__ = ["Timing", "percentile", "Prepared", "GpuTimer", "WallTimer", "measure_ceilings"]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("values: expected at least one sample, got none")
    if not 0 <= q <= 100:
        raise ValueError(f"q: expected a percentile in [0, 100], got {q}")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class Timing:
    """Median and spread (20th/80th percentiles) of ``reps`` timed executions, in µs."""

    median_us: float
    p20_us: float
    p80_us: float
    reps: int
    mode: str

    @classmethod
    def from_samples(cls, samples_us: list[float], mode: str) -> Timing:
        return cls(percentile(samples_us, 50), percentile(samples_us, 20), percentile(samples_us, 80),
                   len(samples_us), mode)

    def to_dict(self) -> dict:
        return asdict(self)


class Prepared:
    """A function ready to be timed: :meth:`run` executes it once and returns its output.

    mode: ``"graph"`` (a CUDA-graph replay that rewrites ``static_output``), ``"eager"`` (the
    function itself; ``note`` says why it could not be captured) or ``"wall"`` (CPU, host clock).
    ``last_output`` is what the latest :meth:`run` returned.
    """

    def __init__(self, call: Callable[[], Any], mode: str, note: str | None = None, static_output: Any = None) -> None:
        self._call = call
        self.mode, self.note, self.static_output = mode, note, static_output
        self.last_output: Any = None

    def run(self) -> Any:
        self.last_output = self._call()
        return self.last_output


def _rep_count(estimate_s: float, budget_s: float, min_reps: int, max_reps: int) -> int:
    if estimate_s <= 0:
        return max_reps
    return max(min_reps, min(max_reps, int(budget_s / estimate_s)))


class GpuTimer:
    """CUDA-event timing of graph replays with a cold L2 (see the module docstring)."""

    def __init__(self, device: torch.device, budget_s: float = 0.25, min_reps: int = 10, max_reps: int = 200,
                 warmup_calls: int = 3) -> None:
        if device.type != "cuda":
            raise ValueError(f"device: GpuTimer needs a CUDA device, got {device}")
        if not (budget_s > 0 and 1 <= min_reps <= max_reps):
            raise ValueError(f"budget_s, min_reps, max_reps: expected budget_s > 0 and 1 <= min_reps <= max_reps, "
                             f"got {budget_s}, {min_reps}, {max_reps}")
        self.device = device
        self.budget_s, self.min_reps, self.max_reps, self.warmup_calls = budget_s, min_reps, max_reps, warmup_calls
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
        self.flush_bytes = max(4 * l2, 256 << 20)
        self._flush_buf = torch.empty(self.flush_bytes, dtype=torch.uint8, device=device)
        # One stream for every path's warm-up calls and capture: backends cache workspaces per
        # stream and allocate none while a graph is being captured.
        self._side = torch.cuda.Stream(device)

    @property
    def description(self) -> str:
        return (f"CUDA-graph replays timed one by one with CUDA events; before each replay a "
                f"{self.flush_bytes >> 20} MiB buffer is written so the L2 is cold; {self.warmup_calls} eager "
                f"warm-up calls before capture and 2 untimed replays; reps fill a {self.budget_s * 1e3:.0f} ms budget "
                f"({self.min_reps}..{self.max_reps}); median and p20/p80")

    def flush(self) -> None:
        self._flush_buf.zero_()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def prepare(self, fn: Callable[[], Any]) -> Prepared:
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            for _ in range(self.warmup_calls):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(self._side)
        self.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self._side):
                out = fn()
        except Exception as exc:  # noqa: BLE001 - a host sync inside fn: time it eagerly and say so
            self.synchronize()
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            return Prepared(fn, "eager", note=f"not capturable in a CUDA graph ({type(exc).__name__}: {first})")
        self.synchronize()

        def replay() -> Any:
            graph.replay()
            return out

        return Prepared(replay, "graph", static_output=out)

    def _timed(self, run: Callable[[], Any], reps: int) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            self.flush()
            s.record()
            run()
            e.record()
        self.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]

    def time(self, prepared: Prepared) -> Timing:
        warm = self._timed(prepared.run, 2)  # excluded; gives the estimate for the rep count
        flush_s = self.flush_bytes / 3e12  # about the time of one flush write
        reps = _rep_count(max(warm) * 1e-6 + flush_s, self.budget_s, self.min_reps, self.max_reps)
        return Timing.from_samples(self._timed(prepared.run, reps), prepared.mode)


class WallTimer:
    """Eager calls timed with the host clock (CPU plumbing tests only; not GPU measurements)."""

    description = "CPU wall clock of eager calls (plumbing check only, not a GPU measurement)"

    def __init__(self, reps: int = 3) -> None:
        if reps < 1:
            raise ValueError(f"reps: expected at least 1, got {reps}")
        self.reps = reps

    def synchronize(self) -> None:
        pass

    def prepare(self, fn: Callable[[], Any]) -> Prepared:
        fn()
        return Prepared(fn, "wall")

    def time(self, prepared: Prepared) -> Timing:
        samples = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            prepared.run()
            samples.append((time.perf_counter() - t0) * 1e6)
        return Timing.from_samples(samples, prepared.mode)


def _copy_timing(timer: GpuTimer | WallTimer, src: torch.Tensor) -> Timing:
    """Timing of the elementwise copy ``dst = src * 1`` (``dst`` is freed when this returns)."""
    dst = torch.empty_like(src)
    return timer.time(timer.prepare(lambda: torch.mul(src, 1, out=dst)))


def _bandwidth_timings(timer: GpuTimer | WallTimer, device: torch.device,
                       copy_bytes: int) -> tuple[Timing, Timing, str]:
    """Timings of the copy and of the read-only stream over ``copy_bytes``, and how the stream was read.

    The buffers are freed when this returns, before the matmul allocates its own.
    """
    src = torch.ones(copy_bytes // 2, dtype=torch.bfloat16, device=device)
    copy_t = _copy_timing(timer, src)
    if device.type == "cuda":
        from ._stream import stream_read  # imports triton

        partial = stream_read(src)  # compiled and allocated once, outside the timing
        return copy_t, timer.time(timer.prepare(lambda: stream_read(src, partial))), "Triton read-only kernel"
    words = src.view(torch.int32)
    return copy_t, timer.time(timer.prepare(lambda: words.sum())), "torch.sum"


def _matmul_timing(timer: GpuTimer | WallTimer, device: torch.device, n: int) -> Timing:
    """Timing of a bf16 ``n``^3 matmul into a preallocated output."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((n, n), device=device, generator=gen).to(torch.bfloat16)
    b = torch.randn((n, n), device=device, generator=gen).to(torch.bfloat16)
    c = torch.empty_like(a)
    return timer.time(timer.prepare(lambda: torch.matmul(a, b, out=c)))


def measure_ceilings(timer: GpuTimer | WallTimer, device: torch.device, copy_bytes: int = 2 << 30,
                     matmul_n: int = 8192) -> tuple[Ceilings, dict]:
    """Measure the device's copy and read bandwidth and bf16 matmul rate with ``timer``.

    Copy: an elementwise kernel ``dst = src * 1`` over ``copy_bytes`` (read + write bytes count);
    not ``copy_``, which a CUDA graph turns into a DMA memcpy node (2.7 TB/s on the H200, against
    4.3 for the SMs' copy). Read-only stream: a Triton
    kernel that reads the same buffer once (``torch.sum`` on CPU). Matmul: bf16 ``matmul_n``^3.
    Returns the :class:`Ceilings` and how each was measured (for the report).
    """
    copy_t, stream_t, stream_how = _bandwidth_timings(timer, device, copy_bytes)
    mm_t = _matmul_timing(timer, device, matmul_n)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ceilings = Ceilings(
        copy_tbps=2 * copy_bytes / (copy_t.median_us * 1e-6) / 1e12,
        stream_tbps=copy_bytes / (stream_t.median_us * 1e-6) / 1e12,
        bf16_tflops=2 * matmul_n**3 / (mm_t.median_us * 1e-6) / 1e12,
    )
    mib = copy_bytes >> 20
    how = {
        "copy": f"elementwise copy kernel of {mib} MiB (read + write bytes), median {copy_t.median_us:.1f} us",
        "stream": f"{stream_how} reading the same {mib} MiB once, median {stream_t.median_us:.1f} us",
        "bf16_matmul": f"torch.matmul bf16 {matmul_n}^3, median {mm_t.median_us:.1f} us",
        "read_bandwidth_used": "max(copy, stream)",
    }
    return ceilings, how
