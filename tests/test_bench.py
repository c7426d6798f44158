"""The benchmark's pure-Python parts on CPU: roofline arithmetic, statistics, checks, the engine's
plumbing (with the host clock and the torch stage references), report writers and the CLI.

Nothing here measures speed; the GPU side is in test_bench_gpu.py and benchmarks/.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_fp4 import fused_moe
from moe_fp4 import stages as ref_stages
from moe_fp4.bench import cli as bench_cli
from moe_fp4.bench import engine, peers, report
from moe_fp4.bench.checks import check_rows, exact, spread_indices, within
from moe_fp4.bench.roofline import BF16_BITS, NVFP4_BITS, Ceilings, gemm_floor, moe_floor, row_metrics, touched_experts
from moe_fp4.bench.shapes import DEFAULT_TOKENS, MODELS, ModelShape, parse_shape
from moe_fp4.bench.timing import Timing, WallTimer, percentile
from moe_fp4.bench.workload import (
    STAGE_FUNCTIONS,
    STAGES,
    Case,
    StageChain,
    TimedPath,
    poison,
    random_experts,
    tensors_of,
)
from moe_fp4.buffers import Quantized
from moe_fp4.cli import build_parser, main
from moe_fp4.pipeline import run_pipeline
from moe_fp4.testing import assert_same_buffers

CPU = torch.device("cpu")
TINY = ModelShape("tiny", E=8, topk=2, H=64, I=64)
# H200-like rates: 4.25 TB/s copy (the larger bandwidth), 707 TFLOP/s bf16.
EXAMPLE_CEILINGS = Ceilings(copy_tbps=4.25, stream_tbps=4.0, bf16_tflops=707.0)


# ----------------------------------------------------------------------------- shapes


def test_every_model_layer_is_a_cli_name_whose_weights_take_4_5_bits_each():
    assert bench_cli.resolve_models(["all"], []) == tuple(MODELS.values())
    for name, m in MODELS.items():
        assert bench_cli.resolve_models([name], []) == (m,)
        whole = moe_floor(m, 1, m.E, EXAMPLE_CEILINGS)  # every expert touched
        assert whole.weight_bytes == m.E * 3 * m.H * m.I * 4.5 / 8
    # The DeepSeek-V3-like layer: 22.5 GB of bf16 weights, 6.3 GB in NVFP4 (what the benchmark holds per layer).
    ds = MODELS["deepseek-v3"]
    assert ds.E * ds.weights_per_expert * 2 == pytest.approx(22.5e9, rel=0.01)
    assert moe_floor(ds, 1, ds.E, EXAMPLE_CEILINGS).weight_bytes == pytest.approx(6.34e9, rel=0.01)


@pytest.mark.parametrize("text, message", [
    ("8,2,64", "four integers"), ("8,9,64,64", "at most E=8"), ("8,2,96,64", "multiple of 64"),
    ("0,1,64,64", "positive")])
def test_bad_custom_shapes_are_rejected_with_the_reason(text, message):
    with pytest.raises(ValueError, match=message):
        parse_shape(text)


# ----------------------------------------------------------------------------- roofline


def test_roofline_of_the_qwen3_layer_at_one_and_16384_tokens():
    qwen = MODELS["qwen3-30b-a3b"]
    # 8 experts touched at M=1: 8 * 2,654,208 B = 21.2 MB, 5.0 us at 4.25 TB/s (the larger of the two rates).
    f1 = moe_floor(qwen, 1, 8, EXAMPLE_CEILINGS)
    assert f1.weight_bytes == 8 * 2_654_208
    assert f1.memory_us == pytest.approx(21_233_664 / 4.25e12 * 1e6)
    assert f1.us == pytest.approx(4.996, abs=1e-3) and f1.bound == "memory"
    assert f1.flops == pytest.approx(75_497_472)  # 2 * 8 * 4,718,592 FLOPs per token
    # All 128 experts: 339,738,624 B = 80 us; 16384 tokens: 1.237 TFLOP / 707 TFLOP/s = 1.75 ms (compute-bound).
    f2 = moe_floor(qwen, 16384, 128, EXAMPLE_CEILINGS)
    assert f2.weight_bytes == 339_738_624
    assert f2.memory_us == pytest.approx(79.94, abs=0.01)
    assert f2.flops == pytest.approx(1.237e12, rel=1e-3)
    assert f2.us == pytest.approx(1749.6, abs=0.5) and f2.bound == "compute"


def test_ceilings_use_the_larger_bandwidth_and_reject_non_positive_rates():
    assert Ceilings(4.25, 4.5, 700).read_tbps == 4.5
    assert Ceilings(4.25, 4.0, 700).to_dict()["read_tbps"] == 4.25
    with pytest.raises(ValueError, match="stream_tbps"):
        Ceilings(4.25, 0.0, 700)


def test_gemm_floor_splits_the_moe_floor():
    qwen = MODELS["qwen3-30b-a3b"]
    rows, n = 64 * qwen.topk, 100
    whole = moe_floor(qwen, 64, n, EXAMPLE_CEILINGS)
    g1 = gemm_floor(rows, 2 * qwen.I, qwen.H, n, EXAMPLE_CEILINGS)
    g2 = gemm_floor(rows, qwen.H, qwen.I, n, EXAMPLE_CEILINGS)
    assert g1.weight_bytes + g2.weight_bytes == pytest.approx(whole.weight_bytes)
    assert g1.flops + g2.flops == pytest.approx(whole.flops)
    assert g1.weight_bytes == pytest.approx(2 * g2.weight_bytes)


def test_row_metrics():
    f = moe_floor(MODELS["qwen3-30b-a3b"], 1, 8, EXAMPLE_CEILINGS)
    m = row_metrics(10.0, f, NVFP4_BITS)
    assert m["pct_roofline"] == pytest.approx(100 * f.us / 10.0)
    assert m["weight_tbps"] == pytest.approx(f.weight_bytes / 10e-6 / 1e12)
    assert m["tflops"] == pytest.approx(f.flops / 10e-6 / 1e12)
    # The bf16 peer moves 16/4.5 times the bytes in the same time; the floor is the NVFP4 one.
    b = row_metrics(10.0, f, BF16_BITS)
    assert b["weight_tbps"] == pytest.approx(m["weight_tbps"] * 16 / 4.5)
    assert b["pct_roofline"] == m["pct_roofline"]
    with pytest.raises(ValueError, match="positive time"):
        row_metrics(0.0, f, NVFP4_BITS)


def test_touched_experts_counts_distinct_routed_ids():
    ids = torch.tensor([[3, 1], [1, -1], [7, 3]], dtype=torch.int32)
    assert touched_experts(ids) == 3  # -1 is "not served here", not an expert
    assert touched_experts(torch.full((4, 2), -1, dtype=torch.int32)) == 0
    with pytest.raises(ValueError, match="n_touched"):
        moe_floor(TINY, 1, TINY.E + 1, EXAMPLE_CEILINGS)


# ----------------------------------------------------------------------------- statistics


def test_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.random(n).tolist()
        for q in (0, 20, 50, 80, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    t = Timing.from_samples([5.0, 1.0, 3.0, 2.0, 4.0], "graph")
    assert (t.median_us, t.p20_us, t.p80_us, t.reps) == (3.0, 1.8, 4.2, 5)
    with pytest.raises(ValueError, match="at least one sample"):
        percentile([], 50)


# ----------------------------------------------------------------------------- checks


def test_within_bounds_the_norm_relative_error():
    ref = torch.tensor([3.0, 4.0])
    res = within("x", ref + torch.tensor([0.0, 0.5]), ref, 0.2)
    assert res.ok and res.rel_err == pytest.approx(0.1) and res.tol == 0.2
    assert not within("x", ref + torch.tensor([0.0, 0.5]), ref, 0.09).ok
    zero = within("x", torch.zeros(2), torch.zeros(2), 0.0)
    assert zero.ok and zero.rel_err == 0.0
    only_ref_zero = within("x", torch.ones(2), torch.zeros(2), 1e9)
    assert not only_ref_zero.ok and only_ref_zero.rel_err == float("inf")
    assert within("x", ref * 1.001, ref, 1e-2).ok
    assert not within("x", ref * 1.1, ref, 1e-2).ok
    assert not within("x", torch.tensor([float("nan"), 4.0]), ref, 1.0).ok
    bad_shape = within("x", torch.zeros(3), ref, 1.0)
    assert not bad_shape.ok and "shape" in bad_shape.detail


def test_exact_compares_bytes_shapes_and_dtypes():
    a = torch.tensor([1.0, 2.0, 448.0]).to(torch.float8_e4m3fn)
    assert exact("q", a.clone(), a).ok
    b = a.clone()
    b.view(torch.uint8)[1] ^= 1
    res = exact("q", b, a)
    assert not res.ok and "1 of 3" in res.detail
    assert not exact("q", a.view(torch.uint8), a).ok
    assert not exact("q", a[:2].clone(), a).ok
    # -0.0 == 0.0 as values, not as bytes: an exact check compares bytes.
    assert not exact("y", torch.tensor([-0.0]), torch.tensor([0.0])).ok


def test_exact_on_quantized_buffers_names_the_differing_field():
    gen = torch.Generator().manual_seed(11)
    packed = torch.randint(0, 256, (4, 32), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 127, (128, 4), dtype=torch.uint8, generator=gen)
    q = Quantized(packed, scales)
    same = exact("quantize", Quantized(packed.clone(), scales.clone()), q)
    assert same.ok and same.detail == "quantize: bit-exact (packed, scales)"
    flipped = scales.clone()
    flipped[5, 2] ^= 0x01
    res = exact("quantize", Quantized(packed.clone(), flipped), q)
    assert not res.ok and "quantize.scales" in res.detail and "1 of 512" in res.detail


def test_checked_rows_spread_over_all_tokens():
    assert spread_indices(5, 10) == [0, 1, 2, 3, 4]
    idx = spread_indices(1000, 7)
    assert idx[0] == 0 and idx[-1] == 999 and len(idx) == 7 == len(set(idx))
    assert check_rows(16384, 256, CPU).numel() == 256
    with pytest.raises(ValueError, match="cap"):
        check_rows(4, 0, CPU)


def test_peer_reference_is_the_dense_w4a16_moe_on_the_checked_rows():
    experts = random_experts(TINY, CPU, seed=1)
    case = Case(TINY, experts, 5, EXAMPLE_CEILINGS, seed=1, check_tokens=3)
    assert case.rows.tolist() == [0, 2, 4]
    x, w, ids = case.x, case.topk_weights, case.topk_ids
    w13, w2 = experts.dequantize(torch.float32)  # the format core's dequantization, whole tensors
    expected = torch.zeros(3, TINY.H, dtype=torch.float64)
    for i, t in enumerate(case.rows.tolist()):
        for j in range(TINY.topk):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            expected[i] += float(w[t, j]) * (w2[e].double() @ (torch.nn.functional.silu(h[:TINY.I]) * h[TINY.I:]))
    # Weights divided by the global scale in float32 here, in float64 by the reference: 1e-6 covers that rounding.
    torch.testing.assert_close(case.ref_w4a16(), expected, rtol=1e-6, atol=1e-6)
    out = torch.zeros(5, TINY.H, dtype=torch.bfloat16)  # rows 1 and 3 are not checked: left zero
    out[case.rows] = expected.to(torch.bfloat16)
    assert case.check_peer(out).ok
    out[4] = 0  # a checked row
    assert not case.check_peer(out).ok


def test_poison_overwrites_every_output_tensor():
    r = ref_stages.routing(torch.tensor([[0, 1]], dtype=torch.int32), 2)
    packed = torch.zeros(2, 4, dtype=torch.uint8)
    out = (packed, torch.zeros(2, dtype=torch.bfloat16), r)
    assert len(tensors_of(out)) == 6
    poison(out)
    assert bool((packed == 0xFF).all()) and bool(out[1].isnan().all())
    assert int(r.expert_offsets.min()) == torch.iinfo(torch.int32).max


# ----------------------------------------------------------------------------- measure


class _Calls:
    """A path function that returns ``good`` for the first ``n_good`` calls, then ``bad``."""

    def __init__(self, good, bad, n_good):
        self.good, self.bad, self.n_good, self.calls = good, bad, n_good, 0

    def __call__(self):
        self.calls += 1
        return self.good if self.calls <= self.n_good else self.bad


def _path(fn, ref, **kw):
    return TimedPath("p", "backend", fn, lambda out: within("out", out, ref, 1e-2), **kw)


def test_measure_reports_a_checked_time_and_metrics():
    ref = torch.ones(4)
    f = moe_floor(TINY, 1, 2, EXAMPLE_CEILINGS)
    row = engine.measure(_path(lambda: ref.clone(), ref, floor=f, bits=NVFP4_BITS), WallTimer(reps=3))
    assert row["status"] == "ok" and row["check_ok"] and row["reps"] == 3 and row["mode"] == "wall"
    assert row["p20_us"] <= row["us"] <= row["p80_us"] and row["pct_roofline"] > 0


def test_measure_never_reports_a_time_for_a_wrong_output():
    ref = torch.ones(4)
    row = engine.measure(_path(lambda: ref * 2, ref), WallTimer())
    assert row["status"] == "failed" and "us" not in row and not row["check_ok"]
    # Right at first, wrong by the end of the timing: the output the last timed call left is checked too.
    row = engine.measure(_path(_Calls(ref, ref * 2, n_good=2), ref), WallTimer(reps=3))
    assert row["status"] == "failed" and "us" not in row and row["check"].startswith("after timing")


def test_measure_separates_errors_from_unavailable_paths():
    def boom():
        raise RuntimeError("kernel exploded")

    def missing():
        raise NotImplementedError("needs Blackwell")

    assert engine.measure(_path(boom, torch.ones(1)), WallTimer())["status"] == "error"
    row = engine.measure(_path(missing, torch.ones(1)), WallTimer())
    assert row["status"] == "unavailable" and "needs Blackwell" in row["note"]
    row = engine.measure(TimedPath("cutlass", "backend", None, None, unavailable="serves sm_100"), WallTimer())
    assert row == {"path": "cutlass", "kind": "backend", "provider": None, "stage": None,
                   "status": "unavailable", "note": "serves sm_100"}


# ----------------------------------------------------------------------------- stage chains


@pytest.fixture(scope="module")
def tiny_case():
    experts = random_experts(TINY, CPU, seed=0)
    return Case(TINY, experts, 6, EXAMPLE_CEILINGS, seed=0, check_tokens=6)


def _run_chain(case, stages):
    return [engine.measure(p, WallTimer(reps=1)) for p in StageChain(case, "p", stages).paths()]


def _broken(**replaced):
    """The reference stage set with some stage functions replaced."""
    return dataclasses.replace(ref_stages.STAGES, **replaced)


def test_stage_chain_of_the_references_passes_every_check(tiny_case):
    rows = _run_chain(tiny_case, ref_stages.STAGES)
    assert [r["stage"] for r in rows] == list(STAGES)
    assert [r["path"] for r in rows] == [f"p/{s}" for s in STAGES]
    assert all(r["status"] == "ok" for r in rows), rows
    assert "whole chain" in rows[-1]["check"]  # the last stage also checks the chain against the W4A4 forward
    assert "tflops" in rows[2] and "tflops" in rows[4] and "tflops" not in rows[0]


def test_stage_chain_of_the_triton_values_stages_passes_every_check():
    """The values operand's stages (fp16 values for a bf16 layer, K16 weights) pass the same checks: the
    values bit for bit against the reference's, the GEMMs against the canonical reference GEMM."""
    import moe_fp4.backends.triton as tb

    case = Case(TINY, random_experts(TINY, CPU, seed=1), 6, EXAMPLE_CEILINGS, seed=0, check_tokens=6)
    rows = _run_chain(case, tb.STAGES_VALUES)
    assert [r["stage"] for r in rows] == list(STAGES)
    assert all(r["status"] == "ok" for r in rows), rows
    assert "whole chain" in rows[-1]["check"]


