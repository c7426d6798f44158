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
   baseline and Marlin) is printed and everything goes to ``OUT_DIR/tune_triton.json`` after
   each layer, so a run cut short keeps what it measured.

The baseline is a committed ``moe-fp4 bench`` report: ``--baseline FILE``, by default the
newest one in ``benchmarks/results/`` (the ``*.json`` files there with ``schema`` and
``rows``, newest by ``meta.date``): its Triton whole forward and stages and its Marlin rows.

``--smoke`` runs the same plumbing on a tiny layer in Triton's CPU interpreter (host timings,
not GPU measurements; tests/test_triton_tune.py). The candidates are data
(:data:`GEMM_CANDIDATES`, :data:`QUANT_CANDIDATES`); the winners go into ``GEMM_CONFIGS`` /
``QUANT_CONFIGS`` of ``triton_kernels/gemm.py`` / ``quantize.py``:

* ``exactness`` not ok for ``bits`` but ok for ``float``: the GPU does not keep fp16
  subnormals somewhere; set ``dequant="float"`` in every ``GEMM_CONFIGS`` entry (exact, slower).
* ``GEMM_CONFIGS`` is keyed on rows per expert (``M * topk / E``): here the entry for <= 4
  serves M = 1 and 16, the one for <= 8 DeepSeek-V3 at M = 256, the one for <= 24 the other
  two layers at M = 256, the last one M = 4096. The candidates are tried per regime of
  :func:`_regime` (decode <= 4, mid <= 24, large beyond); per regime, take the candidate with
  the lowest time summed over gemm1 and gemm2 of the three layers.
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
TIME_LIMIT_S = 210.0  # no new layer or M past this, so that the whole run takes about four minutes
TOKENS = (1, 16, 256, 4096)
SMOKE_TOKENS = (1, 16)

DECODE, MID, LARGE = "decode", "mid", "large"  # the rows-per-expert regimes of _regime


def _by_regime(candidates: dict[str, tuple[tuple, ...]]) -> tuple[tuple[str, tuple], ...]:
    """``((regime, config fields), ...)`` from the candidates of each regime."""
    return tuple((regime, fields) for regime, rows in candidates.items() for fields in rows)


# GemmConfig fields: block_m, block_n, block_k, swap_ab, num_warps, num_stages, split_k (0 = auto), dequant.
GEMM_CANDIDATES: tuple[tuple[str, tuple], ...] = _by_regime({
    DECODE: (
        (16, 64, 128, True, 4, 4, 0),
        (16, 64, 256, True, 4, 3, 0),
        (16, 128, 128, True, 8, 4, 0),
        (16, 64, 128, True, 4, 4, 1),  # the same without split-K
        (16, 64, 128, True, 4, 4, 0, "bits-plain"),  # without the inline-asm multiply
        (16, 64, 128, True, 4, 4, 0, "float"),  # the subnormal-free fallback
        (16, 64, 128, False, 4, 4, 0),  # mma.sync, activations on the M side
    ),
    MID: ((32, 128, 128, True, 4, 3, 1), (16, 64, 128, True, 4, 4, 0), (32, 64, 128, True, 4, 4, 1),
          (64, 128, 64, False, 4, 4, 1), (64, 64, 128, True, 4, 3, 1)),
    LARGE: ((128, 128, 64, False, 8, 3, 1), (64, 128, 64, False, 4, 4, 1), (64, 128, 128, False, 4, 3, 1),
            (128, 256, 64, False, 8, 3, 1), (64, 256, 64, False, 4, 3, 1), (128, 128, 128, False, 8, 3, 1)),
})
# QuantConfig fields: block_r, block_k, num_warps, zero_words, whole_blocks. The codes form's table; with whole
# blocks per thread (one or two a thread here) its quantization counts 19-32% fewer static instructions per
# element (benchmarks/README.md, twenty-third session).
QUANT_CANDIDATES: tuple[tuple[str, tuple], ...] = _by_regime({
    DECODE: ((1, 256, 1), (1, 512, 2), (2, 256, 2), (4, 256, 4), (1, 512, 1, 1024, True)),
    MID: ((4, 256, 4), (8, 256, 4), (16, 256, 4), (2, 512, 4), (4, 512, 2, 1024, True)),
    LARGE: ((16, 256, 4), (16, 512, 8), (32, 256, 8), (8, 512, 4), (8, 512, 4, 1024, True), (16, 512, 8, 1024, True)),
})

