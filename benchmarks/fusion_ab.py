"""The plans' launch fusions, on and off, timed against each other in one process.

    PYTHONPATH=. python benchmarks/fusion_ab.py [--backend triton|cutlass] [--models qwen3-30b-a3b,...]
                                                [--tokens 1,4,16,64] [--rounds 3]

``--backend cutlass`` (compute capability 9.x): a plan on sm_90a routes and quantizes in one
launch (``moe_fp4_routing_quantize_values``) up to ``cutlass.FUSED_ROUTING_MAX`` slots and runs its
first GEMM with SiLU-and-mul in the epilogue (``moe_fp4_sm90_gemm_silu``) where ``cutlass.fuses_silu``
(at most 4 rows per expert); variants ``fused`` (both, the routing up to the library's limit, 256
slots), ``no-silu`` (the routing fusion alone) and ``unfused`` (neither). The
rest of this text is about the Triton backend (the default).

A values plan (``STAGES_VALUES``) can fuse three pairs of launches: at decode (``M * topk <=
FUSED_ROUTING_MAX``) the routing with the first quantization (``routing_quantize_kernel``, on by
default); with ``FUSE_SILU`` (off by default since this A/B) where the GEMM's configuration allows
(``silu_fusable``), the SiLU-and-mul quantization into the first GEMM's epilogue (or its split-K
reduce's); and with ``FUSE_TOPK_REDUCE`` (on by default since the twenty-fourth session's A/B; any plan,
codes too) where
the second GEMM splits K, its split-K reduce with the top-k reduce. The benchmark's stage rows time
the stages unfused, so only a whole-forward A/B shows what the fusions are worth. Variants:

- ``fused``: all three;
- ``silu-split``: all three, the SiLU-and-mul quantization only where the first GEMM splits K
  (``FUSE_SILU = "split"``);
- ``topk``: the routing and top-k fusions (what a plan runs by default);
- ``no-route``: the SiLU and top-k fusions, the routing and the first quantization as two launches;
- ``no-silu``: the routing fusion alone (what a plan ran by default before ``FUSE_TOPK_REDUCE``);
- ``unfused``: none;
- with ``--routing-small-max N`` also ``small-N``: the default plan, the routing one launch up to N
  flat indices (``routing.SMALL_MAX``, 256, is three launches past it);
- with ``--fused-routing-max N`` also ``route-N``: the default plan, the routing and the first quantization
  one launch up to N flat indices (``quantize.FUSED_ROUTING_MAX``, 64);
- ``split-in-gemm``, ``topk-in-gemm``, ``in-gemm``: the default plan with ``FUSE_SPLIT_K_IN_GEMM`` (a split first
  GEMM adds its own K ranges: no ``split_k_reduce`` launch), ``FUSE_TOPK_IN_GEMM`` (the second GEMM takes the
  top-k reduce, and its own K ranges' sum where it splits, up to ``TOPK_IN_GEMM_MAX`` flat indices: no
  reduce launch after it), or both; with ``--in-gemm-max N`` also ``in-gemm-N``: both, the top-k reduce in the
  GEMM up to N flat indices; ``in-gemm-silu``: both and ``FUSE_SILU = "split"``, so that a split first GEMM's
  last K ranges also take the SiLU-and-mul quantization (a decode forward of three launches); with
  ``--decode-max N`` also ``decode-N``: every decode fusion up to N flat indices, ``in-gemm-silu`` with the
  routing and the first quantization one launch and the top-k reduce in the GEMM both up to N;
- with ``--values-tile BOUND:FIELDS`` (repeatable) also ``tile-BOUND-NAME``: the default plan with the values
  table's row of ``BOUND`` rows per expert (4, 8, 24, 96, 256 or inf) set to ``GemmConfig(*FIELDS)`` (as
  ``sweep_triton_values.py --fields`` spells one: ``16,64,256,T,4,3,0``; NAME as ``tune_triton.config_name``);
  a launch table candidate timed in the whole forward (a row keeps its alternatives for a GEMM's shape:
  at 9-24 rows the long-K tile and the narrow fallback, at 25-96 rows the 64-token tile; ``gemm.gemm_config``).
  Not a fusion either: another tile may add the float32
  sums in another order (the largest difference is printed as for ``short-k``);
- with ``--values-long-k-min N`` also ``long-k-N``: the default plan with ``gemm.VALUES_LONG_K_MIN = N`` (the values
  table's 9-16 rows take the decode tile from a K of N on; a large N: never). Not a fusion either (as ``tile-``);
- ``no-wide-rows``: the default plan without ``gemm.VALUES_WIDE_ROWS`` (the values table's 25-96 rows on a 64-token
  swap tile where the grid is not small and K not short). Not a fusion either;
- ``short-k``: the default plan without the long-K split (``gemm.LONG_K_SPLIT = False``). Not a fusion:
  where it changes a GEMM's K ranges the float32 sums are added in another order, so its output may
  differ from the others' in the last bits (the A/B prints its largest difference relative to the
  output's largest magnitude).

``--variants`` times a subset (``unfused`` is always run: the outputs are compared against it; so are the
``--values-tile`` and ``--values-long-k-min`` variants).

Each variant gets its own copy of the experts (plans are kept per experts object), its output is
checked bit for bit against ``unfused``'s (the fusions write the same bytes), and the whole
forward ``fused_moe(backend="triton", validate=False)`` is timed the way ``moe-fp4 bench`` times
it (CUDA-graph replays, cold L2, median), the variants taking turns over ``--rounds`` rounds (the
best median of each is reported). The GPU time only: the host time a variant saves is
``host_trace.py``'s to show.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from pathlib import Path
from unittest import mock

import torch

import moe_fp4.backends.cutlass as cb
import moe_fp4.backends.triton as tb
from moe_fp4 import _native, fused_moe
from moe_fp4.bench.ep import layer_inputs
from moe_fp4.bench.shapes import MODELS
from moe_fp4.bench.timing import GpuTimer
from moe_fp4.bench.workload import random_experts
from moe_fp4.triton_kernels import gemm as tg
from moe_fp4.triton_kernels import quantize as tq

tr = importlib.import_module("moe_fp4.triton_kernels.routing")  # (the package's `routing` is the function)

VARIANTS = ("fused", "silu-split", "topk", "no-route", "no-silu", "unfused", "short-k", "split-in-gemm",
            "topk-in-gemm", "in-gemm", "in-gemm-silu", "no-wide-rows")
CUTLASS_VARIANTS = ("fused", "no-silu", "unfused")
# The --values-tile variants: name -> (the values table's row bound, the configuration it takes).
TILE_VARIANTS: dict[str, tuple[float, tg.GemmConfig]] = {}


def tile_variant(spec: str) -> str:
    """Registers the ``--values-tile`` variant ``BOUND:FIELDS`` and returns its name."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sweep_triton_values import parse_fields
    from tune_triton import config_name

    bound_text, _, fields = spec.partition(":")
    bound = float(bound_text)
    if bound not in {b for b, _ in tg.GEMM_VALUES_CONFIGS}:
        raise ValueError(f"--values-tile: expected a row bound of the values table "
                         f"{[b for b, _ in tg.GEMM_VALUES_CONFIGS]}, got {bound_text!r}")
    (one,) = parse_fields(fields)
    cfg = tg.GemmConfig(*one)
    name = f"tile-{bound_text}-{config_name(cfg)}"
    TILE_VARIANTS[name] = (bound, cfg)
    return name