def test_stage_chain_times_each_stage_on_the_arguments_run_pipeline_passes(tiny_case, monkeypatch):
    from moe_fp4.bench import workload

    calls, pipelines = [], []

    def recording(fn):
        def stage(*args, **kwargs):
            calls.append((fn, args, kwargs))
            return getattr(ref_stages.STAGES, fn)(*args, **kwargs)

        return stage

    def counted(stages, problem, workspace=None):
        pipelines.append(problem)
        return run_pipeline(stages, problem, workspace)

    monkeypatch.setattr(workload, "run_pipeline", counted)
    paths = list(StageChain(tiny_case, "p", _broken(**{f: recording(f) for f in STAGE_FUNCTIONS})).paths())
    assert pipelines == [tiny_case.problem]  # one pipeline run of the case's problem
    assert [c[0] for c in calls] == ["routing", "quantize_rows", "grouped_gemm", "silu_mul_quantize", "grouped_gemm",
                                     "moe_reduce"]
    w13, w2 = ref_stages.STAGES.weights(tiny_case.experts)
    assert calls[2][1][1] is w13 and calls[4][1][1] is w2  # gemm1 and gemm2 by call order
    # Each timed path re-runs the provider's stage on exactly the arguments of its pipeline call.
    pipeline_calls = list(calls)
    for (fn, args, kwargs), path in zip(pipeline_calls, paths, strict=True):
        out = path.fn()
        fn_again, args_again, kwargs_again = calls[-1]
        assert fn_again == fn and len(args_again) == len(args)
        assert all(a is b for a, b in zip(args_again, args))
        assert kwargs_again == kwargs
        assert path.check(out).ok
    # The chain's stages compose to the reference pipeline's forward.
    assert_same_buffers(paths[-1].fn(), run_pipeline(ref_stages.STAGES, tiny_case.problem))


