"""Tune the Triton backend's launch configurations on one GPU in about four minutes.

On the H200, from the repository root::

    PYTHONPATH=. python benchmarks/tune_triton.py OUT_DIR

For the Qwen3-30B-A3B, Llama-4-Scout and DeepSeek-V3-like layers (``moe_fp4.bench.shapes``) at
M in {1, 16, 256, 4096} tokens:

1. Every kernel the run launches is compiled first, in parallel worker processes that only
   compile (``JITFunction.run(warmup=True)``); Triton's cache then serves the timed run.
2. The GEMM operands of every dequantization mode are checked on every (code, scale) pair
   through the GEMM, against the exact reference (each output one product: bit for bit).
3. Per layer and M, every candidate configuration of each stage (quantize, gemm1,
   silu_mul_quantize, gemm2) is checked on its output before it is timed, against
   ``moe_fp4.stages``: quantization bit for bit; GEMM rows of 8 experts against one-expert
   reference GEMMs (norm-relative error <= 2^-8, one bf16 ulp); SiLU-and-mul quantization bytes
   identical across candidates and decoded values within 1e-2 of the reference. Passing
   candidates are timed as ``moe-fp4 bench`` times (``moe_fp4.bench``: CUDA-graph replays with
   a cold L2, median), and the whole ``fused_moe`` with the default tables too (checked against
   the reference backend on up to 64 tokens).
4. A compact table (default and best candidate per stage; the whole forward against the
   2026-11-29 baseline and Marlin) is printed and everything goes to ``OUT_DIR/tune_triton.json``
   after each layer, so a run cut short keeps what it measured.

``--smoke`` runs the same plumbing on a tiny layer in Triton's CPU interpreter (host timings,
not GPU measurements; tests/test_triton_tune.py). The candidates are data
(:data:`GEMM_CANDIDATES`, :data:`QUANT_CANDIDATES`); the winners go into ``GEMM_CONFIGS`` /
``QUANT_CONFIGS`` of ``triton_kernels/gemm.py`` / ``quantize.py``:

* ``exactness`` not ok for ``bits`` but ok for ``float``: the GPU does not keep fp16
  subnormals somewhere; set ``dequant="float"`` in every ``GEMM_CONFIGS`` entry (exact, slower).
* ``GEMM_CONFIGS`` is keyed on rows per expert (``M * topk / E``): the decode entry (<= 4)
  serves M = 1 and 16 here, the middle one (<= 24) M = 256, the last one M = 4096. Per regime,
  take the candidate with the lowest time summed over gemm1 and gemm2 of the three layers.
  ``split_k=0`` is the auto split of ``split_k_for`` (``-kA`` in the names); if ``-k1`` wins,
  set 1 or retune ``split_k_for``.
* ``QUANT_CONFIGS`` is keyed on routed rows ``n = M * topk``: 8 / 128 / 2048 / 32768 for
  Qwen3 and DeepSeek, 1 / 16 / 256 / 4096 for Llama-4-Scout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the spawned compile workers import this file too
    sys.path.insert(0, str(ROOT))
TIME_LIMIT_S = 210.0  # no new layer or M past this: the run must fit the lead's 4-minute slot
TOKENS = (1, 16, 256, 4096)
SMOKE_TOKENS = (1, 16)

# (rows per expert ranges a candidate is tried at, config fields). Field order as GemmConfig:
# block_m, block_n, block_k, swap_ab, num_warps, num_stages, split_k (0 = auto), dequant.
DECODE, MID, LARGE = "decode", "mid", "large"
GEMM_CANDIDATES: tuple[tuple[str, tuple], ...] = (
    (DECODE, (16, 64, 128, True, 4, 4, 0)),
    (DECODE, (16, 64, 256, True, 4, 3, 0)),
    (DECODE, (16, 128, 128, True, 8, 4, 0)),
    (DECODE, (16, 64, 128, True, 4, 4, 1)),  # the same without split-K
    (DECODE, (16, 64, 128, True, 4, 4, 0, "bits-plain")),  # without the inline-asm multiply
    (DECODE, (16, 64, 128, True, 4, 4, 0, "float")),  # the subnormal-free fallback
    (DECODE, (16, 64, 128, False, 4, 4, 0)),  # mma.sync, activations on the M side
    (MID, (32, 128, 128, True, 4, 3, 1)),
    (MID, (16, 64, 128, True, 4, 4, 0)),
    (MID, (32, 64, 128, True, 4, 4, 1)),
    (MID, (64, 128, 64, False, 4, 4, 1)),
    (MID, (64, 64, 128, True, 4, 3, 1)),
    (LARGE, (128, 128, 64, False, 8, 3, 1)),
    (LARGE, (64, 128, 64, False, 4, 4, 1)),
    (LARGE, (64, 128, 128, False, 4, 3, 1)),
    (LARGE, (128, 256, 64, False, 8, 3, 1)),
    (LARGE, (64, 256, 64, False, 4, 3, 1)),
    (LARGE, (128, 128, 128, False, 8, 3, 1)),
)
# QuantConfig fields: block_r, block_k, num_warps, zero_words.
QUANT_CANDIDATES: tuple[tuple[str, tuple], ...] = (
    (DECODE, (1, 256, 1)),
    (DECODE, (1, 512, 2)),
    (DECODE, (2, 256, 2)),
    (DECODE, (4, 256, 4)),
    (MID, (4, 256, 4)),
    (MID, (8, 256, 4)),
    (MID, (16, 256, 4)),
    (MID, (2, 512, 4)),
    (LARGE, (16, 256, 4)),
    (LARGE, (16, 512, 8)),
    (LARGE, (32, 256, 8)),
    (LARGE, (8, 512, 4)),
)

# The 2026-11-29 H200 run (/work/baseline_bench): whole forward of the Triton backend and of
# Marlin, then Triton's quantize, gemm1, silu_mul_quantize, gemm2; us.
BASELINE_US = {
    ("qwen3-30b-a3b", 1): (128.9, 38.9, 25.1, 55.0, 28.0, 25.5),
    ("qwen3-30b-a3b", 16): (619.2, 113.2, 63.1, 316.4, 72.0, 169.0),
    ("qwen3-30b-a3b", 256): (905.6, 238.3, 73.0, 488.6, 87.3, 253.1),
    ("qwen3-30b-a3b", 4096): (3744.5, 1557.2, 176.6, 2199.6, 160.2, 1160.0),
    ("llama4-scout", 1): (603.7, 63.0, 56.3, 161.8, 237.2, 162.0),
    ("llama4-scout", 16): (1990.0, 307.9, 57.5, 1097.0, 245.9, 598.7),
    ("llama4-scout", 256): (2741.3, 609.8, 62.1, 1553.1, 256.8, 853.9),
    ("llama4-scout", 4096): (11518.1, 4202.2, 75.8, 7461.2, 307.5, 3709.9),
    ("deepseek-v3", 1): (621.3, 102.4, 74.4, 329.1, 65.3, 157.5),
    ("deepseek-v3", 16): (5258.0, 863.3, 202.2, 3230.6, 181.0, 1642.5),
    ("deepseek-v3", 256): (13408.0, 2508.0, 408.9, 8409.2, 373.3, 4206.2),
    ("deepseek-v3", 4096): (36212.8, 13003.1, 766.4, 23170.9, 567.4, 11574.7),
}
_BASELINE_STAGES = ("quantize", "gemm1", "silu_mul_quantize", "gemm2")


def _regime(M: int, shape) -> str:
    per_expert = M * shape.topk / shape.E
    return DECODE if per_expert <= 4 else MID if per_expert <= 24 else LARGE


def _tk():
    from moe_fp4._kernels import load_triton_kernels

    return load_triton_kernels()


def _configs(table_cfg, candidates, make, M: int, shape, smoke: bool) -> list:
    """The table's configuration first, then the distinct candidates of the regime (two in ``smoke``)."""
    configs = [table_cfg]
    regime = _regime(M, shape)
    for where, fields in candidates:
        cfg = make(*fields)
        if where == regime and cfg not in configs:
            configs.append(cfg)
    return configs[:2] if smoke else configs