@contextlib.contextmanager
def cutlass_variant(name: str):
    """The cutlass plans bound inside route and quantize in one launch up to 256 slots (``fused``, ``no-silu``)
    or never, and run the first GEMM with SiLU-and-mul where it is built (``fused``) or never."""
    saved = cb.FUSED_ROUTING_MAX, cb.FUSE_SILU
    cb.FUSED_ROUTING_MAX = _native.ROUTING_QUANTIZE_MAX_SLOTS if name != "unfused" else 0
    cb.FUSE_SILU = name == "fused"
    try:
        yield
    finally:
        cb.FUSED_ROUTING_MAX, cb.FUSE_SILU = saved


def _table_change(name: str) -> tuple[str, object] | None:
    """``(setting of triton_kernels.gemm, value)`` of a variant that changes the launch table, else None."""
    if name == "no-wide-rows":
        return "VALUES_WIDE_ROWS", False
    if name.startswith("long-k-"):
        return "VALUES_LONG_K_MIN", int(name[len("long-k-"):])
    if name in TILE_VARIANTS:
        bound, cfg = TILE_VARIANTS[name]
        return "GEMM_VALUES_CONFIGS", tuple((b, cfg if b == bound else c) for b, c in tg.GEMM_VALUES_CONFIGS)
    return None