def _gemm_off_by_2_percent(*args, **kwargs):
    return (ref_stages.grouped_gemm(*args, **kwargs).float() * 1.02).to(torch.bfloat16)


def test_a_wrong_gemm_fails_its_row_and_the_next_stages_still_run(tiny_case):
    rows = _run_chain(tiny_case, _broken(grouped_gemm=_gemm_off_by_2_percent))
    status = {r["stage"]: r["status"] for r in rows}
    assert status == {"routing": "ok", "quantize": "ok", "gemm1": "failed", "silu_mul_quantize": "ok",
                      "gemm2": "failed", "reduce": "ok"}
    assert "whole chain" not in rows[-1]["check"]  # fed by reference outputs, so no end-to-end claim


def test_a_failed_stage_hands_the_reference_output_on(tiny_case):
    seen = []

    def silu_recording(h, *args, **kwargs):
        seen.append(h)
        return ref_stages.silu_mul_quantize(h, *args, **kwargs)

    list(StageChain(tiny_case, "p", _broken(grouped_gemm=_gemm_off_by_2_percent,
                                            silu_mul_quantize=silu_recording)).paths())
    p = tiny_case.problem
    r = ref_stages.routing(p.topk_ids, TINY.E)
    a1 = ref_stages.quantize_rows(p.hidden_states, tiny_case.experts.a13_gs, r)
    h = ref_stages.grouped_gemm(a1, ref_stages.STAGES.weights(tiny_case.experts)[0], r, torch.bfloat16)
    assert len(seen) == 1
    assert_same_buffers(seen[0], h)  # gemm1's reference output, not the provider's wrong one


def test_a_single_flipped_quantized_byte_fails_the_bit_exact_check(tiny_case):
    def quantize_one_byte_off(*args, **kwargs):
        q = ref_stages.quantize_rows(*args, **kwargs)
        q.packed[0, 0] ^= 0x10
        return q

    rows = _run_chain(tiny_case, _broken(quantize_rows=quantize_one_byte_off))
    assert [r["status"] for r in rows] == ["ok", "failed", "ok", "ok", "ok", "ok"]
    assert "quantize.packed: 1 of" in rows[1]["check"]


def _raising(exc: Exception):
    def stage(*args, **kwargs):
        raise exc

    return stage


@pytest.mark.parametrize("fn, exc, statuses", [
    ("grouped_gemm", NotImplementedError("the CUTLASS GEMM runs on SM100/SM120 only"),
     ["ok", "ok", "unavailable", "ok", "unavailable", "ok"]),
    ("routing", RuntimeError("illegal memory access"), ["error", "ok", "ok", "ok", "ok", "ok"])])
def test_a_stage_that_raises_is_a_row_saying_why_and_the_rest_are_timed(tiny_case, fn, exc, statuses):
    rows = _run_chain(tiny_case, _broken(**{fn: _raising(exc)}))
    assert [r["status"] for r in rows] == statuses  # unavailable for "cannot run here", else error
    first = next(i for i, status in enumerate(statuses) if status != "ok")
    assert rows[first]["note"] == f"{type(exc).__name__}: {exc}"
    assert "whole chain" not in rows[-1]["check"]


def test_a_pipeline_that_stops_makes_error_rows_of_the_stages_it_did_not_reach(tiny_case):
    def no_weights(experts):
        raise ValueError("weights: cannot be prepared")

    stages = dataclasses.replace(ref_stages.STAGES, prepare_weights=no_weights, weights_key="none")
    rows = _run_chain(tiny_case, stages)
    assert [r["stage"] for r in rows] == list(STAGES)
    assert {r["status"] for r in rows} == {"error"}
    assert rows[0]["note"] == "ValueError: weights: cannot be prepared"


def test_stage_chain_takes_a_stage_set():
    with pytest.raises(TypeError, match="StageSet"):
        StageChain(None, "p", ref_stages)