def gemm_configs(M: int, shape, smoke: bool) -> list:
    tk = _tk()
    return _configs(tk.gemm_config(M * shape.topk, shape.E), GEMM_CANDIDATES, tk.GemmConfig, M, shape, smoke)


def quant_configs(M: int, shape, smoke: bool) -> list:
    tk = _tk()
    return _configs(tk.quant_config(M * shape.topk), QUANT_CANDIDATES, tk.QuantConfig, M, shape, smoke)


def config_name(cfg) -> str:
    """``swap16x64x128-w4s4-kA`` (GEMM) or ``r1k256w1`` (quantization)."""
    if hasattr(cfg, "block_r"):
        return f"r{cfg.block_r}k{cfg.block_k}w{cfg.num_warps}" + ("" if cfg.zero_words == 1024 else f"z{cfg.zero_words}")
    kind = "swap" if cfg.swap_ab else "mma"
    split = "A" if cfg.split_k == 0 else str(cfg.split_k)
    extra = "" if cfg.dequant == "bits" else f"-{cfg.dequant}"
    return f"{kind}{cfg.block_m}x{cfg.block_n}x{cfg.block_k}-w{cfg.num_warps}s{cfg.num_stages}-k{split}{extra}"


# ----------------------------------------------------------------------------- compile warm-up
#
# A launch descriptor is (kind, model, M, fields): the worker rebuilds the call with tensors
# of the layer's shapes (weights as zero-stride views of one expert: only shapes and
# divisibility reach the compiler) and launches it in compile-only mode.


