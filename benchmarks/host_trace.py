"""Where an eager ``fused_moe`` call's host time goes on a GPU, per segment of the call.

    python benchmarks/host_trace.py [--backends cutlass,triton] [--tokens 1,64] [--reps 300]

The benchmark's "eager host overhead" is the wall time of a synchronized call minus its GPU time
(``moe_fp4.bench.overhead``); this splits the host side of such calls (Qwen3-30B-A3B layer, the
benchmark's weights and inputs: ``random_experts``, ``layer_inputs``; the same synchronized call)
into segments timed with ``perf_counter_ns`` at the end of each of the plan's launches
(``pipeline._Plan._launch`` runs them wrapped, in this process only):

* ``before launches``: ``fused_moe`` entry to the plan's first launch (checks, resolution, op,
  workspace, plan lookup, the workspace lock, the stream query and order);
* one row per bound launch (``routing`` ... ``moe_reduce``);
* ``after plan``: the last launch to ``fused_moe``'s return (with the Triton backend's
  ``LaunchBatch``, the batch's exit: its launches go out in one library call there);
* with the Triton backend's plans replayed (``pipeline.REPLAY``, the default; ``--no-replay`` runs
  the bound launches instead), ``before launches`` ends where the replay starts and ``replay`` is
  the replay: the learned launches with the call's free values, in one library call;
* ``returned``: the whole call until it returns; ``synchronized``: until the GPU is done too.

Then a ``torch.profiler`` table of the same calls (CPU side: which runtime and driver calls take
the time). Medians over ``--reps`` calls, each after a synchronize, as the benchmark's are.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch

from moe_fp4 import NvFp4Experts, fused_moe, pipeline
from moe_fp4.bench.ep import layer_inputs
from moe_fp4.bench.shapes import MODELS
from moe_fp4.bench.workload import random_experts
from moe_fp4.triton_kernels._common import LaunchBatch

SHAPE = MODELS["qwen3-30b-a3b"]
STAGES = ("routing", "quantize_rows", "gemm1", "silu_mul_quantize", "gemm2", "moe_reduce")


class _Marks:
    """Timestamps of one call, by segment name (ns)."""

    def __init__(self) -> None:
        self.t: list[tuple[str, int]] = []

    def mark(self, name: str) -> None:
        self.t.append((name, time.perf_counter_ns()))


MARKS = _Marks()


def _patch() -> None:
    """Time each launch of a plan into :data:`MARKS`: ``_Plan._launch`` itself runs, on the plan's
    bound launches each wrapped to mark its end (the wrapped set made once per plan)."""
    launch = pipeline._Plan._launch
    wrapped: dict[int, tuple] = {}

    def timed(name, fn):
        def call(*args):
            fn(*args)
            MARKS.mark(name)
        return call

    def marked_launch(bound, problem, weights, on_input, out, stream):
        MARKS.mark("before launches")
        entry = wrapped.get(id(bound))
        if entry is None or entry[0] is not bound:
            entry = wrapped[id(bound)] = bound, bound._replace(**{f: timed(f, getattr(bound, f)) for f in STAGES})
        launch(entry[1], problem, weights, on_input, out, stream)

    pipeline._Plan._launch = staticmethod(marked_launch)
    replay = LaunchBatch.replay

    def marked_replay(self, *args):
        MARKS.mark("before launches")
        if replay(self, *args):
            MARKS.mark("replay")
            return True
        MARKS.t.pop()  # not replayed: the launches run (and are marked) as above
        return False

    LaunchBatch.replay = marked_replay


def _inputs(M: int, device: str) -> tuple[torch.Tensor, ...]:  # noqa: N803
    """The benchmark's inputs (``moe_fp4.bench.ep.layer_inputs``) and an output buffer."""
    x, w, ids = layer_inputs(SHAPE, M, torch.device(device), seed=0)
    return x, w, ids, torch.empty_like(x)


def trace(backend: str, ex: NvFp4Experts, M: int, reps: int, device: str = "cuda",  # noqa: N803
          validate: bool = False) -> dict[str, float]:
    """Median µs per segment (module docstring) of ``reps`` synchronized eager calls."""
    return {k: statistics.median(v) for k, v in samples(backend, ex, M, reps, device, validate).items()}


