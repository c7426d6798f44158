"""Sweep the launch configurations of the Triton values GEMM (``STAGES_VALUES``) on one GPU.

On the H200, from the repository root::

    PYTHONPATH=. python benchmarks/sweep_triton_values.py OUT.json [--models qwen3-30b-a3b] [--tokens 1,16,256]

``tune_triton.py`` tunes the codes GEMM only (its exactness checks and compile warm-up build
canonical codes operands). This sweep times the values GEMM the way ``moe-fp4 bench`` times
its stage rows: per layer and M, the values stage chain (``moe_fp4.bench.workload.StageChain``
of ``STAGES_VALUES``: every stage checked against the reference on the same arguments, the
GEMM rows within one bf16 ulp of one-expert reference GEMMs) is recorded once per candidate
configuration, pinned for both GEMMs (``pinned_gemm_config``), and its gemm1 and gemm2 paths
are timed (CUDA-graph replays, cold L2, median), with the chain's SiLU-and-mul quantization
stage, and the first GEMM with that quantization fused into its epilogue (what a values plan
runs: ``grouped_gemm_launcher(..., silu=)``), checked byte for byte against the two launches
(row ``gemm1+silu``). The first candidate of each M is the table's row (``gemm_config`` without the
GEMM's N and K, so none of the row's alternatives for a GEMM's shape, which a plan may launch instead). A
candidate that fails its check is a row with ``status`` failed; one that cannot launch (shared
memory) a row with the error. Writes ``OUT.json`` after each M and a table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from tune_triton import config_name as name  # noqa: E402  (the tuner's configuration names)

# GemmConfig fields: block_m, block_n, block_k, swap_ab, num_warps, num_stages, split_k (0 = auto).
CANDIDATES = {
    "decode": ((16, 64, 256, True, 4, 3, 0), (16, 64, 128, True, 4, 4, 0), (16, 128, 128, True, 8, 4, 0),
               (16, 64, 256, True, 4, 4, 0), (16, 64, 512, True, 4, 2, 0)),
    # The last two of "mid" and "wide": deeper rings of the swap-AB tiles (more bytes in flight), added
    # for DeepSeek-V3 M=256-1024 (K = 7168; 0.88-0.89x Marlin in the ninth session), not yet timed.
    "mid": ((32, 64, 128, True, 4, 4, 1), (16, 64, 128, True, 4, 4, 0), (32, 64, 256, True, 4, 3, 1),
            (32, 128, 128, True, 4, 3, 1), (64, 64, 128, True, 4, 3, 1), (32, 128, 128, True, 4, 4, 1),
            (16, 128, 128, True, 4, 5, 0)),
    "wide": ((64, 128, 128, False, 4, 3, 1), (64, 128, 64, False, 4, 4, 1), (64, 64, 128, True, 4, 3, 1),
             (64, 128, 256, False, 4, 2, 1), (128, 128, 128, False, 8, 3, 1), (64, 64, 128, True, 4, 4, 1),
             (32, 128, 128, True, 4, 4, 1)),
    "large": ((128, 128, 128, False, 8, 3, 1), (128, 128, 64, False, 8, 4, 1), (128, 256, 64, False, 8, 3, 1),
              (64, 128, 64, False, 4, 4, 1), (128, 128, 128, False, 8, 4, 1), (64, 256, 64, False, 4, 3, 1),
              (128, 128, 256, False, 8, 2, 1)),
}

# The dense GEMM (GemmConfig.dense_mib: weights dequantized into an fp16 scratch of at most that many MiB,
# then an fp16 x fp16 GEMM), timed with --dense in place of the regime's list: tiles of the plain fp16
# GEMM and three chunk sizes (64 MiB: a chunk's weights about the L2's size).
# Fields as above, then dequant and dense_mib.
DENSE_CANDIDATES = (
    (128, 128, 64, False, 8, 4, 1, "bits", 1024), (128, 128, 64, False, 4, 4, 1, "bits", 1024),
    (128, 256, 64, False, 8, 3, 1, "bits", 1024), (64, 128, 64, False, 4, 4, 1, "bits", 1024),
    (64, 256, 64, False, 4, 4, 1, "bits", 1024), (128, 64, 64, False, 4, 4, 1, "bits", 1024),
    (128, 128, 64, False, 8, 4, 1, "bits", 256), (128, 128, 64, False, 8, 4, 1, "bits", 64),
)


def regime(rows_per_expert: float) -> str:
    """The candidate list for ``M * topk / E`` rows per expert (the table's breakpoints 4 / 24 / 96)."""
    return ("decode" if rows_per_expert <= 4 else "mid" if rows_per_expert <= 24
            else "wide" if rows_per_expert <= 96 else "large")


# The values form's quantization stages (QuantConfig fields: block_r, block_k, num_warps, zero_words,
# whole_blocks), timed with --quant against the values form's table (QUANT_VALUES_CONFIGS, from this sweep's
# 2026-12-05 run; before it QUANT_CONFIGS, tuned on the codes form's bytes, served both forms). The whole-block
# candidates (one thread per 16-element block, about half the instructions: benchmarks/README.md, twenty-third
# session) hold one block per thread in (1, 512, 1), four in (4, 1024, 2) and (8, 1024, 4) (fewer
# instructions per element, 102-197 registers instead of 56-102), two in the others.
QUANT_CANDIDATES = ((1, 256, 1), (4, 256, 4), (8, 256, 4), (16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 8),
                    (4, 1024, 4), (2, 512, 2),
                    (1, 512, 1, 1024, True), (2, 512, 1, 1024, True), (4, 512, 2, 1024, True),
                    (4, 256, 2, 1024, True), (8, 256, 2, 1024, True), (8, 512, 4, 1024, True), (4, 1024, 4, 1024, True),
                    (16, 512, 8, 1024, True), (8, 1024, 8, 1024, True), (4, 1024, 2, 1024, True),
                    (8, 1024, 4, 1024, True))


def quant_paths(case, cfg, tk):
    """The values form's two quantization stages with ``cfg`` pinned (``QuantConfig``), on the case's routed
    rows, each checked byte for byte against the format core's stage on the same inputs."""
    from moe_fp4 import stages as ref
    from moe_fp4.backends.triton import STAGES_VALUES as sv
    from moe_fp4.bench.checks import exact
    from moe_fp4.bench.workload import TimedPath
    from moe_fp4.buffers import Quantized

    ex, dt, dev = case.experts, case.x.dtype, case.x.device
    E, H, I = ex.sizes()  # noqa: E741
    r = sv.routing(case.topk_ids, E)
    n = r.num_slots
    # The format core's values (exact in any 16-bit dtype: at most 6 significant bits) as the fp16 the
    # values form writes.
    want_a1 = ref.quantize_rows(case.x, ex.a13_gs, r, out=Quantized.empty(n, H, E, dev, values=dt)).values.half()
    h = (torch.randn(n, 2 * I, generator=torch.Generator().manual_seed(5)) / 4).to(dt).to(dev)
    want_a2 = ref.silu_mul_quantize(h, ex.a2_gs, r, out=Quantized.empty(n, I, E, dev, values=dt)).values.half()
    valid = int(r.expert_offsets[-1])  # setup, not timed

    def first():
        return sv.quantize_rows(case.x, ex.a13_gs, r, config=cfg).values

    def second():
        return sv.silu_mul_quantize(h, ex.a2_gs, r, config=cfg).values

    return [TimedPath("triton-values/quantize", "stage", first,
                      lambda o: exact("quantize vs the format core", o[:valid], want_a1[:valid]),
                      provider="triton-values", stage="quantize"),
            TimedPath("triton-values/silu_mul_quantize", "stage", second,
                      lambda o: exact("silu_mul_quantize vs the format core", o[:valid], want_a2[:valid]),
                      provider="triton-values", stage="silu_mul_quantize")]


def parse_fields(text: str) -> list[tuple]:
    """``--fields``: candidates as GemmConfig or QuantConfig field tuples (ints, T/F for swap_ab and
    whole_blocks, the dequant mode as it is)."""
    def one(f: str):
        return {"T": True, "F": False}.get(f, int(f) if f.isdigit() else f)
    return [tuple(one(f) for f in c.split(",")) for c in text.split(";") if c]


def fused_gemm1_path(case, cfg, tk):
    """The values plan's first GEMM with the SiLU-and-mul quantization in its epilogue, on the case's
    routed rows, checked against the unfused GEMM and quantization stage (the same bytes for every
    routed row); None where ``cfg`` cannot fuse."""
    from moe_fp4.backends.triton import STAGES_VALUES as sv
    from moe_fp4.bench.checks import exact
    from moe_fp4.bench.workload import TimedPath

    ex, dt = case.experts, case.x.dtype
    w13, _ = sv.weights(ex)
    if not tk.silu_fusable(cfg, True, w13.N, w13.scales.shape[1]):
        return None
    r = sv.routing(case.topk_ids, ex.num_experts)
    a1 = sv.quantize_rows(case.x, ex.a13_gs, r)
    ref = sv.silu_mul_quantize(sv.grouped_gemm(a1, w13, r, dt, config=cfg), ex.a2_gs, r).values
    valid = int(r.expert_offsets[-1])  # setup, not timed
    out = torch.empty_like(ref)
    numel = tk.partials_numel(cfg, a1.rows, w13.E, w13.N, w13.K, case.x.device)
    partials = torch.empty(numel, device=case.x.device) if numel else None
    launch = tk.grouped_gemm_launcher(a1.values, None, w13.packed, w13.scales, w13.alpha, r.expert_offsets,
                                      r.blockscale_offsets, out, cfg, partials, silu=(ex.a2_gs, dt))

    def fn():
        launch()
        return out

    return TimedPath("triton-values/gemm1+silu", "stage", fn,
                     lambda o: exact("gemm1+silu vs the GEMM and the quantization stage", o[:valid], ref[:valid]),
                     provider="triton-values", stage="gemm1+silu")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--models", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,16,256,1024,4096")
    p.add_argument("--budget-ms", type=float, default=10.0)
    p.add_argument("--dense", action="store_true", help="time DENSE_CANDIDATES instead of the regime's candidates")
    p.add_argument("--no-fused", action="store_true", help="skip the gemm1+silu rows")
    p.add_argument("--quant", action="store_true", help="time the values form's quantization stages over "
                   "QUANT_CANDIDATES (or --fields as QuantConfig fields) instead of the GEMMs")
    p.add_argument("--fields", default="", help="candidates instead of a list: GemmConfig fields, comma-separated "
                   "(T/F for swap_ab), ';' between candidates, e.g. 128,256,64,F,8,3,1,bits,1024")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_triton_values.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from moe_fp4.backends.triton import STAGES_VALUES, kernels, pinned_gemm_config
    from moe_fp4.bench.engine import environment, measure, release
    from moe_fp4.bench.roofline import Ceilings
    from moe_fp4.bench.shapes import MODELS
    from moe_fp4.bench.timing import GpuTimer
    from moe_fp4.bench.workload import Case, StageChain, random_experts

    tk = kernels()
    dev = torch.device("cuda", torch.cuda.current_device())
    timer = GpuTimer(dev, budget_s=args.budget_ms / 1e3, min_reps=5, max_reps=60)
    ceilings = Ceilings(copy_tbps=4.25, stream_tbps=4.46, bf16_tflops=679.0)  # nominal H200 (% roofline only)
    report = {"meta": environment(dev), "method": timer.description, "rows": []}
    t0 = time.time()
    for model in args.models.split(","):
        shape = MODELS[model]
        experts = random_experts(shape, dev, seed=0)
        for M in (int(t) for t in args.tokens.split(",")):
            case = Case(shape, experts, M, ceilings, seed=0, check_tokens=64)
            if args.quant:
                # the values form's gather table first (the rows marked ``table``), then its SiLU table's
                table = tk.quant_config(M * shape.topk, values=True)
                silu = tk.quant_config(M * shape.topk, values=True, silu=True)
                fields = parse_fields(args.fields) if args.fields else QUANT_CANDIDATES
                cfgs = [table] + [c for c in (silu, *(tk.QuantConfig(*f) for f in fields)) if c != table]
                cfgs = list(dict.fromkeys(cfgs))
            else:
                # the values table's row (without N and K: none of its alternatives for a GEMM's shape)
                table = tk.gemm_config(M * shape.topk, shape.E, True)
                fields = (parse_fields(args.fields) if args.fields else DENSE_CANDIDATES if args.dense
                          else CANDIDATES[regime(M * shape.topk / shape.E)])
                cfgs = [table] + [c for c in (tk.GemmConfig(*f) for f in fields) if c != table]
            for i, cfg in enumerate(cfgs):
                with contextlib.nullcontext() if args.quant else pinned_gemm_config(cfg):
                    try:
                        if args.quant:
                            paths = quant_paths(case, cfg, tk)
                        else:
                            paths = [q for q in StageChain(case, "triton-values", STAGES_VALUES).paths()
                                     if q.stage in ("gemm1", "silu_mul_quantize", "gemm2")]
                        if not args.no_fused and not args.quant:
                            paths += [q for q in (fused_gemm1_path(case, cfg, tk),) if q is not None]
                        rows = [measure(q, timer) for q in paths]
                    except Exception as exc:  # noqa: BLE001 - a row that says why
                        rows = [{"stage": "both", "status": "error", "note": f"{type(exc).__name__}: {exc}"[:300]}]
                for r in rows:
                    r.update(model=model, M=M, config=name(cfg), table=i == 0, fields=dataclasses.astuple(cfg))
                    report["rows"].append(r)
                    print(f"{model} M={M} {r.get('stage')} {name(cfg)}{' (table)' if i == 0 else ''}: "
                          f"{r.get('us', '-')} us {r.get('status')} {r.get('note', '')[:120]}", flush=True)
            args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
            del case
            release(dev)
        del experts
        release(dev)
    print("\nbest per (model, M, gemm): table us -> best us (config)")
    keys = sorted({(r["model"], r["M"], r.get("stage")) for r in report["rows"]}, key=lambda k: (k[0], k[1], str(k[2])))
    for k in keys:
        rs = [r for r in report["rows"] if (r["model"], r["M"], r.get("stage")) == k]
        ok = [r for r in rs if r.get("status") == "ok"]
        tab = next((r for r in rs if r["table"]), None)
        best = min(ok, key=lambda r: r["us"]) if ok else None
        print(f"{k[0]} M={k[1]} {k[2]}: {tab and tab.get('us')} -> {best and best['us']} ({best and best['config']})")
    report["elapsed_s"] = round(time.time() - t0, 1)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
