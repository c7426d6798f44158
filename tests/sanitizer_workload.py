"""A small workload that reaches every kernel moe_fp4 runs on the H200, each output checked: for
compute-sanitizer (``tests/run_sanitizer.sh OUTDIR`` runs it under memcheck, initcheck, racecheck
and synccheck). From the repository root::

    PYTHONPATH=. python tests/sanitizer_workload.py            # exit 1 if any check fails
    PYTHONPATH=. python tests/sanitizer_workload.py --device cpu

What it runs, on bf16 and fp16, mostly with E = 13 experts (not a multiple of 16, nor of 4):

* ``fused_moe`` on backends ``triton`` (W4A4) and ``cutlass`` (W4A4 and W4A16: the sm_90a GEMM, its
  weight re-layout kernel, the CUDA pipeline kernels), each call twice (a shape's first forward runs
  the checked stage functions, the second its workspace plan's bound launches; both must agree bit
  for bit) at M = 1, 10, 30, 120, 600: every GEMM configuration of the Triton table (<= 4, 8, 24,
  96 and more rows per expert), the Triton routing's one-program (<= 256 slots) and chunked paths
  and the CUDA routing's one-block (<= 256 slots) and three-launch (4800 slots, past 256 per key) paths, the
  cutlass W4A4 plans' routing and first quantization in one launch (<= 256 slots: M = 1, 10, 30), -1 ids, an empty
  expert, every token to one expert, router weights on the input, K = 160 and 96 (not multiples of
  64); plus three pinned Triton GEMM configurations: split K (the split-K reduce kernel), and the
  "bits-plain" and "float" operand modes; and split K with the plan's top-k reduce fusion on
  (``FUSE_TOPK_REDUCE``: ``split_k_topk_reduce_kernel``); and up to 256 slots the reduces in the GEMMs'
  own launches (``FUSE_SPLIT_K_IN_GEMM``, ``FUSE_TOPK_IN_GEMM`` with ``TOPK_IN_GEMM_MAX`` raised to the
  case's slots: counters and acquire-release atomics), with the table's GEMMs and pinned split K, and
  once in the values form with ``FUSE_SILU = "split"`` (the SiLU-and-mul quantization by the first
  GEMM's last K ranges);
* the CUDA and Triton pipeline kernels stage by stage: routing (one block with shared counters,
  one block with global counters for E = 5000, one block per tile up to 256 ids per key, three launches
  past 16384 slots);
  quantize_rows with codes, with codes
  and values, with values only (the sm_90a stage set), with and without the router weight on the
  input and without gather; silu_mul_quantize with codes and with values only; moe_reduce into
  float32 (CUDA only), bf16 and fp16, weighted and plain;
* the sm_90a grouped GEMM stage at every token tile (8, 16, 32, 48, 64, 80, 96, 112, 128), with K split inside the CTA
  (a short grid) and without (tiles 8 and 16 have both), the device weight re-layout (in place) against
  the host one and its device restore against the canonical weights;
* ``validate=True`` (the default) of every ``fused_moe`` call: the one-kernel input check of the CUDA
  library (``moe_fp4_check_inputs``).

Each output is checked against the reference computed on the CPU (so that the GPU runs little but
the kernels under test): routing, quantization, reduce and the re-layout bit for bit (every byte of a
poisoned output, padding included), SiLU-mul-quantize within its exp tolerance
(``test_native.assert_silu_quantized_close``), the GEMM within its float32 error bound
(``test_triton_stages.gemm_error_bound``), each forward within the grid tests' RMS and max bounds of
the reference backend (``test_triton_moe``). It prints one line per check and exits 1 if any fails.

``--device cpu`` runs what runs on the CPU (the Triton kernels in Triton's interpreter, the host oracle
of the CUDA quantize/SiLU/reduce kernels, the host re-layout) and says what it leaves out; it checks the
workload itself, not the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # moe_cases and the test helpers (python puts it there when run as a script)

BF16, FP16 = torch.bfloat16, torch.float16
E = 13  # experts: not a multiple of 16 (nor of 4)

# (m, topk, h, i, dtype, routing pattern, router weight on the input, what it reaches)
FUSED_CASES = [
    (1, 2, 128, 64, BF16, "random", False, "M = 1; Triton one-program routing"),
    (10, 8, 160, 96, FP16, "minus_one", False, "-1 ids; K = 160 and 96 (not multiples of 64); <= 8 rows per expert"),
    (30, 8, 128, 64, BF16, "skip", True, "an empty expert; router weight on the input; <= 24 rows per expert"),
    (120, 8, 128, 64, FP16, "one_expert", False, "every token to expert 1; <= 96 rows per expert"),
    (600, 8, 128, 64, BF16, "minus_one", False, "4800 slots: CUDA routing's three launches (past 256 ids per "
                                                "key with E = 13), Triton's chunked; 128-row GEMM tiles"),
    (2, 1, 4096, 64, BF16, "random", False, "K = 4096: the sm_90a GEMM1 splits K across a cluster of 3 CTAs, "
                                            "22, 22 and 20 chunks (its ring of 8 stages wraps)"),
]


# --------------------------------------------------------------------------- the report


class Report:
    """Runs checks, prints one line each, remembers the failures (a failure does not stop the others)."""

    def __init__(self) -> None:
        self.ran = 0
        self.failed: list[str] = []
        self.left_out: list[str] = []

    def check(self, what: str, fn: Callable[[], str | None]) -> None:
        self.ran += 1
        t0 = time.perf_counter()
        try:
            detail = fn()
        except Exception as exc:  # noqa: BLE001 - reported, and the exit status says so
            self.failed.append(what)
            print(f"FAIL {what}: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=4)
        else:
            print(f"ok   {what}{': ' + detail if detail else ''} ({time.perf_counter() - t0:.2f} s)", flush=True)

    def skip(self, what: str, why: str) -> None:
        self.left_out.append(what)
        print(f"--   {what}: not run ({why})", flush=True)

    def summary(self) -> int:
        print(f"{self.ran} checks, {len(self.failed)} failed, {len(self.left_out)} left out")
        for what in self.failed:
            print(f"  failed: {what}")
        return 1 if self.failed else 0


def moved(buf, device: torch.device):
    """A tensor or buffer dataclass (None fields kept) on ``device``."""
    if isinstance(buf, torch.Tensor):
        return buf.to(device)
    names = [f.name for f in dataclasses.fields(buf) if getattr(buf, f.name) is not None]
    return dataclasses.replace(buf, **{n: getattr(buf, n).to(device) for n in names})


def poisoned(buf, device: torch.device):
    from moe_fp4.testing import poisoned_like

    return poisoned_like(moved(buf, device))


def routing_ids(m: int, topk: int, e: int, pattern: str, seed: int) -> torch.Tensor:
    from moe_fp4.testing import routed_ids

    return routed_ids(m, topk, e, torch.Generator().manual_seed(seed), pattern)


def routed(m: int, topk: int, seed: int):
    """(the reference routing of M tokens' -1 ids over E experts, its slot count, a generator for the data)."""
    from moe_fp4 import stages

    return stages.routing(routing_ids(m, topk, E, "minus_one", seed), E), m * topk, torch.Generator().manual_seed(seed)


def assert_values_only(got, want_values: torch.Tensor, untouched, stage: str) -> None:
    """A values-only (sm_90a) quantization on the CPU: ``want_values`` written, the poisoned codes and scales not."""
    from moe_fp4.testing import assert_same_buffers

    assert_same_buffers(got.values, want_values, what=f"{stage} values")
    assert_same_buffers((got.packed, got.scales), (untouched.packed, untouched.scales),
                        what=f"{stage} codes (unwritten)")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- whole forwards


def check_fused(report: Report, dev: torch.device, on_gpu: bool) -> None:
    from moe_cases import Case, make_experts
    from test_triton_moe import MAX_TOL, RMS_TOL

    import moe_fp4.backends.triton as tb
    from moe_fp4 import fused_moe
    from moe_fp4.testing import assert_same_buffers, errors

    def one(ex_cpu, ex, x, w, ids, on_input, backend, precision, pin=None, form=None, **switches) -> Callable[[], str]:
        def run() -> str:
            kw = {"apply_router_weight_on_input": on_input, "precision": precision}
            # (switches, e.g. FUSE_TOPK_REDUCE=True: a copy of the experts, whose plan is bound with them)
            args = (moved(x, dev), ex_cpu.to(dev) if switches else ex, moved(w, dev), moved(ids, dev))
            outs = []
            saved = {name: getattr(tb, name) for name in switches}
            for name, value in switches.items():
                setattr(tb, name, value)
            try:
                for _ in range(2):  # a shape's first forward runs the checked stages, the next its plan's launches
                    out = torch.full_like(x, float("nan"), device=dev)
                    with (contextlib.nullcontext() if pin is None
                          else tb.pinned_gemm_config(tb.kernels().GemmConfig(*pin))), \
                            (contextlib.nullcontext() if form is None else tb.operand_form(form)):
                        outs.append(fused_moe(*args, backend=backend, out=out, **kw).cpu())
            finally:
                for name, value in saved.items():
                    setattr(tb, name, value)
            assert_same_buffers(outs[1], outs[0], what="the second forward (the plan's) vs the first")
            got = outs[0]
            ref = fused_moe(x, ex_cpu, w, ids, backend="reference", **kw)
            rms, mx = errors(got, ref)
            unserved = (ids < 0).all(dim=1)
            if not bool((got[unserved] == 0).all()):
                raise AssertionError("a token with no served expert is not exactly 0")
            if not (rms <= RMS_TOL and mx <= MAX_TOL):
                raise AssertionError(f"rms {rms:.3g} (<= {RMS_TOL}), max {mx:.3g} (<= {MAX_TOL})")
            return f"rms {rms:.2e}, max {mx:.2e}"
        return run

    for k, (m, topk, h, i, dtype, pattern, on_input, note) in enumerate(FUSED_CASES):
        gen = torch.Generator().manual_seed(100 + k)
        ex_cpu = make_experts(Case(m, E, topk, h, i, dtype, split_gate_up=k % 2 == 1), gen)
        ex = ex_cpu.to(dev)
        x = (torch.randn(m, h, generator=gen) / 3).to(dtype)
        w = torch.rand(m, topk, generator=gen)
        ids = routing_ids(m, topk, E, pattern, seed=k)
        name = f"M={m} top{topk} H={h} I={i} {dtype_name(dtype)} {pattern}{' on-input' if on_input else ''} ({note})"
        report.check(f"fused_moe triton w4a4, {name}", one(ex_cpu, ex, x, w, ids, on_input, "triton", "w4a4"))
        what = f"fused_moe triton w4a16, {name}"  # (the values operand: its RAW row stages, bf16 or fp16 rows)
        if h % 64 or i % 64:
            report.skip(what, "the Triton W4A16 path (its values operand) needs H and I multiples of 64")
        elif on_gpu and not sm90(on_gpu):
            report.skip(what, "the Triton values operand is built for compute capability 9.x")
        else:
            report.check(what, one(ex_cpu, ex, x, w, ids, on_input, "triton", "w4a16"))
        for precision in ("w4a4", "w4a16"):
            what = f"fused_moe cutlass {precision}, {name}"
            if sm90(on_gpu):
                report.check(what, one(ex_cpu, ex, x, w, ids, on_input, "cutlass", precision))
            else:
                report.skip(what, "this project runs cutlass with its sm_90a GEMM, on compute capability 9.x")
        if h == 160:  # K = 160: three 64-wide K steps, so split_k = 2 makes two K ranges
            for pin, label in (((16, 64, 64, True, 4, 2, 2), "split-K 2 (split_k_reduce_kernel)"),
                               ((16, 16, 64, False, 4, 2, 1, "float"), "float operands"),
                               ((32, 32, 64, True, 4, 3, 1, "bits-plain"), "bits-plain operands")):
                report.check(f"fused_moe triton w4a4 pinned {label}, {name}",
                             one(ex_cpu, ex, x, w, ids, on_input, "triton", "w4a4", pin))
            report.check(f"fused_moe triton w4a4 pinned split-K 2 with the top-k reduce fused in the plan "
                         f"(split_k_topk_reduce_kernel), {name}",
                         one(ex_cpu, ex, x, w, ids, on_input, "triton", "w4a4", (16, 64, 64, True, 4, 2, 2),
                             FUSE_TOPK_REDUCE=True))
        # the reduces in the GEMMs' launches (counters, acquire-release atomics), the top-k one at any M here
        in_gemm = dict(FUSE_SPLIT_K_IN_GEMM=True, FUSE_TOPK_IN_GEMM=True, TOPK_IN_GEMM_MAX=m * topk)
        if m * topk <= 256:
            for pin, label in (((16, 64, 64, True, 4, 2, 2), "pinned split-K 2"), (None, "the table's GEMMs")):
                if pin is None or h == 160:
                    report.check(f"fused_moe triton w4a4 {label}, the reduces in the GEMMs' launches "
                                 f"(FIXUP, TOPK), {name}",
                                 one(ex_cpu, ex, x, w, ids, on_input, "triton", "w4a4", pin, **in_gemm))
        if k == 0:  # the values form, pinned split K: the first GEMM's last K ranges also quantize SiLU-and-mul
            what = f"fused_moe triton w4a4 values, pinned split-K 2, FIXUP with SILU, TOPK, {name}"
            if on_gpu and not sm90(on_gpu):
                report.skip(what, "the Triton values operand is built for compute capability 9.x")
            else:
                report.check(what, one(ex_cpu, ex, x, w, ids, on_input, "triton", "w4a4", (16, 64, 64, True, 4, 2, 2),
                                       "values", FUSE_SILU="split", **in_gemm))


# --------------------------------------------------------------------------- pipeline stages


def sm90(on_gpu: bool) -> bool:
    return on_gpu and torch.cuda.get_device_capability()[0] == 9


def stage_sets(on_gpu: bool) -> dict[str, object]:
    """The stage sets whose kernels run here: on the CPU the CUDA stages run their host oracle (the values-only
    quantization of the sm_90a stage set too; its GEMM runs on sm_90 GPUs only)."""
    import moe_fp4.backends.triton as tb
    from moe_fp4.backends import cutlass

    sets = {"triton": tb.STAGES, "cutlass": cutlass.STAGES}
    if sm90(on_gpu) or not on_gpu:
        sets["cutlass-sm90"] = cutlass.STAGES_SM90
    return sets


def check_routing(report: Report, dev: torch.device, on_gpu: bool) -> None:
    from moe_fp4 import stages
    from moe_fp4.buffers import RoutingData
    from moe_fp4.testing import assert_same_buffers, poisoned_like

    cases = [(7, 3, E, "minus_one", "one launch, counters in shared memory; -1 ids"),
             (3, 2, 5000, "random", "one launch, counters in global memory (E + 1 > 4096)"),
             (400, 8, E, "minus_one", "one block per tile: 3200 slots, at most 256 per key (E = 13); -1 ids"),
             (2100, 8, E, "minus_one", "three launches: 16800 slots; -1 ids")]
    for k, (m, topk, e, pattern, note) in enumerate(cases):
        ids = routing_ids(m, topk, e, pattern, seed=200 + k)
        ref = stages.routing(ids, e)
        for name, stage_set in stage_sets(on_gpu).items():
            if name == "cutlass-sm90":
                continue  # the same routing kernels as "cutlass"
            what = f"routing {name}, M={m} top{topk} E={e} ({note})"
            if name == "cutlass" and not on_gpu:
                report.skip(what, "the CUDA routing has no host oracle")
                continue

            def run(stage_set=stage_set, ids=ids, e=e, ref=ref) -> None:
                # 0x7F bytes: no valid offset or slot (0xFF would read as -1, which routing writes).
                out = poisoned_like(RoutingData.empty(ids.numel(), e, dev), byte=0x7F)
                got = stage_set.routing(moved(ids, dev), e, out=out)
                assert_same_buffers(moved(got, torch.device("cpu")), ref, what="routing")

            report.check(what, run)


def check_quantize(report: Report, dev: torch.device, on_gpu: bool) -> None:
    from moe_fp4 import stages
    from moe_fp4.buffers import Quantized
    from moe_fp4.testing import assert_same_buffers

    cpu = torch.device("cpu")
    m, topk, k = 9, 3, 160
    r, n, gen = routed(m, topk, seed=300)
    gs = 2688.0 / (0.5 + 8 * torch.rand(E, generator=gen))
    for dtype in (BF16, FP16):
        for mode in ("gather", "gather, router weight on the input", "no gather"):
            x = (torch.randn(n if mode == "no gather" else m, k, generator=gen) * 3).to(dtype)
            row_scale = torch.rand(n, generator=gen) if "router" in mode else None
            kw = {"gather": mode != "no gather", "row_scale": row_scale}
            for name, stage_set in stage_sets(on_gpu).items():
                forms = {"triton": ("codes",), "cutlass": ("codes", "codes and values"),
                         "cutlass-sm90": ("values only",)}[name]
                for form in forms:
                    values = dtype if form != "codes" else None

                    def run(stage_set=stage_set, x=x, kw=kw, form=form, values=values) -> None:
                        ref = stages.quantize_rows(x, gs, r, **kw, out=Quantized.empty(n, k, E, cpu, values=values))
                        out = poisoned(Quantized.empty(n, k, E, cpu, values=values), dev)
                        untouched = moved(out, cpu)
                        row_scale = None if kw["row_scale"] is None else kw["row_scale"].to(dev)
                        got = stage_set.quantize_rows(moved(x, dev), gs.to(dev), moved(r, dev), gather=kw["gather"],
                                                      row_scale=row_scale, out=out)
                        got = moved(got, cpu)
                        if form == "values only":
                            assert_values_only(got, ref.values, untouched, "quantize_rows")
                        else:
                            assert_same_buffers(got, ref, what="quantize_rows")

                    report.check(f"quantize_rows {name} {form}, {dtype_name(dtype)}, {mode}, M={m} top{topk} K={k}",
                                 run)


def check_silu_mul_quantize(report: Report, dev: torch.device, on_gpu: bool) -> None:
    from test_native import assert_silu_quantized_close

    from moe_fp4 import stages
    from moe_fp4.buffers import Quantized

    cpu = torch.device("cpu")
    m, topk, inter = 12, 3, 96
    r, n, gen = routed(m, topk, seed=400)
    gs = 2688.0 / (0.5 + torch.rand(E, generator=gen))
    sets = stage_sets(on_gpu)
    for dtype in (BF16, FP16):
        h = (torch.randn(n, 2 * inter, generator=gen) * 4).to(dtype)
        h[int(r.expert_offsets[-1]):] = float("nan")  # rows past the routed ones are never read
        ref = stages.silu_mul_quantize(h, gs, r)
        args = (moved(h, dev), gs.to(dev), moved(r, dev))
        for name in ("triton", "cutlass"):
            def run(stage_set=sets[name], ref=ref, h=h) -> str:
                got = stage_set.silu_mul_quantize(*args, out=poisoned(Quantized.empty(n, inter, E, cpu), dev))
                frac = assert_silu_quantized_close(moved(got, cpu), ref, h, gs, r)
                return f"{frac:.2%} of the blocks differ (SiLU's exp)"

            report.check(f"silu_mul_quantize {name} codes, {dtype_name(dtype)}, M={m} top{topk} I={inter}", run)
        if "cutlass-sm90" not in sets:
            report.skip(f"silu_mul_quantize cutlass-sm90 values only, {dtype_name(dtype)}", "needs an sm_90 GPU")
            continue

        def run_values(h=h) -> None:
            both = poisoned(Quantized.empty(n, inter, E, cpu, values=h.dtype), dev)
            with_codes = sets["cutlass"].silu_mul_quantize(*args, out=both)
            out = poisoned(Quantized.empty(n, inter, E, cpu, values=h.dtype), dev)
            untouched = moved(out, cpu)
            got = moved(sets["cutlass-sm90"].silu_mul_quantize(*args, out=out), cpu)
            # Against the codes kernel's values on this GPU (the same expf; that kernel is checked above).
            assert_values_only(got, with_codes.values.cpu(), untouched, "silu_mul_quantize")

        report.check(f"silu_mul_quantize cutlass-sm90 values only, {dtype_name(dtype)}, M={m} top{topk} I={inter}",
                     run_values)


def check_reduce(report: Report, dev: torch.device, on_gpu: bool) -> None:
    from moe_fp4 import stages
    from moe_fp4.testing import assert_same_buffers, poisoned_like

    m, topk, hidden = 11, 4, 72
    r, _, gen = routed(m, topk, seed=500)
    sets = stage_sets(on_gpu)
    for y_dtype in (BF16, FP16):
        y = torch.randn(m * topk, hidden, generator=gen).to(y_dtype)
        y[int(r.expert_offsets[-1]):] = float("nan")  # rows past the routed ones are never read
        for weighted in (True, False):
            w = torch.rand(m, topk, generator=gen) if weighted else None
            for out_dtype in (torch.float32, BF16, FP16):
                ref = stages.moe_reduce(y, r, w, m, out_dtype)
                for name in ("triton", "cutlass"):
                    what = (f"moe_reduce {name}, y {dtype_name(y_dtype)} -> {dtype_name(out_dtype)}, "
                            f"{'weighted' if weighted else 'plain sum'}, M={m} top{topk} H={hidden}")
                    if name == "triton" and out_dtype == torch.float32:
                        continue  # the Triton reduce writes the 16-bit dtypes only

                    def run(stage_set=sets[name], ref=ref, w=w, out_dtype=out_dtype, y=y) -> None:
                        got = stage_set.moe_reduce(moved(y, dev), moved(r, dev), None if w is None else w.to(dev), m,
                                                   out_dtype, out=poisoned_like(ref.to(dev)))
                        assert_same_buffers(got.cpu(), ref, what="moe_reduce")

                    report.check(what, run)


def check_sm90_gemm(report: Report, dev: torch.device, on_gpu: bool) -> None:
    from moe_cases import Case, make_experts
    from test_triton_stages import gemm_error_bound

    from moe_fp4 import stages
    from moe_fp4.backends import cutlass
    from moe_fp4.buffers import Quantized
    from moe_fp4.testing import assert_same_buffers

    cpu = torch.device("cpu")
    # (m, topk, e, h, i, tiles, note): (experts in use) x (64-row weight tiles) below 2 per SM splits K
    # inside the CTA; 40 experts x 512 rows (8 tiles) = 320 does not (gemm_sm90.cu, dispatch).
    cases = [(9, 3, E, 160, 64, cutlass.SM90_TILE_TOKENS, "K split in the CTA (13 experts x 2 tiles)"),
             (20, 4, 40, 128, 256, (8, 16), "K not split (40 experts x 8 tiles)")]
    for k, (m, topk, e, h, i, tiles, note) in enumerate(cases):
        for dtype in (BF16, FP16):
            gen = torch.Generator().manual_seed(600 + k)
            ex_cpu = make_experts(Case(m, e, topk, h, i, dtype, split_gate_up=True), gen)
            what = (f"sm_90a weight re-layout in place and its restore, device vs host, E={e} H={h} I={i} "
                    f"{dtype_name(dtype)}")
            if not sm90(on_gpu):
                report.skip(what, "needs an sm_90 GPU")
                report.skip(f"sm_90a grouped GEMM tiles {tiles}, {note}", "needs an sm_90 GPU")
                continue
            prepared: dict[str, tuple] = {}  # the device re-layout, made (and checked) by the first check

            def relayout(ex_cpu=ex_cpu, prepared=prepared) -> None:
                on_dev = ex_cpu.to(dev)  # its own tensors: re-laid out in place
                w90 = prepared["w90"] = cutlass.STAGES_SM90.weights(on_dev)
                alpha13, alpha2 = ex_cpu.alphas()
                host = (cutlass.sm90_weights(ex_cpu.w13, ex_cpu.w13_scale, alpha13),
                        cutlass.sm90_weights(ex_cpu.w2, ex_cpu.w2_scale, alpha2.reshape(-1, 1)))
                for got, want in zip(w90, host, strict=True):
                    assert_same_buffers(moved(got, cpu), want, what="sm90 weights")
                # The device restore kernel (moe_fp4_sm90_restore_weights) gives the canonical bytes back.
                assert on_dev.layout == "sm90", on_dev.layout
                for name, t in on_dev.canonical_tensors().items():
                    want = getattr(ex_cpu, name)
                    assert torch.equal(t.cpu().view(torch.uint8), want.view(torch.uint8)), f"restored {name}"

            report.check(what, relayout)
            ids = routing_ids(m, topk, e, "minus_one", seed=610 + k)
            r = stages.routing(ids, e)
            n = m * topk
            valid = int(r.expert_offsets[-1])
            x = (torch.randn(m, h, generator=gen) / 3).to(dtype)
            # The reference quantization with values: its codes for the reference GEMM, its values for sm_90a.
            a = stages.quantize_rows(x, ex_cpu.a13_gs, r, out=Quantized.empty(n, h, e, cpu, values=dtype))
            w_ref = stages.STAGES.weights(ex_cpu)[0]
            ref = stages.grouped_gemm(a, w_ref, r, dtype)[:valid]
            for tile in tiles:
                def run(tile=tile, a=a, w_ref=w_ref, ref=ref, r=r, n=n, valid=valid, prepared=prepared,
                        dtype=dtype) -> str:
                    out = torch.full((n, w_ref.N), float("nan"), dtype=dtype, device=dev)
                    got = cutlass.STAGES_SM90.grouped_gemm(moved(a, dev), prepared["w90"][0], moved(r, dev), dtype,
                                                           out=out, config=tile).cpu()
                    bound = gemm_error_bound(a, w_ref, r, ref, got[:valid])
                    ratio = float(((got[:valid].float() - ref.float()).abs() / bound).max()) if valid else 0.0
                    if not ratio <= 1.0:
                        raise AssertionError(f"error / bound = {ratio:.3g}")
                    if not bool(got[valid:].isnan().all()):
                        raise AssertionError("rows past expert_offsets[E] were written")
                    return f"max error / bound {ratio:.3f}"

                report.check(f"sm_90a grouped GEMM tile {tile}, {note}, M={m} top{topk} N={2 * i} K={h} "
                             f"{dtype_name(dtype)}", run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernels are created
    elif not torch.cuda.is_available():
        print("sanitizer_workload: no CUDA device (use --device cpu to check the workload itself)", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    on_gpu = dev.type == "cuda"
    where = torch.cuda.get_device_name() + f" (sm_{''.join(map(str, torch.cuda.get_device_capability()))})" \
        if on_gpu else "CPU (Triton interpreter, host oracle)"
    print(f"sanitizer workload on {where}; torch {torch.__version__}", flush=True)
    report = Report()
    for section in (check_routing, check_quantize, check_silu_mul_quantize, check_reduce, check_sm90_gemm,
                    check_fused):
        section(report, dev, on_gpu)
    if on_gpu:
        torch.cuda.synchronize()
    return report.summary()


if __name__ == "__main__":
    sys.exit(main())