def _descriptors(shapes, tokens, device, smoke) -> list[tuple]:
    """Launches of the run, one per distinct compiled kernel (the key drops what does not specialize)."""
    tk = _tk()
    seen, out = set(), []

    def add(key, desc):
        if key not in seen:
            seen.add(key)
            out.append(desc)

    for shape in shapes:
        for M in tokens:
            n = M * shape.topk
            add(("routing", n, tk.routing_scratch_shape(n, shape.E)[0] > 0, shape.E > 256), ("routing", shape.name, M, None))
            add(("reduce",), ("reduce", shape.name, M, None))
            for cfg in quant_configs(M, shape, smoke):
                for mode in ("quantize", "silu_mul_quantize"):
                    add((mode, cfg), (mode, shape.name, M, dataclasses.astuple(cfg)))
            for stage, N, K, S in (("gemm1", 2 * shape.I, shape.H, 2), ("gemm2", shape.H, shape.I, 1)):
                for cfg in gemm_configs(M, shape, smoke):
                    split = tk.split_k_for(cfg, n, shape.E, N, K, device)
                    resolved = dataclasses.replace(cfg, split_k=1 if split == 1 else 2)
                    add(("gemm", S, resolved), (stage, shape.name, M, dataclasses.astuple(resolved)))
    for cfg in _exactness_configs():
        add(("gemm", 1, cfg), ("exact", "", 0, dataclasses.astuple(cfg)))
    return out


def _warm(descs: list[tuple]) -> list[str]:
    """Worker: compile the launches of ``descs`` without running them; returns the errors."""
    import triton.runtime.jit as jit

    from moe_fp4.bench.shapes import MODELS

    jit.JITFunction.__getitem__ = lambda self, grid: (lambda *a, **k: self.run(*a, grid=grid, warmup=True, **k))
    tk = _tk()
    dev = torch.device("cuda")
    errors = []
    for kind, model, M, fields in descs:
        try:
            if kind == "exact":
                _exactness_launch(tk, tk.GemmConfig(*fields), _exactness_operands(1, 2, "weights"), dev)
                continue
            shape = MODELS[model]
            _launch_shapes(tk, kind, shape, M, fields, dev)
        except Exception as exc:  # noqa: BLE001 - reported; the timed run compiles it itself
            errors.append(f"{kind} {model} M={M} {fields}: {type(exc).__name__}: {str(exc)[:200]}")
    return errors