# ----------------------------------------------------------------------------- peers

_FAKE_KIT = '''
import torch
import torch.nn.functional as F

class Bf16GroupedMoE:
    """Stand-in for the kit's bf16 MoE: per-token float32 loop over the bf16 weights."""
    def __init__(self, w13, w2):
        self.w13, self.w2 = w13, w2

    def __call__(self, x, topk_weights, topk_ids, out=None):
        I = self.w2.shape[2]
        acc = torch.zeros(x.shape[0], self.w2.shape[1])
        for t in range(x.shape[0]):
            for j in range(topk_ids.shape[1]):
                e = int(topk_ids[t, j])
                h = self.w13[e].float() @ x[t].float()
                acc[t] += topk_weights[t, j] * (self.w2[e].float() @ (F.silu(h[:I]) * h[I:]))
        out = torch.empty_like(x) if out is None else out
        return out.copy_(acc)

def load_marlin(path):
    raise RuntimeError("no GPU")
'''


@pytest.fixture
def fake_kit(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, peers._LOADED_NAME, raising=False)
    (tmp_path / "marlin_moe.py").write_text(textwrap.dedent(_FAKE_KIT))
    return tmp_path


def test_peer_config_defaults_the_kit_to_the_library_s_folder(tmp_path):
    lib = tmp_path / "lib.so.xz"
    assert peers.PeerConfig.from_args(None, str(lib)) == peers.PeerConfig(tmp_path, lib)
    assert peers.PeerConfig.from_args("kit", str(lib)).kit_dir == Path("kit")
    assert peers.PeerConfig.from_args(None, None) == peers.PeerConfig(None, None)


def test_peers_without_a_kit_are_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, peers._LOADED_NAME, raising=False)
    experts = random_experts(TINY, CPU, seed=0)
    none = peers.build_peers(experts, peers.PeerConfig())
    assert not none.forwards and set(none.unavailable) == {"marlin", "humming", "bf16"}
    missing = peers.build_peers(experts, peers.PeerConfig(tmp_path))
    assert "marlin_moe.py" in missing.unavailable["bf16"]
    with pytest.raises(FileNotFoundError, match="--peer-kit"):
        peers.load_kit(tmp_path)


def test_peers_from_a_kit_folder(fake_kit, tiny_case):
    built = peers.build_peers(tiny_case.experts, peers.PeerConfig(fake_kit, fake_kit / "lib.so.xz"))
    assert set(built.forwards) == {"bf16"}
    assert "CUDA" in built.unavailable["marlin"]
    assert "Marlin" in built.unavailable["humming"] and "CUDA" in built.unavailable["humming"]
    row = engine.measure(tiny_case.peer_path("bf16", built.forwards["bf16"], None), WallTimer(reps=1))
    assert row["status"] == "ok", row
    with pytest.raises(RuntimeError, match="one kit"):
        peers.load_kit(fake_kit / "elsewhere")


_REAL_KIT = Path(__file__).resolve().parents[1] / ".peer"


@pytest.mark.skipif(not (_REAL_KIT / "marlin_moe.py").is_file(),
                    reason="the peer kit is not in .peer/ (cp ../shared/peers/marlin_moe.py .peer/)")
def test_the_real_kit_s_bf16_peer_passes_the_w4a16_check(tiny_case, monkeypatch):
    monkeypatch.delitem(sys.modules, peers._LOADED_NAME, raising=False)
    built = peers.build_peers(tiny_case.experts, peers.PeerConfig(_REAL_KIT))
    out = built.forwards["bf16"](tiny_case.x, tiny_case.topk_weights, tiny_case.topk_ids)
    res = tiny_case.check_peer(out)
    assert res.ok, res.detail


# ----------------------------------------------------------------------------- engine and reports


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    kit = tmp_path_factory.mktemp("kit")
    (kit / "marlin_moe.py").write_text(textwrap.dedent(_FAKE_KIT))
    saved = sys.modules.pop(peers._LOADED_NAME, None)
    config = engine.BenchConfig(models=(TINY,), tokens=(1, 5), backends=("reference", "cutlass"), device=CPU,
                                peers=peers.PeerConfig(kit), check_tokens=4)
    cases = []
    try:
        rep = engine.run_bench(config, WallTimer(reps=1), EXAMPLE_CEILINGS,
                               on_case=lambda r: cases.append(len(r["cases"])))
    finally:
        sys.modules.pop(peers._LOADED_NAME, None)
        if saved is not None:
            sys.modules[peers._LOADED_NAME] = saved
    assert cases == [1, 2]
    return rep


def test_engine_rows_statuses_and_ratios(tiny_report):
    rows = {(r["M"], r["path"]): r for r in tiny_report["rows"]}
    for M in (1, 5):
        assert rows[(M, "reference")]["status"] == "ok"
        assert rows[(M, "cutlass")]["status"] == "unavailable"  # no CUDA here
        assert rows[(M, "marlin")]["status"] == "unavailable"
        assert rows[(M, "bf16")]["status"] == "ok"
        ref = rows[(M, "reference")]
        assert ref["vs_bf16"] == pytest.approx(rows[(M, "bf16")]["us"] / ref["us"])
        assert all(rows[(M, f"reference/{s}")]["status"] == "ok" for s in STAGES)
        assert all(rows[(M, f"cutlass/{s}")]["status"] == "unavailable" for s in STAGES)
    case = tiny_report["cases"][1]
    assert case["M"] == 5 and case["checked_tokens"] == 4
    assert case["stage_sum_us"]["reference"] == pytest.approx(sum(rows[(5, f"reference/{s}")]["us"] for s in STAGES))
    assert "cutlass" not in case["stage_sum_us"]
    assert tiny_report["models"]["tiny"]["peers_unavailable"].keys() == {"marlin", "humming"}
    resident = tiny_report["models"]["tiny"]["resident"]
    ex = random_experts(TINY, CPU, seed=0)  # the same layer: its NVFP4 tensors, counted independently
    want = sum(t.numel() * t.element_size() for t in (ex.w13, ex.w13_scale, ex.w13_gs, ex.w2, ex.w2_scale, ex.w2_gs,
                                                      ex.a13_gs, ex.a2_gs))
    assert resident["nvfp4_bytes"] == want
    ref = resident["paths"]["reference"]  # the experts plus the cached operands (tensors they share count once)
    assert want <= ref["bytes"] <= want + ref["prepared_bytes"] and ref["x_nvfp4"] == ref["bytes"] / want
    assert "cutlass" not in resident["paths"] and resident["paths"]["bf16"]["x_nvfp4"] > 3  # 16 bits vs 4.5


def _run_tiny(fake_kit, timer, monkeypatch, wrap=None, on_case=None):
    """run_bench on TINY at M = 3 and 4 with the reference backend, its stages and the fake kit's peers; ``wrap(path)``
    may replace a path before it runs. Returns the names in the order they ran and the report (or ContextLost)."""
    ran = []
    measure = engine.measure

    def recording(path, timer):
        ran.append(path.name)
        return measure(wrap(path) if wrap else path, timer)

    monkeypatch.setattr(engine, "measure", recording)
    config = engine.BenchConfig(models=(TINY,), tokens=(3, 4), backends=("reference",), device=CPU,
                                peers=peers.PeerConfig(fake_kit), check_tokens=3, overhead=False)
    try:
        return ran, engine.run_bench(config, timer, EXAMPLE_CEILINGS, on_case=on_case)
    except engine.ContextLost as exc:
        return ran, exc


