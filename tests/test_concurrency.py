"""One :class:`~moe_fp4.NvFp4Experts` used concurrently on the GPU: from two CUDA streams at once, from
two host threads at once, and through a CUDA graph replayed among eager calls of other sizes.

The backends are deterministic (no atomics; every sum has a fixed order), so each output must equal,
bit for bit, the same call made alone: every test first makes its calls one by one on the default
stream (the references), then again concurrently, and compares byte for byte. What can break that
is shared state: calls of one layer shape share a cached workspace (``moe_fp4.pipeline.
cached_workspace``: routing, intermediates, split-K and routing scratch) and the experts' prepared
weights; a call on one stream must not use intermediates that a call on another stream is still
writing or reading. One reference per test is also held to the reference backend (the grid
tests' bounds), so a consistently wrong result cannot pass either.

GPU only (``gpu``; cutlass on compute capability 9.x, ``sm90``). Shapes are moderate (E = 64,
H = 2048, I = 512, top-8) so that the kernels of two streams overlap and the whole file runs in
seconds.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from moe_cases import GPU_BACKENDS, gpu_experts
from test_triton_moe import MAX_TOL, RMS_TOL

from moe_fp4 import NvFp4Experts, fused_moe
from moe_fp4.testing import assert_same_buffers, errors

pytestmark = pytest.mark.gpu

E, H, I, TOPK = 64, 2048, 512, 8
FIELDS = ("w13", "w13_scale", "w13_gs", "w2", "w2_scale", "w2_gs", "a13_gs", "a2_gs")


@pytest.fixture(scope="module")
def experts() -> NvFp4Experts:
    return gpu_experts(E, H, I, torch.bfloat16, split=True, seed=31)


def inputs(m: int, seed: int, e: int = E, h: int = H) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x bf16 [m, H], router weights float32 [m, 8], ids int32 [m, 8]) on the GPU, made on the current stream."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, h, generator=gen, device="cuda") / 3).to(torch.bfloat16)
    w, ids = torch.softmax(torch.randn(m, e, generator=gen, device="cuda"), -1).topk(TOPK, -1)
    return x, w.contiguous(), ids.to(torch.int32).contiguous()


def call(ex: NvFp4Experts, backend: str, x, w, ids, out: torch.Tensor | None = None) -> torch.Tensor:
    # validate=False: no host synchronization, so calls on different streams really are in flight together.
    return fused_moe(x, ex, w, ids, backend=backend, out=out, validate=False)


def alone(ex: NvFp4Experts, backend: str, calls: list[tuple]) -> list[torch.Tensor]:
    """Each call by itself on the default stream, in order, finished before this returns."""
    outs = [call(ex, backend, *c) for c in calls]
    torch.cuda.synchronize()
    return outs


def assert_anchored(ex: NvFp4Experts, x, w, ids, got: torch.Tensor) -> None:
    """``got`` within the grid tests' bounds of the reference backend (same products, another fp32 order)."""
    rms, mx = errors(got, fused_moe(x, ex, w, ids, backend="reference"))
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)


def assert_all_same(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]], what: str) -> None:
    for i, (g_row, w_row) in enumerate(zip(got, want, strict=True)):
        for k, (g, w) in enumerate(zip(g_row, w_row, strict=True)):
            assert_same_buffers(g, w, what=f"{what}: caller {i}, call {k}")


# --------------------------------------------------------------------------- two streams


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("m", [1, 600, 2100], ids=["m1-split-k", "m600-routing-per-tile", "m2100-routing-multi-launch"])
def test_two_streams_at_once(experts, backend, m):
    """Two streams, six forwards each of the same shape (one workspace) with different inputs, launched
    interleaved with no synchronization in between. M = 1: 8 rows over 64 experts, the decode GEMM
    configuration (on the H200 Triton splits GEMM1's K = 2048 in two, its partial sums in the
    workspace's scratch; the sm_90a GEMM splits K inside the CTA); M = 600: 4800 slots, the CUDA routing's
    one launch of a block per tile (no scratch) and Triton's chunked routing; M = 2100: 16800 slots, past
    that bound the CUDA routing's three launches (their counters in the workspace's scratch)."""
    per_stream = 6
    calls = [[inputs(m, 1000 * s + k) for k in range(per_stream)] for s in range(2)]
    want = [alone(experts, backend, c) for c in calls]
    assert_anchored(experts, *calls[0][0], want[0][0])
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())  # the inputs were made on the default stream
    got: list[list[torch.Tensor]] = [[], []]
    for k in range(per_stream):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                got[i].append(call(experts, backend, *calls[i][k]))
    torch.cuda.synchronize()
    assert_all_same(got, want, f"{backend}, two streams, M = {m}")


