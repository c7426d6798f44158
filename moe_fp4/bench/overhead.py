"""Eager host overhead of one MoE call: wall time per synchronized call minus its GPU time.

``wall``: the median over ``reps`` of ``t0 = perf_counter(); fn(); synchronize(); t1`` (the
synchronize is part of every such call, and the same for every path); ``gpu``: the median
CUDA-event time of the same work replayed from a CUDA graph with a warm L2 (no launch cost,
no host work); ``host = wall - gpu`` is what the Python call, argument checks, launches and
the synchronization add. ``returns``: the median time until ``fn`` returns, before the
synchronize (the host's own work: the GPU runs behind it). The benchmark also times a
``floor`` path, one small torch kernel (``out.zero_()``): what this method measures for a
call that does nothing but launch once and synchronize. Without a GPU (``WallTimer``) only
``wall`` and ``returns`` exist.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["OVERHEAD_TOKENS", "measure_overhead", "measure_overheads"]

OVERHEAD_TOKENS = (1, 64)  # the M the integration issue asks the figures for


def _graph_gpu_us(fn: Callable[[], Any], reps: int) -> float | None:
    """Median CUDA-event time of a graph replay of ``fn`` (warm L2); None if ``fn`` cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=side):
            fn()
    except Exception:  # noqa: BLE001 - not capturable: no GPU-only time, the row says so
        torch.cuda.synchronize()
        return None
    torch.cuda.synchronize()
    graph.replay()
    samples = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        samples.append(s.elapsed_time(e) * 1e3)
    return statistics.median(samples)


def measure_overheads(fns: list[Callable[[], Any]], device: torch.device, reps: int = 50,
                      rounds: int = 10) -> list[dict]:
    """``{"wall_us", "gpu_us", "host_us", "returns_us"}`` of each of ``fns`` (see the module docstring).

    The timed calls are interleaved: ``rounds`` rounds, each timing every function ``reps / rounds``
    times in turn, so that a slow spell of the host (another process, a clock change) falls on
    every path alike instead of on whichever was being timed. Each function has run before.
    """
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for fn in fns:
        for _ in range(3):
            fn()
    sync()
    per_round = max(1, reps // rounds)
    walls: list[list[float]] = [[] for _ in fns]
    returns: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                sync()
                walls[i].append((time.perf_counter() - t0) * 1e6)
                returns[i].append((t1 - t0) * 1e6)
    out = []
    for i, fn in enumerate(fns):
        wall = statistics.median(walls[i])
        gpu = _graph_gpu_us(fn, reps) if cuda else None
        out.append({"wall_us": wall, "gpu_us": gpu, "host_us": wall - gpu if gpu is not None else None,
                    "returns_us": statistics.median(returns[i])})
    return out


def measure_overhead(fn: Callable[[], Any], device: torch.device, reps: int = 50) -> dict:
    """:func:`measure_overheads` of one function."""
    return measure_overheads([fn], device, reps, rounds=1)[0]