def test_peers_run_after_moe_fp4_s_paths_humming_last_and_the_report_keeps_its_order(fake_kit, monkeypatch):
    # A peer that faults ends the process's CUDA context: it must cost no moe_fp4 row, and Humming (which has faulted
    # on the H100) no other peer's. The report's rows of a case stay backends, peers as PEERS, stages.
    ran, rep = _run_tiny(fake_kit, WallTimer(reps=1), monkeypatch)
    stages = [f"reference/{s}" for s in STAGES]
    assert ran == ["reference", *stages, "marlin", "bf16", "humming"] * 2
    assert [r["path"] for r in rep["rows"] if r["M"] == 3] == ["reference", "marlin", "humming", "bf16", *stages]
    assert {r["status"] for r in rep["rows"] if r["path"] in ("reference", "bf16", *stages)} == {"ok"}


class _PoisonedTimer(WallTimer):
    """A host timer whose synchronize fails once ``poisoned``, as torch.cuda.synchronize does after an illegal
    address (a sticky error)."""

    poisoned = False

    def synchronize(self) -> None:
        if self.poisoned:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_row_that_ends_the_cuda_context_reports_its_case_and_stops_the_run(fake_kit, monkeypatch):
    timer = _PoisonedTimer(reps=1)

    def fault():
        timer.poisoned = True
        raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")

    def wrap(path):
        return dataclasses.replace(path, fn=fault) if path.name == "reference/gemm1" else path

    reported = []
    ran, exc = _run_tiny(fake_kit, timer, monkeypatch, wrap, on_case=lambda r: reported.append(
        (r, report.render_markdown(r))))
    assert isinstance(exc, engine.ContextLost) and "tiny M=3: reference/gemm1 ended the CUDA context" in str(exc)
    stages = [f"reference/{s}" for s in STAGES]
    gemm1 = stages.index("reference/gemm1")
    assert ran == ["reference", *stages[:gemm1 + 1]]  # nothing after the fault ran, nor M = 4
    assert len(reported) == 1  # the case, with what ran before the fault, was reported
    rep, markdown = reported[0]
    rows = {r["path"]: r for r in rep["rows"]}
    assert [r["M"] for r in rep["cases"]] == [3] and len(rows) == len(rep["rows"]) == 1 + len(stages) + 3
    assert rows["reference"]["status"] == "ok" and rows["reference/gemm1"]["status"] == "error"
    faulted = rows["reference/gemm1"]
    assert faulted["context_lost"] is True and "illegal memory access" in faulted["note"]
    for name in (*stages[gemm1 + 1:], "marlin", "bf16", "humming"):
        assert rows[name]["status"] == "not_run", name
        assert rows[name]["note"].startswith("reference/gemm1 ended the CUDA context before it ran")
    assert "| not run |" in markdown and "not_run at M=3: reference/gemm1 ended the CUDA context" in markdown


def test_overhead_rows_for_every_path_that_passed_at_m1_only(tiny_report):
    got = {(r["M"], r["path"], r["validate"]) for r in tiny_report["overhead"]}
    # cutlass cannot run here (no row passed), M = 5 is not one of OVERHEAD_TOKENS (1, 64); the
    # floor (one torch kernel) is timed beside them.
    assert got == {(1, "floor", None), (1, "reference", False), (1, "reference", True), (1, "bf16", None)}
    for r in tiny_report["overhead"]:
        assert r["wall_us"] > 0 and r["gpu_us"] is None and r["host_us"] is None  # no GPU: wall time only
        assert 0 < r["returns_us"] <= r["wall_us"]  # each call returns before its wall time ends: so do medians


def test_measure_overhead_measures_the_wall_time_of_a_call():
    from moe_fp4.bench.overhead import measure_overhead

    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.002)

    r = measure_overhead(slow, CPU, reps=5)
    assert len(calls) == 3 + 5  # warm-up, then the timed calls
    assert 2000 <= r["wall_us"] < 50_000 and r["gpu_us"] is None
    assert 2000 <= r["returns_us"] <= r["wall_us"]  # the call's own time; on CPU the synchronize is nothing


def test_measure_overheads_interleaves_the_paths():
    from moe_fp4.bench.overhead import measure_overheads

    order = []
    fns = [lambda: order.append("a"), lambda: order.append("b")]
    got = measure_overheads(fns, CPU, reps=4, rounds=2)
    timed = order[6:]  # after three warm-up calls of each
    # Two rounds, each timing a twice then b twice: a slow spell falls on both paths.
    assert timed == ["a", "a", "b", "b", "a", "a", "b", "b"]
    assert all(r["returns_us"] <= r["wall_us"] and r["gpu_us"] is None for r in got)