def samples(backend: str, ex: NvFp4Experts, M: int, reps: int, device: str = "cuda",  # noqa: N803
            validate: bool = False) -> dict[str, list[float]]:
    """µs per segment of each of ``reps`` synchronized eager calls (after 20 untimed ones)."""
    x, w, ids, out = _inputs(M, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call() -> None:
        fused_moe(x, ex, w, ids, backend=backend, out=out, validate=validate)

    for _ in range(20):
        call()
    sync()
    seg: dict[str, list[float]] = {}
    for _ in range(reps):
        MARKS.t.clear()
        t0 = time.perf_counter_ns()
        call()
        t1 = time.perf_counter_ns()
        sync()
        t2 = time.perf_counter_ns()
        prev = t0
        for name, t in MARKS.t:
            seg.setdefault(name, []).append((t - prev) / 1e3)
            prev = t
        seg.setdefault("after plan", []).append((t1 - prev) / 1e3)
        seg.setdefault("returned", []).append((t1 - t0) / 1e3)
        seg.setdefault("synchronized", []).append((t2 - t0) / 1e3)
    return seg


def graph_replay(backend: str, ex: NvFp4Experts, M: int, reps: int) -> dict[str, float]:  # noqa: N803
    """The same call captured in a CUDA graph (after the eager warm-up): median µs until ``graph.replay()``
    returns and until the GPU is done, each replay after a synchronize: what an eager call would cost
    the host if its launches were one graph launch (nothing else of the call: no checks, no Python)."""
    x, w, ids, out = _inputs(M, "cuda")
    for _ in range(20):
        fused_moe(x, ex, w, ids, backend=backend, out=out, validate=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, ex, w, ids, backend=backend, out=out, validate=False)
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    ret, syn = [], []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        graph.replay()
        t1 = time.perf_counter_ns()
        torch.cuda.synchronize()
        t2 = time.perf_counter_ns()
        ret.append((t1 - t0) / 1e3)
        syn.append((t2 - t0) / 1e3)
    return {"graph replay returned": statistics.median(ret), "graph replay synchronized": statistics.median(syn)}


def profile(backend: str, ex: NvFp4Experts, M: int, reps: int, validate: bool = False) -> str:  # noqa: N803
    """``torch.profiler``'s table (CPU time first) of ``reps`` synchronized calls on :func:`trace`'s inputs."""
    x, w, ids, out = _inputs(M, "cuda")
    for _ in range(20):
        fused_moe(x, ex, w, ids, backend=backend, out=out, validate=validate)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            fused_moe(x, ex, w, ids, backend=backend, out=out, validate=validate)
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="cutlass,triton")
    p.add_argument("--tokens", default="1,64")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--routing-small-max", type=int, metavar="N", help="routing.SMALL_MAX for this run (one "
                   "routing launch up to N flat indices; default 256)")
    p.add_argument("--validate", action="store_true", help="calls with validate=True (default: False, as the "
                   "benchmark's host figure; fused_moe's own default is True)")
    p.add_argument("--no-replay", action="store_true", help="plans run their bound launches every call "
                   "(pipeline.REPLAY off: the Triton backend's launches before replays)")
    p.add_argument("--compare-replay", action="store_true", help="each backend with replays on, then off, in this "
                   "process (the A/B of pipeline.REPLAY)")
    p.add_argument("--graph-replay", action="store_true", help="also the host time of the call captured in a "
                   "CUDA graph and replayed (graph replay returned / synchronized)")
    args = p.parse_args(argv)
    modes = (True, False) if args.compare_replay else (not args.no_replay,)
    if not torch.cuda.is_available():
        raise SystemExit("host_trace.py needs a CUDA GPU")
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.routing_small_max:
        importlib.import_module("moe_fp4.triton_kernels.routing").SMALL_MAX = args.routing_small_max
    _patch()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for backend in args.backends.split(","):
        ex = random_experts(SHAPE, torch.device("cuda"), seed=0)  # (its own copy per backend: layouts in place)
        # The modes take turns, 10 rounds of reps / 10 calls each, so that a slow spell of the host falls on
        # each alike (as the benchmark's overhead figures do).
        seg = {(mode, M): {} for mode in modes for M in tokens}
        for _ in range(10 if len(modes) > 1 else 1):
            for M in tokens:
                for mode in modes:
                    pipeline.REPLAY = mode
                    n = args.reps // 10 if len(modes) > 1 else args.reps
                    for k, v in samples(backend, ex, M, n, validate=args.validate).items():
                        seg[mode, M].setdefault(k, []).extend(v)
        for mode in modes:
            rows = {M: {k: statistics.median(v) for k, v in seg[mode, M].items()} for M in tokens}
            if args.graph_replay and mode == modes[0]:
                for M in tokens:
                    rows[M].update(graph_replay(backend, ex, M, args.reps))
            pipeline.REPLAY = mode
            print(f"\n{backend}: median µs per segment of a synchronized eager call (validate={args.validate}, "
                  f"replay={mode})")
            print(f"  {'segment':20s}" + "".join(f"{f'M={M}':>9s}" for M in tokens))
            keys = list(dict.fromkeys(k for r in rows.values() for k in r))
            for k in keys:
                print(f"  {k:20s}" + "".join(f"{rows[M].get(k, float('nan')):9.1f}" for M in tokens))
        pipeline.REPLAY = modes[0]
        if not args.no_profile:
            for M in tokens:
                print(f"\n{backend} M={M}: torch.profiler, {min(args.reps, 100)} calls")
                print(profile(backend, ex, M, min(args.reps, 100), args.validate))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