# --------------------------------------------------------------------------- two host threads


def run_in_threads(ex: NvFp4Experts, backend: str, calls: list[list[tuple]]) -> list[list[torch.Tensor]]:
    """One host thread per list of calls, each on its own stream, started together; their outputs.

    The interpreter switches threads every 10 us meanwhile (default 5 ms), so that the launches of
    the two threads interleave finely.
    """
    got: list[list[torch.Tensor]] = [[] for _ in calls]
    failures: list[BaseException] = []
    start = threading.Barrier(len(calls))
    streams = [torch.cuda.Stream() for _ in calls]
    torch.cuda.synchronize()  # the inputs exist before any thread starts

    def worker(i: int) -> None:
        try:
            with torch.cuda.stream(streams[i]):
                start.wait()
                for c in calls[i]:
                    got[i].append(call(ex, backend, *c))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread below
            failures.append(exc)
            start.abort()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads), "a thread did not finish within 300 s"
    if failures:
        raise failures[0]
    torch.cuda.synchronize()
    return got


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_two_host_threads_at_once(experts, backend):
    """Two threads, each with its own stream, 24 forwards each of one shape (M = 64) with different inputs."""
    calls = [[inputs(64, 2000 * s + k) for k in range(24)] for s in range(2)]
    want = [alone(experts, backend, c) for c in calls]
    assert_anchored(experts, *calls[1][5], want[1][5])
    assert_all_same(run_in_threads(experts, backend, calls), want, f"{backend}, two threads")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_two_host_threads_on_first_use(backend):
    """The same, but the threads make the first calls of new experts and of a new layer shape: the
    workspace, the prepared weights and the experts' operator view are created while both threads
    run. The references come afterwards, from a copy of the experts (its own prepared weights)."""
    e, h, i = 40, 512, 256  # a layer shape no other test of this file uses: no workspace yet
    fresh = gpu_experts(e, h, i, torch.bfloat16, split=False, seed=47)
    calls = [[inputs(48, 3000 * s + k, e=e, h=h) for k in range(16)] for s in range(2)]
    got = run_in_threads(fresh, backend, calls)
    copy = NvFp4Experts(*(getattr(fresh, f).clone() for f in FIELDS))
    want = [alone(copy, backend, c) for c in calls]
    assert_anchored(copy, *calls[0][0], want[0][0])
    assert_all_same(got, want, f"{backend}, two threads on first use")


# --------------------------------------------------------------------------- a CUDA graph among eager calls


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_graph_replays_among_eager_calls_of_other_sizes(experts, backend):
    """A graph captured at M = 9 (72 slots: the 128-slot workspace), replayed after eager calls at M = 16
    (the same workspace, all of it) and M = 300 (another one), and after eager M = 9 calls with other
    inputs; eager calls after the replays too. Every output equals the same call made alone."""
    m_graph = 9
    static = inputs(m_graph, 4000)
    out_graph = torch.empty_like(static[0])
    call(experts, backend, *static, out=out_graph)  # warm-up: kernels, workspace, prepared weights
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(experts, backend, *static, out=out_graph)

    steps = [("eager", 16), ("eager", 300), ("replay", m_graph), ("eager", m_graph), ("eager", m_graph),
             ("replay", m_graph), ("eager", 16), ("eager", 300), ("replay", m_graph), ("eager", m_graph)]
    step_inputs = [inputs(m, 4100 + k) for k, (_, m) in enumerate(steps)]
    want = alone(experts, backend, step_inputs)
    assert_anchored(experts, *step_inputs[1], want[1])

    got = []
    for (kind, _), inp in zip(steps, step_inputs, strict=True):  # all on the default stream, no synchronization
        if kind == "eager":
            got.append(call(experts, backend, *inp))
        else:
            for dst, src in zip(static, inp, strict=True):
                dst.copy_(src)
            out_graph.fill_(float("nan"))
            graph.replay()
            got.append(out_graph.clone())
    torch.cuda.synchronize()
    for k, ((kind, m), g, w) in enumerate(zip(steps, got, want, strict=True)):
        assert_same_buffers(g, w, what=f"{backend}, step {k} ({kind}, M = {m})")