def test_report_json_round_trip_markdown_and_png(tiny_report, tmp_path):
    written = report.write_all(tiny_report, tmp_path, "cpu-test")
    assert [p.name for p in written] == ["cpu-test.json", "cpu-test.md", "cpu-test.png"]
    assert report.load_json(written[0]) == json.loads(json.dumps(tiny_report))
    md = written[1].read_text()
    for text in ("## tiny (E=8, top-2, H=64, I=64)", "### Whole forward", "### Stages of the reference pipeline",
                 "| M | experts | floor us | bound | reference | cutlass | marlin | humming | bf16 |", "x bf16", "n/a",
                 "### Eager host overhead", "| 1 | reference | True |"):
        assert text in md, text
    assert "Stages of the cutlass pipeline" not in md  # nothing of it ran
    assert written[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = report.terminal_summary(tiny_report)
    assert "tiny: whole forward" in summary and "tiny: reference stages" in summary


def test_markdown_shows_failed_rows_without_a_time():
    row = {"model": "m", "M": 4, "path": "triton", "kind": "backend", "provider": None, "stage": None,
           "status": "failed", "check": "out vs reference backend (W4A4): rel err 0.9 > 0.01", "us": None}
    eager = {"model": "m", "M": 4, "path": "bf16", "kind": "peer", "provider": None, "stage": None, "status": "ok",
             "mode": "eager", "note": "not capturable", "us": 12.0, "p20_us": 11.0, "p80_us": 13.0}
    rep = {"meta": {"date": "2026-01-01T00:00:00", "torch": "t", "cuda": "c", "triton": "x", "python": "p",
                    "moe_fp4": "v", "commit": "abc"},
           "method": {"ceilings": EXAMPLE_CEILINGS.to_dict(), "roofline": "r", "timing": "t", "tolerances": {"a": 0.1},
                      "check_tokens": 1, "routing": "r", "seed": 0},
           "models": {"m": {"E": 8, "topk": 2, "H": 64, "I": 64}},
           "cases": [{"model": "m", "M": 4, "experts_touched": 3, "floor_us": 1.0, "bound": "memory"}],
           "rows": [row, eager], "notes": ["n1"]}
    md = report.render_markdown(rep)
    assert "| 4 | 3 | 1.0 | memory | FAILED | 12.0 [11.0-13.0]* |" in md
    assert "`triton` failed at M=4: out vs reference backend (W4A4): rel err 0.9 > 0.01" in md
    assert "`bf16` timed eagerly (*): not capturable" in md and "- n1" in md


def test_png_without_matplotlib_says_how_to_get_it(tiny_report, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(RuntimeError, match="--no-plot"):
        report.write_png(tiny_report, tmp_path / "x.png")


def test_file_stem_names_the_gpu_and_date():
    assert engine.file_stem({"gpu": "NVIDIA H200", "date": "2026-11-30T10:00:00+00:00"}) == "h200-2026-11-30"
    assert engine.file_stem({"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-30T1"}) == "h100-2026-11-30"
    assert engine.file_stem({"gpu": None, "date": "2026-11-30T1"}) == "cpu-2026-11-30"


def test_driver_version_from_both_kernel_modules():
    closed = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu Oct 30 2025\nGCC version: gcc 12"
    opened = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.57.08  Release Build  (dvs-builder)"
    assert engine.parse_driver_version(closed) == "580.159.04"
    assert engine.parse_driver_version(opened) == "575.57.08"
    assert engine.parse_driver_version("no driver") is None


def test_bench_config_rejects_bad_values():
    with pytest.raises(ValueError, match="backends"):
        engine.BenchConfig(models=(TINY,), tokens=(1,), backends=("nope",), device=CPU)
    with pytest.raises(ValueError, match="tokens"):
        engine.BenchConfig(models=(TINY,), tokens=(0,), backends=(), device=CPU)
    with pytest.raises(ValueError, match="models"):
        engine.BenchConfig(models=(), tokens=(1,), backends=(), device=CPU)


# ----------------------------------------------------------------------------- CLI


def test_cli_parses_the_bench_arguments():
    args = build_parser().parse_args(["bench", "--model", "qwen3-30b-a3b", "--model", "llama4-scout", "--tokens",
                                      "1,16", "--backends", "triton", "--peer-lib", "x/lib.so.xz", "--out", "o"])
    assert args.tokens == (1, 16) and args.backends == ("triton",) and args.peer_lib == "x/lib.so.xz"
    assert [m.name for m in bench_cli.resolve_models(args.model, args.shape)] == ["qwen3-30b-a3b", "llama4-scout"]
    defaults = build_parser().parse_args(["bench"])
    assert [m.name for m in bench_cli.resolve_models(defaults.model, defaults.shape)] == list(MODELS)
    assert defaults.tokens == DEFAULT_TOKENS
    custom = build_parser().parse_args(["bench", "--shape", "8,2,64,64"])
    assert [m.E for m in bench_cli.resolve_models(custom.model, custom.shape)] == [8]


@pytest.mark.parametrize("argv", [["--tokens", "1,x"], ["--tokens", "0,4"], ["--tokens", "4,4"], ["--model", "gpt"],
                                  ["--shape", "1,2,3"], ["--budget-ms", "0"], ["--check-tokens", "-1"]])
def test_cli_rejects_malformed_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", *argv])
    assert exc.value.code == 2
    assert "bench: error: argument" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--backends", "triton,nope"], "--backends: expected names from"),
    (["--peer-lib", "/nonexistent/lib.so.xz"], "--peer-lib: expected the Marlin op library file"),
    (["--device", "tpu"], "--device: expected cuda, cuda:N or cpu"),
    (["--render", __file__], "is not JSON")])
