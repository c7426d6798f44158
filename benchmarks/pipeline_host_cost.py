"""Host cost of ``moe_fp4.fused_moe`` per component, on the CPU with every kernel launch stubbed.

    python benchmarks/pipeline_host_cost.py [--reps N] [--profile PATH]

Runs the real host path of ``fused_moe(..., validate=False/True)`` on CPU tensors at the
Qwen3-30B-A3B shape (E=128, top-8, H=2048, I=768), M = 1 and 64, for the paths ``cutlass``
(its sm_90a stage set, as on the H200), ``cutlass-sm100`` (the SM100/SM120 one) and ``triton``,
with no kernel running (:func:`moe_fp4.bench.hostcost.stubbed_launches`); and the pipeline
framework alone, ``run_pipeline`` over kernels that do nothing. Each component is the
difference of two nested calls, each timed alone (the best of 7 rounds of ``--reps`` calls,
the calls taking turns):

* ``checks``: ``fused_moe`` minus ``_op.call`` (argument checks, backend resolution, casts);
* ``validate``: ``fused_moe(validate=True)`` minus ``validate=False`` (the data checks, here on the CPU);
* ``validate, library``: the same through the CUDA library's ``moe_fp4_check_inputs`` (stubbed), the path of
  a GPU's call: its Python part alone (on a GPU: the ``validate`` row again);
* ``op``: ``_op.call`` minus the backend's ``fused_moe(problem)`` (dispatch, the experts' view, ``MoEProblem``);
* ``backend``: that minus ``run_pipeline`` (stage-set choice, ``cached_workspace``);
* ``pipeline``: ``run_pipeline`` minus the launches (plan lookup, the workspace's lock and stream order);
* one row per launch of the plan, alone (argument marshalling, the ctypes call or Triton's wrapper);
* ``checked``: a forward through the checked stage functions (what the first call of a shape costs).

Not a GPU measurement: CUDA-only calls take their CPU branch and Triton's own launcher does
not run (the module docstring of ``moe_fp4.bench.hostcost`` lists what is stubbed). The eager
host overhead of whole calls on the H200 is in the benchmark report ("Eager host overhead").
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import time

import torch

from moe_fp4 import NvFp4Experts, _op, fused_moe, moe, pipeline
from moe_fp4.backends import registry
from moe_fp4.bench.hostcost import stubbed_launches
from moe_fp4.moe import MoEProblem
from moe_fp4.pipeline import StageSet, cached_workspace, run_pipeline

E, H, I, TOPK = 128, 2048, 768, 8  # noqa: E741
TOKENS = (1, 64)
PATHS = {"cutlass": ("cutlass", True), "cutlass-sm100": ("cutlass", False), "triton": ("triton", True)}


class NoopKernels:
    def routing(self, topk_ids, out, scratch): ...
    def quantize_rows(self, x, gs, routing, gather, row_scale, out, config): ...
    def silu_mul_quantize(self, h, gs, routing, out, config): ...
    def grouped_gemm(self, a, w, routing, out, scratch, config): ...
    def moe_reduce(self, y, routing, topk_weights, out): ...


def _best_us(fns: dict[str, object], reps: int, rounds: int = 7, sync=None) -> dict[str, float]:
    """us per call of each of ``fns``: the best of ``rounds`` rounds of ``reps`` calls, the functions
    taking turns within each round (so that a noisy moment costs them all alike). ``sync`` (on a
    GPU) runs after each function's round, untimed, so that no round waits on a full launch queue."""
    for fn in fns.values():
        for _ in range(min(reps, 100)):
            fn()
        if sync:
            sync()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / reps * 1e6)
            if sync:
                sync()
    return best


def _experts(device: str = "cpu") -> NvFp4Experts:
    g = torch.Generator().manual_seed(0)
    ex = NvFp4Experts.quantize((torch.randn(E, 2 * I, H, generator=g) / 15).bfloat16(),
                               (torch.randn(E, H, I, generator=g) / 15).bfloat16(), a13_gs=2688.0, a2_gs=2688.0)
    return ex if device == "cpu" else ex.to(device)


def _inputs(M: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:  # noqa: N803
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, H, generator=g).bfloat16()
    w = torch.softmax(torch.randn(M, TOPK, generator=g), -1)
    ids = torch.randperm(E, generator=g)[:TOPK].repeat(M, 1).to(torch.int32)
    return tuple(t.to(device) for t in (x, w, ids, torch.empty_like(x)))