RESULTS = ROOT / "benchmarks" / "results"
BASELINE_PATHS = ("triton", "marlin", "triton/quantize", "triton/gemm1", "triton/silu_mul_quantize", "triton/gemm2")
_BASELINE_STAGES = ("quantize", "gemm1", "silu_mul_quantize", "gemm2")


def default_baseline(results: Path = RESULTS) -> Path | None:
    """The newest ``moe-fp4 bench`` report in ``results`` (JSON with ``schema`` and ``rows``; by ``meta.date``)."""
    reports = []
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "schema" in data and "rows" in data:
            reports.append((str(data.get("meta", {}).get("date", "")), path.name, path))
    return max(reports)[2] if reports else None


def load_baseline(path: Path) -> dict[tuple[str, int], dict[str, float]]:
    """``{(model, M): {row path: median us}}`` of the :data:`BASELINE_PATHS` rows that ran in report ``path``."""
    data = json.loads(Path(path).read_text())
    out: dict[tuple[str, int], dict[str, float]] = {}
    for row in data["rows"]:
        if row.get("path") in BASELINE_PATHS and row.get("status") == "ok":
            out.setdefault((row["model"], row["M"]), {})[row["path"]] = row["us"]
    return out


def _regime(M: int, shape) -> str:
    per_expert = M * shape.topk / shape.E
    return DECODE if per_expert <= 4 else MID if per_expert <= 24 else LARGE


def _tk():
    """``moe_fp4.triton_kernels`` (imported on first use, after ``--smoke`` has set ``TRITON_INTERPRET``)."""
    from moe_fp4.backends.triton import kernels

    return kernels()