def test_cli_rejects_bad_values_with_a_message(argv, message, capsys, tmp_path):
    assert main(["bench", "--device", "cpu", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cli_without_a_gpu_says_so(capsys):
    assert main(["bench", "--tokens", "1"]) == 2
    assert "expected a visible CUDA GPU" in capsys.readouterr().err


def test_cli_end_to_end_on_cpu_then_render(tmp_path, capsys):
    code = main(["bench", "--device", "cpu", "--shape", "8,2,64,64", "--tokens", "1,3", "--backends", "reference",
                 "--out", str(tmp_path), "--name", "run", "--no-plot", "--commit", "abc123"])
    assert code == 0, capsys.readouterr().err
    rep = report.load_json(tmp_path / "run.json")
    assert rep["meta"]["commit"] == "abc123" and (tmp_path / "run.md").is_file()
    assert {r["status"] for r in rep["rows"] if r["path"].startswith("reference")} == {"ok"}
    assert "custom-E8-top2-H64-I64: whole forward" in capsys.readouterr().out
    assert main(["bench", "--render", str(tmp_path / "run.json"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "run.md").read_text() == (tmp_path / "run.md").read_text()
    assert (tmp_path / "again" / "run.png").is_file()


def test_cli_keeps_the_case_a_lost_cuda_context_ended_and_exits_with_the_error(tmp_path, capsys, monkeypatch):
    # M = 1 runs whole; at M = 2 the second GEMM stage ends the context (as an illegal address does): the report on
    # disk has both cases, M = 2's rows after the fault not run, and the run's error.
    poisoned = []

    def synchronize(self):
        if poisoned:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    measure, seen = engine.measure, []

    def faulting(path, timer):
        seen.append(path.name)
        if path.name == "reference/gemm2" and seen.count(path.name) == 2:
            poisoned.append(True)
            path = dataclasses.replace(path, fn=lambda: 1 / 0)
        return measure(path, timer)

    monkeypatch.setattr(WallTimer, "synchronize", synchronize)
    monkeypatch.setattr(engine, "measure", faulting)
    code = main(["bench", "--device", "cpu", "--shape", "8,2,64,64", "--tokens", "1,2,3", "--backends", "reference",
                 "--out", str(tmp_path), "--name", "run", "--no-plot", "--no-overhead"])
    assert code == 2 and "reference/gemm2 ended the CUDA context" in capsys.readouterr().err
    rep = report.load_json(tmp_path / "run.json")
    assert [c["M"] for c in rep["cases"]] == [1, 2]
    status = {(r["M"], r["path"]): r["status"] for r in rep["rows"]}
    assert {s for (m, p), s in status.items() if m == 1 and p not in engine.PEERS} == {"ok"}  # (no peer kit here)
    assert status[(2, "reference/gemm1")] == "ok" and status[(2, "reference/gemm2")] == "error"
    assert status[(2, "reference/reduce")] == status[(2, "marlin")] == status[(2, "bf16")] == "not_run"
    assert any(n.startswith("run stopped early: ContextLost: custom-E8-top2-H64-I64 M=2") for n in rep["notes"])


def test_cli_without_tqdm_prints_a_line_per_case(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    code = main(["bench", "--device", "cpu", "--shape", "8,2,64,64", "--tokens", "1,2", "--backends", "reference",
                 "--no-stages", "--no-plot", "--out", str(tmp_path)])
    assert code == 0
    err = capsys.readouterr().err
    assert "[1/2 cases, " in err and "[2/2 cases, " in err


def test_cli_without_matplotlib_writes_json_and_markdown_and_says_how_to_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_cli, "have_matplotlib", lambda: False)
    code = main(["bench", "--device", "cpu", "--shape", "8,2,64,64", "--tokens", "2", "--backends", "reference",
                 "--no-stages", "--out", str(tmp_path), "--name", "run"])
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "run.md"]
    assert f"--render {tmp_path / 'run'}.json" in capsys.readouterr().err


@pytest.mark.interpreter
def test_stream_read_kernel_reads_every_word_once():
    # On CPU this runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
    from moe_fp4.bench._stream import _BLOCK, _ITERS, stream_read

    n = 2 * _BLOCK * _ITERS + 5 * 2  # two full programs and a partial third
    x = torch.arange(n, dtype=torch.int32)
    partial = stream_read(x.view(torch.bfloat16))
    assert partial.numel() == 3
    assert int(partial.long().sum()) == int(x.long().sum())


def test_timed_fused_path_matches_fused_moe(tiny_case):
    path = tiny_case.backend_path("reference", None)
    out = path.fn()
    torch.testing.assert_close(out, fused_moe(tiny_case.x, tiny_case.experts, tiny_case.topk_weights,
                                              tiny_case.topk_ids, backend="reference"), rtol=0, atol=0)
    assert path.check(out).ok and path.floor is tiny_case.floor


# ----------------------------------------------------------------------------- fusion_ab's variants


def test_fusion_ab_variants_set_the_switches_they_name_and_restore_them(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fusion_ab as ab

    def switches() -> dict:
        return {"FUSE_SILU": ab.tb.FUSE_SILU, "FUSE_TOPK_REDUCE": ab.tb.FUSE_TOPK_REDUCE,
                "FUSE_SPLIT_K_IN_GEMM": ab.tb.FUSE_SPLIT_K_IN_GEMM, "FUSE_TOPK_IN_GEMM": ab.tb.FUSE_TOPK_IN_GEMM,
                "TOPK_IN_GEMM_MAX": ab.tb.TOPK_IN_GEMM_MAX, "FUSED_ROUTING_MAX": ab.tq.FUSED_ROUTING_MAX,
                "LONG_K_SPLIT": ab.tg.LONG_K_SPLIT}

    before = switches()
    default = dict(before, FUSE_SILU=False, FUSE_TOPK_REDUCE=True, FUSE_SPLIT_K_IN_GEMM=False,
                   FUSE_TOPK_IN_GEMM=False)
    in_gemm = dict(default, FUSE_SPLIT_K_IN_GEMM=True, FUSE_TOPK_IN_GEMM=True)
    want = {
        "topk": default,
        "unfused": dict(default, FUSE_TOPK_REDUCE=False, FUSED_ROUTING_MAX=0),
        "short-k": dict(default, LONG_K_SPLIT=False),
        "split-in-gemm": dict(default, FUSE_SPLIT_K_IN_GEMM=True),
        "topk-in-gemm": dict(default, FUSE_TOPK_IN_GEMM=True),
        "in-gemm": in_gemm,
        "in-gemm-silu": dict(in_gemm, FUSE_SILU="split"),
        "in-gemm-256": dict(in_gemm, TOPK_IN_GEMM_MAX=256),
        "decode-256": dict(in_gemm, FUSE_SILU="split", TOPK_IN_GEMM_MAX=256, FUSED_ROUTING_MAX=256),
        "route-128": dict(default, FUSED_ROUTING_MAX=128),
    }
    for name, expected in want.items():
        with ab.variant(name):
            assert switches() == expected, name
        assert switches() == before, name


def test_fusion_ab_tile_variant_changes_one_row_of_the_values_table_and_restores_it(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fusion_ab as ab

    table, codes = ab.tg.GEMM_VALUES_CONFIGS, ab.tg.GEMM_CONFIGS
    name = ab.tile_variant("8:16,64,256,T,4,3,0")
    assert name == "tile-8-swap16x64x256-w4s3-kA"
    want = ab.tg.GemmConfig(16, 64, 256, True, 4, 3, 0)
    with ab.variant(name):
        assert ab.tg.gemm_config(256 * 8, 256, True) == want  # DeepSeek-V3 M = 256: 8 rows per expert
        assert ab.tg.gemm_config(64 * 8, 256, True) == table[0][1]  # 2 rows: the row before, unchanged
        assert ab.tg.gemm_config(256, 16, True) == table[2][1]  # 16 rows: the row after, unchanged
        assert ab.tg.GEMM_CONFIGS is codes  # the codes table is not the variant's
    assert ab.tg.GEMM_VALUES_CONFIGS is table
    for bad in ("7:16,64,256,T,4,3,0", "8:16,64,256,T,4,3,3"):  # no such row; split_k not a power of two
        with pytest.raises(ValueError):
            ab.tile_variant(bad)


def test_fusion_ab_long_k_variant_moves_the_values_tables_long_k_bound_and_restores_it(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fusion_ab as ab

    tg, before = ab.tg, ab.tg.VALUES_LONG_K_MIN
    decode, row = tg.GEMM_VALUES_CONFIGS[0][1], tg.GEMM_VALUES_CONFIGS[2][1]  # the decode tile, the 9-24 rows' tile
    # DeepSeek-V3 M = 512 (16 rows per expert), its first GEMM (K = 7168): the decode tile by default.
    assert tg.gemm_config(512 * 8, 256, True, 4096, None, 7168) == decode
    with ab.variant("long-k-1000000"):  # the rule off
        assert tg.VALUES_LONG_K_MIN == 1000000
        assert tg.gemm_config(512 * 8, 256, True, 4096, None, 7168) == row
    with ab.variant("long-k-4096"):  # Llama-4-Scout's first GEMM (K = 5120) too
        assert tg.gemm_config(256, 16, True, 16384, None, 5120) == decode
    assert tg.VALUES_LONG_K_MIN == before
    assert tg.gemm_config(256, 16, True, 16384, None, 5120) == row


def test_fusion_ab_no_wide_rows_variant_turns_the_wide_tile_off_and_back_on(monkeypatch):
    """The tree's plan: at 25-96 rows per expert the 64-token swap tile where the grid is not small and K not short
    (132 SMs: NARROW_BELOW * 132 = 1056 tiles); ``no-wide-rows``: the row's 32-token tile for every GEMM."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fusion_ab as ab

    tg = ab.tg
    monkeypatch.setattr(tg, "_sm_count", lambda device: 132)
    monkeypatch.setattr(tg, "_major", lambda device: 9)
    cuda, row = torch.device("cuda"), tg.GEMM_VALUES_CONFIGS[3][1]
    llama1, llama2 = (512, 16, True, 16384, cuda, 5120), (512, 16, True, 5120, cuda, 8192)  # M = 512: 32 rows
    qwen1, qwen2 = (512 * 8, 128, True, 1536, cuda, 2048), (512 * 8, 128, True, 2048, cuda, 768)
    assert tg.VALUES_WIDE_ROWS
    wide = tg.gemm_config(*llama1)
    assert (wide.block_m, wide.block_n, wide.block_k, wide.swap_ab, wide.num_stages) == (64, 128, 128, True, 3)
    assert wide in tg.GEMM_VALUES_TILES
    assert tg.gemm_config(*qwen1) == wide
    assert tg.gemm_config(*llama2) == row  # 640 tiles: a small grid
    assert tg.gemm_config(*qwen2) == row  # K = 768: a short K loop
    assert tg.gemm_config(512, 16, True) == row  # without N and K: the table's row
    assert tg.gemm_config(512, 16, True, 16384, None, 5120) == row  # without a device (its grid unknown) too
    assert tg.gemm_config(256, 16, True, 16384, cuda, 5120) == tg.GEMM_VALUES_CONFIGS[2][1]  # 16 rows: not its row
    assert tg.gemm_config(512, 16, False, 16384, cuda, 5120) == tg.GEMM_CONFIGS[3][1]  # the codes table: its own
    with ab.variant("no-wide-rows"):
        assert {tg.gemm_config(*g) for g in (llama1, llama2, qwen1, qwen2)} == {row}
    assert tg.VALUES_WIDE_ROWS


# ----------------------------------------------------------------------------- tune_triton's baseline


@pytest.fixture
def tune(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import tune_triton

    return tune_triton


def test_tune_baseline_is_the_newest_bench_report_in_the_results_folder(tune, tmp_path):
    def bench_report(name: str, date: str, us: float) -> None:
        rows = [{"model": "m", "M": 4, "path": "triton", "status": "ok", "us": us},
                {"model": "m", "M": 4, "path": "triton/gemm1", "status": "failed", "us": None},
                {"model": "m", "M": 4, "path": "bf16", "status": "ok", "us": 1.0}]
        (tmp_path / name).write_text(json.dumps({"schema": 1, "meta": {"date": date}, "rows": rows}))

    assert tune.default_baseline(tmp_path) is None
    bench_report("z-older.json", "2026-11-28T10:00:00+00:00", 50.0)
    bench_report("a-newer.json", "2026-11-29T10:00:00+00:00", 40.0)
    (tmp_path / "tune-triton.json").write_text(json.dumps({"meta": {"date": "2027-01-01"}, "stages": []}))
    (tmp_path / "broken.json").write_text("{")
    newest = tune.default_baseline(tmp_path)
    assert newest == tmp_path / "a-newer.json"
    # Only the rows the tuning compares with, and only those that ran.
    assert tune.load_baseline(newest) == {("m", 4): {"triton": 40.0}}


def test_tune_summary_compares_with_the_baseline(tune):
    stages = [{"model": "m", "M": 4, "stage": "gemm1", "config": c, "default": d, "status": "ok", "us": us}
              for c, d, us in (("table", True, 30.0), ("fast", False, 20.0))]
    fused = [{"model": "m", "M": 4, "status": "ok", "us": 50.0}]
    lines = tune._summary_lines(stages, fused, {("m", 4): {"triton": 100.0, "marlin": 40.0, "triton/gemm1": 60.0}})
    assert "(2.0x baseline, 0.80x marlin)" in lines[1]
    gemm1 = next(line for line in lines if " gemm1 " in line)
    assert gemm1.split()[1:] == ["30.0", "20.0", "fast", "60.0"]
    assert "baseline" not in "".join(tune._summary_lines(stages, fused, {}))


def test_a_peer_s_known_fault_is_reported_not_launched(tiny_case, monkeypatch):
    # A peer kernel that faults (an illegal address) would end the process and every later row,
    # so a listed (peer, shape, M) is an unavailable row with the reason; other Ms still run.
    shape = tiny_case.shape
    key = ("humming", shape.E, shape.topk, shape.H, shape.I, tiny_case.M)
    monkeypatch.setitem(peers.KNOWN_FAULTS, key, "faults here")
    assert peers.known_fault("humming", shape, tiny_case.M) == "faults here"
    assert peers.known_fault("humming", shape, tiny_case.M + 1) is None
    assert peers.known_fault("marlin", shape, tiny_case.M) is None

    def must_not_run(*args, **kwargs):
        raise AssertionError("a known-fault peer was launched")

    built = peers.Peers(forwards={"humming": must_not_run})
    config = types.SimpleNamespace(backends=(), stages=False, device=CPU)
    rows = {p.name: engine.measure(p, WallTimer(reps=1)) for p in engine._case_paths(tiny_case, config, built, {})}
    assert rows["humming"]["status"] == "unavailable" and rows["humming"]["note"] == "faults here"


def test_the_known_faults_name_real_layers():
    # Each entry keys a layer of the benchmark (a typo would silently never match).
    layers = {(s.E, s.topk, s.H, s.I) for s in MODELS.values()}
    for peer, *dims, m in peers.KNOWN_FAULTS:
        assert peer in engine.PEERS and tuple(dims) in layers and m >= 1


# ----------------------------------------------------------------------------- read_floor's probe


@pytest.fixture
def read_floor(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import read_floor

    return read_floor


def test_read_floor_routes_like_the_benchmark(read_floor, tiny_case):
    # The probe must read the experts the benchmark's forward touches at the same M and seed.
    ids = read_floor.touched(TINY, tiny_case.M, 0, CPU)
    assert ids.dtype == torch.int32 and ids.tolist() == sorted(set(tiny_case.topk_ids.flatten().tolist()))
    assert ids.numel() == tiny_case.n_touched


@pytest.mark.parametrize("chunk_kb", [4, 16])
def test_read_floor_reads_exactly_the_touched_bytes(read_floor, chunk_kb):
    # Each part's partial sums add up to the sum of exactly that part of the touched experts'
    # rows (integer sums: exact); a program past a part's end or a wrong expert would change it.
    shape = ModelShape("t", E=8, topk=2, H=128, I=64)
    w = read_floor.ExpertBytes(shape, CPU)
    assert w.w13_words * 4 >= 2 * 64 * 128 * 9 // 16 and w.w2_words * 4 >= 128 * 64 * 9 // 16
    ids = torch.tensor([1, 4, 7], dtype=torch.int32)
    parts = {"w13": (0, w.w13_words), "w2": (w.w13_words, w.w2_words), "both": (0, w.stride)}
    for part, (lo, n) in parts.items():
        run, grid = w.reader(ids, part, chunk_kb)
        assert grid == 3 * -(-n // (chunk_kb * 256))
        expected = w.buf[ids.long(), lo:lo + n].to(torch.int64).sum().item()
        assert run().to(torch.int64).sum().item() == expected, part


def test_read_floor_run_writes_every_row(read_floor, monkeypatch, tmp_path):
    # The script's plumbing on CPU (WallTimer, fixed ceilings): one row per (layer, M) with the
    # four reads, the forward beside them and the Markdown table; no number here is a measurement.
    monkeypatch.setitem(read_floor.MODELS, "tiny", ModelShape("tiny", E=8, topk=2, H=128, I=64))
    monkeypatch.setattr(read_floor, "measure_ceilings", lambda timer, device: (EXAMPLE_CEILINGS, {}))
    result = read_floor.run(["tiny"], [1, 3], ["reference"], tmp_path, 0, CPU, WallTimer(reps=1))
    rows = json.loads((tmp_path / "read_floor.json").read_text())["rows"]
    assert [(r["M"], r["experts_touched"]) for r in rows] == [(1, 2), (3, 5)] == [
        (r["M"], r["experts_touched"]) for r in result["rows"]]
    for r in rows:
        assert {"w13", "w2", "both", "w13;w2"} <= r.keys()
        assert r["reference"]["status"] == "ok" and r["reference"]["us"] > 0  # checked against the reference
        assert len(r["configs"]) == 3 * 3 + 9 and r["w13;w2"]["config"].startswith("w13;w2/")
        assert r["w13_bytes"] == r["experts_touched"] * 2 * 64 * 128 * 9 // 16
    table = (tmp_path / "read_floor.md").read_text().splitlines()
    assert sum(line.startswith("| tiny |") for line in table) == 2