@contextlib.contextmanager
def variant(name: str):
    """The plans bound inside take the fusions of ``name`` (the switches they read when bound);
    ``small-N``: the default plan with the single-program routing up to N flat indices; ``route-N``: with
    the fused routing and first quantization up to N; ``short-k``: without the long-K split; ``split-in-gemm``,
    ``topk-in-gemm``, ``in-gemm``, ``in-gemm-silu`` and ``in-gemm-N``: the reduces in the GEMMs' launches;
    ``decode-N``: every decode fusion up to N flat indices; ``long-k-N``: the values table's long-K tile from
    a K of N on; ``no-wide-rows``: without its 25-96 rows' 64-token tile; ``tile-...``: the default plan with
    one row of the values table changed (:data:`TILE_VARIANTS`)."""
    change = _table_change(name)
    if change is not None:  # the default plan with one setting of the launch table changed
        with mock.patch.object(tg, *change):
            yield
        return
    saved = (tq.FUSED_ROUTING_MAX, tb.FUSE_SILU, tb.FUSE_TOPK_REDUCE, tr.SMALL_MAX, tg.LONG_K_SPLIT,
             tb.FUSE_SPLIT_K_IN_GEMM, tb.FUSE_TOPK_IN_GEMM, tb.TOPK_IN_GEMM_MAX)
    in_gemm = name.startswith("in-gemm")
    decode = name.startswith("decode-")
    tb.FUSE_SILU = "split" if name in ("silu-split", "in-gemm-silu") or decode else name in ("fused", "no-route")
    tb.FUSE_TOPK_REDUCE = (name in ("fused", "silu-split", "topk", "no-route", "short-k", "split-in-gemm",
                                    "topk-in-gemm")
                           or name.startswith(("small-", "route-", "in-gemm", "decode-")))  # (the default plan's)
    tg.LONG_K_SPLIT = name != "short-k"
    tb.FUSE_SPLIT_K_IN_GEMM = name == "split-in-gemm" or in_gemm or decode
    tb.FUSE_TOPK_IN_GEMM = name == "topk-in-gemm" or in_gemm or decode
    if decode:
        tb.TOPK_IN_GEMM_MAX = tq.FUSED_ROUTING_MAX = int(name[len("decode-"):])
    if name.startswith("in-gemm-") and name != "in-gemm-silu":
        tb.TOPK_IN_GEMM_MAX = int(name[len("in-gemm-"):])
    if name in ("no-route", "unfused"):
        tq.FUSED_ROUTING_MAX = 0
    if name.startswith("small-"):
        tr.SMALL_MAX = int(name[len("small-"):])
    if name.startswith("route-"):
        tq.FUSED_ROUTING_MAX = int(name[len("route-"):])
    try:
        yield
    finally:
        (tq.FUSED_ROUTING_MAX, tb.FUSE_SILU, tb.FUSE_TOPK_REDUCE, tr.SMALL_MAX, tg.LONG_K_SPLIT,
         tb.FUSE_SPLIT_K_IN_GEMM, tb.FUSE_TOPK_IN_GEMM, tb.TOPK_IN_GEMM_MAX) = saved