def _stages():
    """The Triton backend's :class:`~moe_fp4.pipeline.StageSet` (``config=`` pins a launch configuration)."""
    from moe_fp4.backends.triton import STAGES

    return STAGES


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
    """``swap16x64x128-w4s4-kA`` (GEMM) or ``r1k256w1`` (quantization; ``-whole`` with whole blocks per thread)."""
    if hasattr(cfg, "block_r"):
        zero = "" if cfg.zero_words == 1024 else f"z{cfg.zero_words}"
        return f"r{cfg.block_r}k{cfg.block_k}w{cfg.num_warps}{zero}{'-whole' if cfg.whole_blocks else ''}"
    kind = "swap" if cfg.swap_ab else "mma"
    split = "A" if cfg.split_k == 0 else str(cfg.split_k)
    extra = (("" if cfg.dequant == "bits" else f"-{cfg.dequant}") + (f"-dense{cfg.dense_mib}" if cfg.dense_mib else "")
             + (f"-r{cfg.maxnreg}" if cfg.maxnreg else ""))
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
            chunked = tk.routing_scratch_numel(n, shape.E) > 0
            add(("routing", n, chunked, shape.E > 256), ("routing", shape.name, M, None))
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
    """One launch of ``kind`` with uninitialised tensors of the layer's shapes (for compile-only runs).

    The GEMM launches its kernel directly, with every expert's weights a zero-stride view of
    one expert's (a WeightOperand holds contiguous weights only); the other stages go through
    the stage functions, as the timed run does.
    """
    from moe_fp4.buffers import Quantized, RoutingData
    from moe_fp4.format import swizzled_shape

    E, topk, H, I = shape.E, shape.topk, shape.H, shape.I
    n = M * topk
    u8, f8, bf16 = torch.uint8, torch.float8_e4m3fn, torch.bfloat16
    stages = _stages()
    r = RoutingData.empty(n, E, dev)
    gs = torch.ones(E, device=dev)
    if kind == "routing":
        stages.routing(torch.zeros((M, topk), dtype=torch.int32, device=dev), E)
    elif kind == "reduce":
        stages.moe_reduce(torch.empty((n, H), dtype=bf16, device=dev), r, torch.empty((M, topk), device=dev), M, bf16)
    elif kind == "quantize":
        stages.quantize_rows(torch.empty((M, H), dtype=bf16, device=dev), gs, r, config=tk.QuantConfig(*fields))
    elif kind == "silu_mul_quantize":
        stages.silu_mul_quantize(torch.empty((n, 2 * I), dtype=bf16, device=dev), gs, r,
                                 config=tk.QuantConfig(*fields))
    else:
        N, K, S = (2 * I, H, 2) if kind == "gemm1" else (H, I, 1)
        cfg = tk.GemmConfig(*fields)
        a = Quantized.empty(n, K, E, dev)
        np_s, cp = swizzled_shape(N // S, K // 16)
        b = torch.empty((1, N, K // 2), dtype=u8, device=dev).expand(E, N, K // 2)
        b_sf = torch.empty((1, S, np_s, cp), dtype=f8, device=dev).expand(E, S, np_s, cp)
        partials = tk.partials_numel(cfg, n, E, N, K, dev)
        tk.grouped_gemm(a.packed, a.scales, b, b_sf, torch.ones((E, S), device=dev), r.expert_offsets,
                        r.blockscale_offsets, torch.empty((n, N), dtype=bf16, device=dev), cfg,
                        torch.empty(partials, device=dev) if partials else None)


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
    """``(a, a_scales, b, b_scales)`` packed/scale-byte rows: every (code, scale) on ``side``, one-hot on the other.

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
    from moe_fp4.buffers import Quantized, RoutingData, WeightOperand
    from moe_fp4.format import swizzle_scales_grouped

    f8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    a, a_s, b, b_s = operands
    m = a.shape[0]
    offs = torch.tensor([0, m], dtype=torch.int32)
    a_sf, bso = swizzle_scales_grouped(a_s.view(f8), offs)
    slots = torch.arange(m, dtype=torch.int32)
    q = Quantized(a.to(dev), a_sf.to(dev))
    w = WeightOperand.build(b[None].contiguous().to(dev), b_s.view(f8)[None].to(dev), torch.ones(1, 1, device=dev))
    r = RoutingData(*(t.to(dev) for t in (offs, bso, slots, slots)))
    got = torch.empty((m, w.N), dtype=bf16, device=dev)
    tk.grouped_gemm(q.packed, q.scales, w.packed, w.scales, w.alpha, r.expert_offsets, r.blockscale_offsets, got, cfg)
    return got, (lambda: stages.grouped_gemm(q, w, r, bf16))


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


def _stage_rows(case, timer, smoke: bool) -> list[dict]:
    """Check and time every candidate of the four tuned stages of one case; rows with ``stage``/``config``.

    Each stage runs on the reference's output of the stage before it (the first passing
    candidate's output for the SiLU-and-mul quantization and gemm2), so a failing candidate
    does not stop the stages after it from being tuned.
    """
    from moe_fp4 import stages as ref
    from moe_fp4.bench.checks import ACT_QUANT_REL_TOL, CheckResult, exact, within
    from moe_fp4.bench.engine import measure
    from moe_fp4.bench.roofline import NVFP4_BITS, gemm_floor
    from moe_fp4.bench.workload import TimedPath, decoded_rows, gemm_rows_check

    shape, ex, M = case.shape, case.experts, case.M
    n, dt = M * shape.topk, torch.bfloat16
    tb = _stages()
    w13, w2 = tb.weights(ex)
    r = ref.routing(case.topk_ids, shape.E)
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

    ref_q = ref.quantize_rows(case.x, ex.a13_gs, r)
    qcfgs = quant_configs(M, shape, smoke)
    run("quantize", qcfgs, lambda c: tb.quantize_rows(case.x, ex.a13_gs, r, config=c),
        lambda o: exact("quantize", o, ref_q))

    def gemm(stage: str, a, w):
        return run(stage, gemm_configs(M, shape, smoke), lambda c: tb.grouped_gemm(a, w, r, dt, config=c),
                   gemm_rows_check(a, w, r, dt), gemm_floor(n, w.N, w.K, case.n_touched, case.ceilings))

    h = gemm("gemm1", ref_q, w13)
    if h is None:  # no candidate passed: the next stage takes the reference's output
        h = ref.grouped_gemm(ref_q, w13, r, dt)
    ref_s = ref.silu_mul_quantize(h, ex.a2_gs, r)
    firsts: list = []

    def check_silu(o) -> CheckResult:
        # Every candidate computes the same float32 operations: identical bytes. The first
        # (the table's) against the reference: libdevice expf and torch's exp may differ in
        # the last bit, so decoded values within ACT_QUANT_REL_TOL (moe_fp4.bench.checks).
        if firsts:
            return exact("silu_mul_quantize vs the table's configuration", o, firsts[0])
        res = within("decoded intermediate vs reference", decoded_rows(o, r), decoded_rows(ref_s, r),
                     ACT_QUANT_REL_TOL)
        if res.ok:
            firsts.append(dataclasses.replace(o, packed=o.packed.clone(), scales=o.scales.clone()))
        return res

    a2 = run("silu_mul_quantize", qcfgs, lambda c: tb.silu_mul_quantize(h, ex.a2_gs, r, config=c), check_silu)
    gemm("gemm2", a2 if a2 is not None else ref_s, w2)
    return rows


def _us(value: float | None, width: int) -> str:
    return f"{value:{width}.1f}" if value is not None else f"{'-':>{width}}"


def _summary_lines(rows: list[dict], fused: list[dict], baseline: dict[tuple[str, int], dict[str, float]]) -> list[str]:
    """Per (model, M): whole forward vs baseline and Marlin; per stage the table's config, the best one and the
    baseline's time (``baseline`` as :func:`load_baseline` gives it)."""
    lines = [f"{'model':<14} {'M':>5} {'stage':<18} {'table us':>9} {'best us':>9}  best config"
             f"{'':<22} {'base us':>8}"]
    by_case: dict[tuple, list[dict]] = {}
    for r in rows:
        by_case.setdefault((r["model"], r["M"]), []).append(r)
    for f in fused:
        key = (f["model"], f["M"])
        base = baseline.get(key, {})
        us = f.get("us")
        ratios = [f"{base[p] / us:{fmt}}x {label}" for p, label, fmt in (("triton", "baseline", ".1f"),
                                                                          ("marlin", "marlin", ".2f"))
                  if us and p in base]
        ratio = f" ({', '.join(ratios)})" if ratios else ""
        lines.append(f"{key[0]:<14} {key[1]:>5} {'fused_moe':<18} {_us(us, 9)}{'':>10}  {f.get('status')}{ratio}")
        for stage in _BASELINE_STAGES:
            cand = [r for r in by_case.get(key, []) if r["stage"] == stage]
            ok = [r for r in cand if r.get("status") == "ok"]
            table = next((r for r in cand if r["default"]), None)
            best = min(ok, key=lambda r: r["us"]) if ok else None
            t_us = f"{table['us']:9.1f}" if table and table.get("us") else f"{'FAIL' if table else '-':>9}"
            name = best["config"] if best else ""
            lines.append(f"{'':<14} {'':>5} {stage:<18} {t_us} {_us(best and best['us'], 9)}  {name:<33} "
                         f"{_us(base.get(f'triton/{stage}'), 8)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--smoke", action="store_true", help="a tiny layer in Triton's CPU interpreter (plumbing only)")
    parser.add_argument("--models", default=None, help="comma-separated subset of moe_fp4.bench.shapes.MODELS")
    parser.add_argument("--tokens", default=None, help="comma-separated subset of M values")
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                        help="compile worker processes (0: compile in the timed run)")
    parser.add_argument("--baseline", type=Path, default=None, metavar="FILE",
                        help="the moe-fp4 bench report (JSON) to compare with (default: the newest in "
                             "benchmarks/results/)")
    args = parser.parse_args(argv)
    t_start = time.time()
    baseline_path = args.baseline or default_baseline()
    baseline = load_baseline(baseline_path) if baseline_path is not None else {}
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton creates the kernels
    from moe_fp4.bench.engine import environment, measure, release
    from moe_fp4.bench.roofline import Ceilings
    from moe_fp4.bench.shapes import MODELS, ModelShape
    from moe_fp4.bench.timing import GpuTimer, WallTimer
    from moe_fp4.bench.workload import Case, random_experts

    tk = _tk()
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
                              "baseline": None if baseline_path is None else str(baseline_path),
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
            report["stages"].extend(_stage_rows(case, timer, args.smoke))
            report["fused"].append({"model": shape.name, "M": M, **measure(case.backend_path("triton", None), timer)})
            print(f"{shape.name} M={M}: fused {report['fused'][-1].get('us')} us ({time.time() - t_start:.0f} s)",
                  flush=True)
            save()
            del case
            release(dev)
        del experts
        release(dev)
    print("\n".join(_summary_lines(report["stages"], report["fused"], baseline)))
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
