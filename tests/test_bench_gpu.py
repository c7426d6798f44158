"""The benchmark's GPU side: cold-L2 graph timing, the measured ceilings, and a small end-to-end run.

Skipped without a GPU. The peers come from ``MOE_FP4_PEER_LIB`` / ``MOE_FP4_PEER_KIT`` as in
the pytest-benchmark suite (without them the peer rows are reported unavailable).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def timer():
    from moe_fp4.bench.timing import GpuTimer

    return GpuTimer(torch.device("cuda", torch.cuda.current_device()), budget_s=0.1)


def test_replays_are_timed_with_a_cold_l2(timer):
    from moe_fp4.bench._stream import stream_read

    # 16 MiB fits in the L2 of a Hopper GPU (50-60 MB). Without the flush the replays read it
    # from L2, which must show up as a clearly shorter time; with it, the read cannot beat the
    # HBM rate of a 2 GiB stream by more than noise.
    small = torch.ones(8 << 20, dtype=torch.bfloat16, device=timer.device)
    partial = stream_read(small)
    prepared = timer.prepare(lambda: stream_read(small, partial))
    cold = timer.time(prepared).median_us
    unflushed = copy.copy(timer)
    unflushed.flush = lambda: None
    warm = unflushed.time(prepared).median_us
    big = torch.ones(1 << 30, dtype=torch.bfloat16, device=timer.device)
    big_partial = stream_read(big)
    hbm_tbps = big.numel() * 2 / (timer.time(timer.prepare(lambda: stream_read(big, big_partial))).median_us * 1e6)
    cold_tbps = small.numel() * 2 / (cold * 1e6)
    assert warm * 1.1 < cold, f"flushed {cold:.2f} us vs unflushed {warm:.2f} us: the flush does not evict the L2"
    assert cold_tbps <= 1.1 * hbm_tbps, f"16 MiB read at {cold_tbps:.2f} TB/s > HBM {hbm_tbps:.2f} TB/s: served from L2"


def test_a_function_that_syncs_is_timed_eagerly_and_says_why(timer):
    x = torch.ones(1024, device=timer.device)
    prepared = timer.prepare(lambda: x * float(x.sum().item()))
    assert prepared.mode == "eager" and "not capturable" in prepared.note
    t = timer.time(prepared)
    assert t.mode == "eager" and t.reps >= 10 and t.p20_us <= t.median_us <= t.p80_us


def test_graph_replay_rewrites_its_output(timer):
    from moe_fp4.bench.workload import poison

    x = torch.arange(4096, dtype=torch.float32, device=timer.device)
    prepared = timer.prepare(lambda: x * 2)
    assert prepared.mode == "graph"
    poison(prepared.static_output)
    torch.testing.assert_close(prepared.run(), x * 2)


@pytest.mark.sm90
def test_ceilings_on_an_h200_are_near_the_spec_anchors(timer):
    from moe_fp4.bench.timing import measure_ceilings

    name = torch.cuda.get_device_name()
    if "H200" not in name:
        pytest.skip(f"the anchors (spec performance.md section 1) were measured on an H200, this is {name}")
    c, _ = measure_ceilings(timer, timer.device)
    # Anchors: copy 4.25-4.3 TB/s, read-only stream 4.44-4.55 TB/s, bf16 matmul ~707-790 TFLOP/s.
    # The bounds leave room for clocks and power, but a miscounted byte or FLOP (x2) falls outside.
    assert 3.4 <= c.copy_tbps <= 5.2, c
    assert 3.6 <= c.stream_tbps <= 5.4, c
    assert 500 <= c.bf16_tflops <= 1000, c


def test_small_end_to_end_run_checks_every_path(tmp_path):
    from moe_fp4.backends.registry import availability
    from moe_fp4.bench import engine, report
    from moe_fp4.bench.peers import PeerConfig
    from moe_fp4.bench.shapes import ModelShape
    from moe_fp4.bench.timing import GpuTimer, measure_ceilings

    dev = torch.device("cuda", torch.cuda.current_device())
    timer = GpuTimer(dev, budget_s=0.05)
    ceilings, how = measure_ceilings(timer, dev, copy_bytes=256 << 20, matmul_n=4096)
    peers = PeerConfig.from_args(os.environ.get("MOE_FP4_PEER_KIT"), os.environ.get("MOE_FP4_PEER_LIB"))
    shape = ModelShape("small", E=16, topk=4, H=1024, I=512)
    config = engine.BenchConfig(models=(shape,), tokens=(1, 64, 1000), backends=engine.default_backends(),
                                device=dev, peers=peers, check_tokens=64)
    rep = engine.run_bench(config, timer, ceilings, ceilings_method=how)
    report.write_all(rep, tmp_path, "small")
    bad = [r for r in rep["rows"] if r["status"] in ("failed", "error")]
    assert not bad, bad
    rows = {(r["M"], r["path"]): r for r in rep["rows"]}
    if availability("triton", dev, torch.bfloat16) is None:
        for M in config.tokens:
            assert rows[(M, "triton")]["status"] == "ok" and rows[(M, "triton")]["mode"] == "graph"
            assert all(rows[(M, f"triton/{s}")]["status"] == "ok" for s in
                       ("routing", "quantize", "gemm1", "silu_mul_quantize", "gemm2", "reduce"))
    if peers.kit_dir is not None:
        assert all(rows[(M, "bf16")]["status"] == "ok" for M in config.tokens)
    if peers.lib is not None and torch.cuda.get_device_capability() == (9, 0):
        assert all(rows[(M, "marlin")]["status"] == "ok" for M in config.tokens)