def components(ex: NvFp4Experts, backend: str, M: int, reps: int, device: str = "cpu",  # noqa: N803
               rounds: int = 7) -> dict[str, float]:
    """The components (module docstring) of one path at one M, in us."""
    x, w, ids, out = _inputs(M, device)
    calls = {v: lambda v=v: fused_moe(x, ex, w, ids, backend=backend, out=out, validate=v) for v in (False, True)}
    calls[False]()

    def library_check() -> None:
        """``validate=True`` through ``moe_fp4_check_inputs`` on the CPU tensors (the library's host oracle
        device; stubbed, it answers "valid" at once), as a GPU's call validates."""
        saved, moe._HOST_ORACLE = moe._HOST_ORACLE, device == "cpu"
        try:
            calls[True]()
        finally:
            moe._HOST_ORACLE = saved

    name = registry.resolve_backend(backend, x.device, x.dtype)
    mod = registry.get_backend_module(name)
    tensors = _op.tensors_of(ex)
    problem = MoEProblem(x, ex, w, ids, False, out)
    stages = mod.stages_for(x.device) if hasattr(mod, "stages_for") else mod.STAGES
    ws = cached_workspace(stages, problem)
    bound = ws.plans[ex][pipeline._plan_key(stages, problem)].bound  # the plan the first call made
    w13, w2 = stages.weights(ex)
    views = pipeline._views(ws, M * TOPK, E, H, I)
    t = _best_us({
        "total": calls[False],
        "total, validate": calls[True],
        "total, validate, library": library_check,
        "op.call": lambda: _op.call(x, ex, tensors, w, ids, name, False, out),
        "backend": lambda: mod.fused_moe(problem),
        "run_pipeline": lambda: run_pipeline(stages, problem, ws),
        "launch routing": lambda: bound.routing(ids, None),
        "launch quantize_rows": lambda: bound.quantize_rows(x, None, None),
        "launch gemm1": lambda: bound.gemm1(None),
        "launch silu_mul_quantize": lambda: bound.silu_mul_quantize(None),
        "launch gemm2": lambda: bound.gemm2(None),
        "launch moe_reduce": lambda: bound.moe_reduce(w, out, None),
        "checked": lambda: pipeline._run_stages(stages, problem, w13, w2, views, ws),
    }, reps, rounds, torch.cuda.synchronize if device != "cpu" else None)
    launches = sum(v for k, v in t.items() if k.startswith("launch "))
    return {
        "total": t["total"],
        "total, validate": t["total, validate"],
        "checks": t["total"] - t["op.call"],
        "validate": t["total, validate"] - t["total"],
        "validate, library": t["total, validate, library"] - t["total"],
        "op": t["op.call"] - t["backend"],
        "backend": t["backend"] - t["run_pipeline"],
        "pipeline": t["run_pipeline"] - launches,
        **{k: v for k, v in t.items() if k.startswith("launch ")},
        "checked": t["checked"],
    }


def framework(ex: NvFp4Experts, reps: int) -> float:
    """``run_pipeline`` with kernels that do nothing, M=1, on a workspace (the plan's path)."""
    stages = StageSet.from_kernels("noop", NoopKernels(), reduce_dtypes=(torch.bfloat16,))
    x, w, ids, _ = _inputs(1)
    problem = MoEProblem(x, ex, w, ids, False, None)
    return _best_us({"framework": lambda: run_pipeline(stages, problem, cached_workspace(stages, problem))},
                    reps)["framework"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=2000, help="calls per timed round (default 2000)")
    parser.add_argument("--profile", metavar="PATH", help="also cProfile that path's M=1 call (cutlass, triton, ...)")
    parser.add_argument("--device", default="cpu",
                        help="cuda: the real launches on the current GPU (paths cutlass and triton), kernels running; "
                             "times are host time per call with the GPU keeping up (synchronized between rounds)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per function (default 7)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # host work is one thread; CPU ops of several threads time the other processes
    gpu = args.device != "cpu"
    ex = _experts(args.device)
    if not gpu:
        print(f"run_pipeline with no-op kernels: {framework(ex, args.reps):.1f} us per call")
    for path, (backend, sm90) in PATHS.items():
        if gpu and path == "cutlass-sm100":
            continue  # the SM100/SM120 stage set does not run on this GPU
        with contextlib.nullcontext() if gpu else stubbed_launches(sm90=sm90):
            rows = {M: components(ex, backend, M, args.reps, args.device, args.rounds) for M in TOKENS}
            if args.profile == path:
                x, w, ids, out = _inputs(1, args.device)
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.reps):
                    fused_moe(x, ex, w, ids, backend=backend, out=out, validate=False)
                prof.disable()
        how = f"kernels running on {torch.cuda.get_device_name()}" if gpu else "kernels stubbed"
        print(f"\n{path}: us per call ({how})")
        print(f"  {'component':26s}" + "".join(f"{f'M={M}':>9s}" for M in TOKENS))
        for key in rows[TOKENS[0]]:
            print(f"  {key:26s}" + "".join(f"{rows[M][key]:9.1f}" for M in TOKENS))
        if args.profile == path:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