def kernel_timeline(forward, replays: int = 20) -> str:
    """The kernels of one ``forward`` (a bound plan: the same kernels every call) captured in a CUDA graph
    and replayed under torch.profiler: per kernel, in launch order, its mean start after the forward's
    first kernel's start and its mean duration (µs)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.elapsed_us() > 0), key=lambda e: e.time_range.start)
    if not kernels or len(kernels) % replays:
        return f"(the profiler saw {len(kernels)} kernels in {replays} replays)"
    per = len(kernels) // replays
    parts = []
    for i in range(per):
        starts = [kernels[r * per + i].time_range.start - kernels[r * per].time_range.start for r in range(replays)]
        durs = [kernels[r * per + i].time_range.elapsed_us() for r in range(replays)]
        name = kernels[i].name.replace("(anonymous namespace)::", "").replace("void ", "")
        name = name.split("<")[0].split("(")[0].split("::")[-1]
        parts.append(f"{name} @{sum(starts) / replays:.1f}+{sum(durs) / replays:.1f}")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("--models", "qwen3-30b-a3b"), ("--tokens", "1,4,16,64")):
        p.add_argument(flag, default=default, help=f"comma-separated (default {default})")
    p.add_argument("--backend", choices=("triton", "cutlass"), default="triton", help="whose plans (default triton)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of turns (default 3)")
    p.add_argument("--timeline", action="store_true", help="also print each variant's kernels in one forward "
                   "(torch.profiler over CUDA-graph replays, warm L2: mean start after the first kernel's and "
                   "mean duration, µs; with programmatic dependent launch a kernel may start before the one "
                   "before it ends, and its duration then includes its wait)")
    p.add_argument("--out", help="also write the rows as JSON here")
    p.add_argument("--routing-small-max", type=int, metavar="N", help="also time variant small-N: the default "
                   "plan with routing.SMALL_MAX = N (one routing launch up to N flat indices instead of three)")
    p.add_argument("--fused-routing-max", type=int, metavar="N", help="also time variant route-N: the default "
                   "plan with quantize.FUSED_ROUTING_MAX = N (the routing and the first quantization one launch up "
                   "to N flat indices)")
    p.add_argument("--in-gemm-max", type=int, metavar="N", help="also time variant in-gemm-N: the default plan "
                   "with both reduces in the GEMMs' launches, the top-k reduce up to N flat indices "
                   "(TOPK_IN_GEMM_MAX)")
    p.add_argument("--decode-max", type=int, metavar="N", help="also time variant decode-N: every decode fusion, "
                   "the routing with the first quantization and the top-k reduce in the GEMM up to N flat indices")
    p.add_argument("--values-tile", action="append", default=[], metavar="BOUND:FIELDS",
                   help="also time variant tile-BOUND-NAME: the default plan with the values table's row of BOUND "
                   "rows per expert set to GemmConfig(FIELDS) (repeatable; e.g. 8:16,64,256,T,4,3,0)")
    p.add_argument("--values-long-k-min", type=int, metavar="N", help="also time variant long-k-N: the default "
                   "plan with gemm.VALUES_LONG_K_MIN = N (the values table's 9-16 rows on the decode tile from a K "
                   "of N on)")
    p.add_argument("--variants", help="comma-separated subset of the variants (default: all; unfused and the "
                   "--values-tile and --values-long-k-min ones always)")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    backend = args.backend
    variants = VARIANTS + ((f"small-{args.routing_small_max}",) if args.routing_small_max else ()) + (
        (f"route-{args.fused_routing_max}",) if args.fused_routing_max else ()) + (
        (f"in-gemm-{args.in_gemm_max}",) if args.in_gemm_max else ()) + (
        (f"decode-{args.decode_max}",) if args.decode_max else ()) + (
        (f"long-k-{args.values_long_k_min}",) if args.values_long_k_min is not None else ()) + tuple(
        tile_variant(spec) for spec in args.values_tile)
    switch = variant
    if backend == "cutlass":
        variants, switch = CUTLASS_VARIANTS, cutlass_variant
    if args.variants:
        wanted = {v.strip() for v in args.variants.split(",") if v.strip()}
        unknown = wanted - set(variants)
        if unknown:
            p.error(f"--variants: unknown {sorted(unknown)}; expected some of {list(variants)}")
        variants = tuple(v for v in variants if v in wanted or v == "unfused" or v in TILE_VARIANTS
                         or v.startswith("long-k-"))
    timer = GpuTimer(device, budget_s=0.02)
    rows = []
    for model in args.models.split(","):
        shape = MODELS[model]
        base = random_experts(shape, device, seed=0)  # the benchmark's weights and inputs
        experts = {v: base if v == "fused" else base.to(device) for v in variants}  # (copies: canonical)
        for M in (int(t) for t in args.tokens.split(",")):  # noqa: N806
            x, w, ids = layer_inputs(shape, M, device, seed=0)
            outs, prepared = {}, {}
            for v in variants:
                out = torch.empty_like(x)
                with switch(v):
                    fused_moe(x, experts[v], w, ids, backend=backend, out=out, validate=False)  # binds the plan
                    prepared[v] = timer.prepare(lambda v=v, out=out: fused_moe(
                        x, experts[v], w, ids, backend=backend, out=out, validate=False))
                outs[v] = out
            best = dict.fromkeys(variants, float("inf"))
            for _ in range(args.rounds):
                for v in variants:
                    best[v] = min(best[v], timer.time(prepared[v]).median_us)
            if args.timeline:
                for v in variants:
                    try:
                        line = kernel_timeline(lambda v=v: fused_moe(x, experts[v], w, ids, backend=backend,
                                                                     out=outs[v], validate=False))
                    except Exception as exc:  # noqa: BLE001 - a profiler problem must not end the A/B
                        line = f"(no timeline: {type(exc).__name__}: {exc})"
                    print(f"  {v}: {line}", flush=True)
            exact = {v: bool(torch.equal(outs[v], outs["unfused"])) for v in variants}
            ref = outs["unfused"].float()
            rel = {v: float((outs[v].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                   for v in variants if not exact[v]}
            row = {"backend": backend, "model": model, "M": M, **{f"{v}_us": best[v] for v in variants},
                   "bitwise_equal_to_unfused": exact, "max_rel_diff_to_unfused": rel}
            rows.append(row)
            print(f"{model:16s} M={M:5d} " + " ".join(f"{v} {best[v]:8.1f}" for v in variants)
                  + ("" if all(exact.values()) else f"  NOT EQUAL: {exact} max rel diff {rel}"), flush=True)
        experts.clear()
        base = None
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