def _launch_shapes(tk, kind: str, shape, M: int, fields, dev: torch.device) -> None:
    """One launch of ``kind`` with uninitialised tensors of the layer's shapes (for compile-only runs)."""
    from moe_fp4.format import grouped_scale_rows_bound, swizzled_shape

    E, topk, H, I = shape.E, shape.topk, shape.H, shape.I  # noqa: E741
    n = M * topk
    i32, u8, f8, bf16 = torch.int32, torch.uint8, torch.float8_e4m3fn, torch.bfloat16
    r = tk.routing_buffers(n, E, dev)
    if kind == "routing":
        tk.routing(torch.zeros((M, topk), dtype=i32, device=dev), E)
    elif kind == "reduce":
        tk.moe_reduce(torch.empty((n, H), dtype=bf16, device=dev), r.flat_to_slot,
                      torch.empty((M, topk), device=dev), M, bf16)
    elif kind in ("quantize", "silu_mul_quantize"):
        cfg = tk.QuantConfig(*fields)
        gs = torch.ones(E, device=dev)
        if kind == "quantize":
            tk.quantize_rows(torch.empty((M, H), dtype=bf16, device=dev), gs, r.expert_offsets, r.blockscale_offsets,
                             r.slot_to_flat, topk, config=cfg)
        else:
            tk.silu_mul_quantize(torch.empty((n, 2 * I), dtype=bf16, device=dev), gs, r.expert_offsets,
                                 r.blockscale_offsets, config=cfg)
    else:
        N, K, S = (2 * I, H, 2) if kind == "gemm1" else (H, I, 1)
        _, cp = swizzled_shape(1, K // 16)
        np_s, _ = swizzled_shape(N // S, K // 16)
        a = torch.empty((n, K // 2), dtype=u8, device=dev)
        a_sf = torch.empty((grouped_scale_rows_bound(n, E), cp), dtype=f8, device=dev)
        b = torch.empty((1, N, K // 2), dtype=u8, device=dev).expand(E, N, K // 2)
        b_sf = torch.empty((1, S, np_s, cp), dtype=f8, device=dev).expand(E, S, np_s, cp)
        tk.grouped_gemm(a, a_sf, b, b_sf, torch.ones((E, S), device=dev), r.expert_offsets, r.blockscale_offsets,
                        bf16, config=tk.GemmConfig(*fields))


def warm_up(descs: list[tuple], workers: int) -> dict:
    """Compile ``descs`` in ``workers`` spawned processes (round robin); the timed run then hits the cache."""
    t0 = time.time()
    batches = [descs[i::workers] for i in range(workers)]
    errors: list[str] = []
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            for errs in pool.map(_warm, [b for b in batches if b]):
                errors.extend(errs)
    except Exception as exc:  # noqa: BLE001 - the timed run still compiles what it needs
        errors.append(f"warm-up pool failed: {type(exc).__name__}: {exc}")
    return {"launches": len(descs), "workers": workers, "seconds": round(time.time() - t0, 1), "errors": errors}


# ----------------------------------------------------------------------------- exactness


def _exactness_configs() -> list:
    """The table's decode and prefill tiles in every dequantization mode."""
    tk = _tk()
    out = []
    for _, cfg in (tk.GEMM_CONFIGS[0], tk.GEMM_CONFIGS[-1]):
        for mode in tk.DEQUANT_MODES:
            out.append(dataclasses.replace(cfg, dequant=mode, split_k=1))
    return out


def _exactness_operands(code: int, scale: int, side: str):
    """``(a, a_scales, b, b_scales)`` packed/scale-byte rows: every (code, scale) on ``side``, one-hot rows on the other.

    K = 256 (the first 16 elements used): the specializations of the model shapes.
    """
    g = torch.Generator().manual_seed(3)
    codes = torch.zeros(128, 256, dtype=torch.uint8)
    codes[:, :16] = torch.stack([torch.randperm(16, generator=g) for _ in range(128)]).to(torch.uint8)
    every_s = torch.zeros(128, 16, dtype=torch.uint8)
    every_s[:, 0] = torch.arange(128, dtype=torch.uint8)
    every_s[127, 0] = 0x7E  # 0x7F is NaN, never a scale
    hot = torch.zeros(16, 256, dtype=torch.uint8)
    hot[torch.arange(16), torch.arange(16)] = code
    hot_s = torch.zeros(16, 16, dtype=torch.uint8)
    hot_s[:, 0] = scale
    pack = (lambda c: c[:, 0::2] | (c[:, 1::2] << 4))  # noqa: E731
    every, one = (pack(codes), every_s), (pack(hot), hot_s)
    return (*one, *every) if side == "weights" else (*every, *one)


def _exactness_launch(tk, cfg, operands, dev: torch.device):
    """(kernel output, reference) for the operands of :func:`_exactness_operands` (one expert, alpha 1)."""
    from moe_fp4 import stages
    from moe_fp4.format import swizzle_scales_grouped

    a, a_s, b, b_s = operands
    offs = torch.tensor([0, a.shape[0]], dtype=torch.int32)
    a_sf, bso = swizzle_scales_grouped(a_s.view(torch.float8_e4m3fn), offs)
    b_sf = stages.prepare_weight_scales(b_s.view(torch.float8_e4m3fn)[None], 1)
    args = [t.to(dev) for t in (a, a_sf, b[None].contiguous(), b_sf, torch.ones(1, 1), offs, bso)]
    got = tk.grouped_gemm(*args, torch.bfloat16, config=cfg)
    return got, (lambda: stages.grouped_gemm(*args, torch.bfloat16))


def check_exactness(dev: torch.device, smoke: bool) -> list[dict]:
    """Every (code, scale) x {min, 1, max} one-hot, both sides, each dequant mode: mismatching outputs (0 = exact).

    ``smoke``: one configuration, one side, one one-hot (the interpreter is slow; the test suite
    runs the full check there).
    """
    tk = _tk()
    rows = []
    hots = ((1, 0x01),) if smoke else ((1, 0x01), (2, 0x38), (15, 0x7E))
    for cfg in _exactness_configs()[:1] if smoke else _exactness_configs():
        bad = 0
        for side in ("weights",) if smoke else ("weights", "activations"):
            for code, scale in hots:
                got, ref = _exactness_launch(tk, cfg, _exactness_operands(code, scale, side), dev)
                bad += int((got.view(torch.int16) != ref().view(torch.int16)).sum())
        rows.append({"config": config_name(cfg), "mismatched_outputs": bad, "ok": bad == 0})
    return rows


# ----------------------------------------------------------------------------- one layer


def _stage_rows(case, chain, tk, timer, smoke: bool) -> list[dict]:
    """Check and time every candidate of the four tuned stages of one case; rows with ``stage``/``config``."""
    from moe_fp4 import stages
    from moe_fp4.bench.checks import ACT_QUANT_REL_TOL, CheckResult, exact, within
    from moe_fp4.bench.engine import measure
    from moe_fp4.bench.roofline import NVFP4_BITS, gemm_floor
    from moe_fp4.bench.workload import TimedPath, _decoded_grouped

    shape, ex, M = case.shape, case.experts, case.M
    n, dt = M * shape.topk, torch.bfloat16
    r = stages.routing(case.topk_ids, shape.E)
    offs, bso = r.expert_offsets, r.blockscale_offsets
    rows: list[dict] = []

    def run(stage: str, cfgs, call, check, floor=None) -> Any:
        """Time each config; returns the first passing config's output (the next stage's input)."""
        first = None
        for i, cfg in enumerate(cfgs):
            path = TimedPath(f"triton/{stage}", "stage", lambda cfg=cfg: call(cfg), check, floor,
                             NVFP4_BITS if floor is not None else None, stage=stage)
            row = measure(path, timer)
            rows.append({"model": shape.name, "M": M, "stage": stage, "config": config_name(cfg),
                         "default": i == 0, "fields": dataclasses.astuple(cfg), **row})
            if first is None and row.get("status") == "ok":
                first = call(cfg)
        return first

    q_args = (case.x, ex.a13_gs, offs, bso, r.slot_to_flat, shape.topk)
    ref_q = stages.quantize_rows(*q_args)
    qcfgs = quant_configs(M, shape, smoke)
    run("quantize", qcfgs, lambda c: tk.quantize_rows(*q_args, config=c),
        lambda o: exact("quantize", {"packed": (o[0], ref_q[0]), "scales": (o[1], ref_q[1])}))

    def gemm(stage: str, a, b, b_sf, alpha, N: int, K: int):
        args = (*a, b, b_sf, alpha, offs, bso, dt)
        return run(stage, gemm_configs(M, shape, smoke), lambda c: tk.grouped_gemm(*args, config=c),
                   chain._gemm_check(*args[:5], r), gemm_floor(n, N, K, case.n_touched, case.ceilings))

    h = gemm("gemm1", ref_q, ex.w13, chain.b13_sf, chain.alpha13, 2 * shape.I, shape.H)
    if h is None:  # no candidate passed: the next stage takes the reference's output
        h = stages.grouped_gemm(*ref_q, ex.w13, chain.b13_sf, chain.alpha13, offs, bso, dt)
    s_args = (h, ex.a2_gs, offs, bso)
    ref_s = stages.silu_mul_quantize(*s_args)
    firsts: list = []

    def check_silu(o) -> CheckResult:
        # Every candidate computes the same float32 operations: identical bytes. The first
        # (the table's) against the reference: libdevice expf and torch's exp may differ in
        # the last bit, so decoded values within ACT_QUANT_REL_TOL (moe_fp4.bench.checks).
        if firsts:
            return exact("silu_mul_quantize vs the table's configuration", {"packed": (o[0], firsts[0][0]),
                                                                           "scales": (o[1], firsts[0][1])})
        res = within("decoded intermediate vs reference", _decoded_grouped(*o, r), _decoded_grouped(*ref_s, r),
                     ACT_QUANT_REL_TOL)
        if res.ok:
            firsts.append((o[0].clone(), o[1].clone()))
        return res

    a2 = run("silu_mul_quantize", qcfgs, lambda c: tk.silu_mul_quantize(*s_args, config=c), check_silu)
    gemm("gemm2", a2 if a2 is not None else ref_s, ex.w2, chain.b2_sf, chain.alpha2, shape.H, shape.I)
    return rows


def _summary_lines(rows: list[dict], fused: list[dict]) -> list[str]:
    """Per (model, M): whole forward vs baseline and Marlin; per stage the table's config and the best one."""
    lines = [f"{'model':<14} {'M':>5} {'stage':<18} {'table us':>9} {'best us':>9}  best config"
             f"{'':<22} {'base us':>8}"]
    by_case: dict[tuple, list[dict]] = {}
    for r in rows:
        by_case.setdefault((r["model"], r["M"]), []).append(r)
    for f in fused:
        key = (f["model"], f["M"])
        base = BASELINE_US.get(key)
        us = f.get("us")
        ratio = f" ({base[0] / us:.1f}x baseline, {base[1] / us:.2f}x marlin)" if base and us else ""
        lines.append(f"{key[0]:<14} {key[1]:>5} {'fused_moe':<18} {us if us is None else f'{us:9.1f}'}"
                     f"{'':>10}  {f.get('status')}{ratio}")
        for i, stage in enumerate(_BASELINE_STAGES):
            cand = [r for r in by_case.get(key, []) if r["stage"] == stage]
            ok = [r for r in cand if r.get("status") == "ok"]
            table = next((r for r in cand if r["default"]), None)
            best = min(ok, key=lambda r: r["us"]) if ok else None
            t_us = f"{table['us']:9.1f}" if table and table.get("us") else f"{'FAIL' if table else '-':>9}"
            b_us = f"{best['us']:9.1f}" if best else f"{'-':>9}"
            name = best["config"] if best else ""
            lines.append(f"{'':<14} {'':>5} {stage:<18} {t_us} {b_us}  {name:<33} "
                         f"{base[2 + i] if base else '':>8}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--smoke", action="store_true", help="a tiny layer in Triton's CPU interpreter (plumbing only)")
    parser.add_argument("--models", default=None, help="comma-separated subset of moe_fp4.bench.shapes.MODELS")
    parser.add_argument("--tokens", default=None, help="comma-separated subset of M values")
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                        help="compile worker processes (0: compile in the timed run)")
    args = parser.parse_args(argv)
    t_start = time.time()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton creates the kernels
    from moe_fp4.backends import triton as tb
    from moe_fp4.bench.engine import environment, measure, release
    from moe_fp4.bench.roofline import Ceilings
    from moe_fp4.bench.shapes import MODELS, ModelShape
    from moe_fp4.bench.timing import GpuTimer, WallTimer
    from moe_fp4.bench.workload import Case, StageChain, random_experts

    tk = tb._kernels()
    if args.smoke:
        dev = torch.device("cpu")
        shapes = [ModelShape("smoke", E=5, topk=2, H=128, I=64)]
        tokens = SMOKE_TOKENS
        timer = WallTimer(reps=1)
    else:
        if not torch.cuda.is_available():
            print("tune_triton.py needs a CUDA GPU (or --smoke for the CPU interpreter)", file=sys.stderr)
            return 2
        dev = torch.device("cuda", torch.cuda.current_device())
        shapes = [MODELS[m] for m in (args.models.split(",") if args.models else MODELS)]
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else TOKENS
        timer = GpuTimer(dev, budget_s=0.04, min_reps=5, max_reps=40)
    # Nominal H200 ceilings for the % roofline columns (measuring them costs seconds).
    ceilings = Ceilings(copy_tbps=4.25, stream_tbps=4.46, bf16_tflops=679.0)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out_path = args.out_dir / "tune_triton.json"
    report: dict[str, Any] = {"meta": environment(dev), "method": timer.description, "smoke": args.smoke,
                              "gemm_table": [[b, config_name(c)] for b, c in tk.GEMM_CONFIGS],
                              "quant_table": [[b, config_name(c)] for b, c in tk.QUANT_CONFIGS],
                              "warm_up": None, "exactness": [], "stages": [], "fused": [], "skipped": []}

    def save() -> None:
        report["elapsed_s"] = round(time.time() - t_start, 1)
        out_path.write_text(json.dumps(report, indent=1, default=str) + "\n")

    if dev.type == "cuda" and args.workers > 0:
        report["warm_up"] = warm_up(_descriptors(shapes, tokens, dev, False), args.workers)
        print(f"warm-up: {report['warm_up']['launches']} launches compiled in {report['warm_up']['seconds']} s "
              f"({len(report['warm_up']['errors'])} errors)", flush=True)
    report["exactness"] = check_exactness(dev, args.smoke)
    print("exactness (every code x scale through the GEMM): "
          + ", ".join(f"{r['config']}={'ok' if r['ok'] else 'FAIL'}" for r in report["exactness"]), flush=True)
    save()
    for shape in shapes:
        experts = random_experts(shape, dev, seed=0)
        for M in tokens:
            if time.time() - t_start > TIME_LIMIT_S:
                report["skipped"].append([shape.name, M])
                continue
            case = Case(shape, experts, M, ceilings, seed=0, check_tokens=64)
            chain = StageChain(case, "triton", tb)
            report["stages"].extend(_stage_rows(case, chain, tk, timer, args.smoke))
            report["fused"].append({"model": shape.name, "M": M, **measure(case.backend_path("triton", None), timer)})
            print(f"{shape.name} M={M}: fused {report['fused'][-1].get('us')} us ({time.time() - t_start:.0f} s)",
                  flush=True)
            save()
            del case, chain
            release(dev)
        del experts
        release(dev)
    print("\n".join(_summary_lines(report["stages"], report["fused"])))
    # Wrong results anywhere, or a default (table) path that did not run, fail the run; a
    # candidate that cannot launch here (e.g. out of shared memory) is only a row.
    wrong = [r for r in report["stages"] if r.get("status") == "failed" or (r["default"] and r.get("status") != "ok")]
    wrong += [r for r in report["fused"] if r.get("status") != "ok"] + [r for r in report["exactness"] if not r["ok"]]
    report["wrong"] = wrong
    save()
    errors = sum(r.get("status") == "error" for r in report["stages"])
    print(f"wrote {out_path}: {len(report['stages'])} stage rows, {len(wrong)} wrong or failing defaults, "
          f"{errors} candidates that could not run, {report['elapsed_s']} s", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
