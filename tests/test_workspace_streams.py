"""Workspace safety across CUDA streams and host threads (``pipeline.Workspace``), checked on the CPU.

Forwards that share a cached workspace hold its lock while they enqueue, and a forward on
another stream than the previous one first waits on that stream (``StreamOrder``), except
during CUDA-graph capture. The stream bookkeeping is checked here with fake streams; the GPU
concurrency tests (real streams and threads) are in ``tests/test_concurrency.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from moe_cases import Case, make_experts, make_inputs

from moe_fp4 import pipeline
from moe_fp4.moe import MoEProblem
from moe_fp4.pipeline import StageSet, StreamOrder, Workspace, cached_workspace, run_pipeline

CUDA0 = torch.device("cuda", 0)


class FakeStream:
    """A ``torch.cuda.Stream`` as the bookkeeping uses it: ``wait_stream`` and identity."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waited_on: list[str] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited_on.append(other.name)


@pytest.fixture
def streams(monkeypatch):
    """``current(name)`` makes the named fake stream the current one; ``capturing(flag)`` fakes graph capture."""
    state = {"current": None, "capturing": False, "asked": 0}

    def current_stream(device=None):
        state["asked"] += 1
        return state["current"]

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(pipeline, "_capturing", lambda device: state["capturing"])

    class Streams:
        def current(self, stream: FakeStream) -> None:
            state["current"] = stream

        def capturing(self, flag: bool) -> None:
            state["capturing"] = flag

        @property
        def asked(self) -> int:
            return state["asked"]

    return Streams()


def test_the_first_forward_records_its_stream_and_waits_on_nothing(streams):
    order, s1 = StreamOrder(), FakeStream("s1")
    streams.current(s1)
    order.enter(101, CUDA0)
    assert (order.handle, order.stream) == (101, s1) and s1.waited_on == []


def test_forwards_on_one_stream_do_not_wait_nor_ask_for_the_stream(streams):
    order, s1 = StreamOrder(), FakeStream("s1")
    streams.current(s1)
    order.enter(101, CUDA0)
    asked = streams.asked
    for _ in range(3):
        order.enter(101, CUDA0)
    assert streams.asked == asked  # the raw handle alone decides: no torch.cuda.Stream is built
    assert s1.waited_on == []


def test_a_forward_on_another_stream_waits_on_the_previous_one(streams):
    order, s1, s2, s1_again = StreamOrder(), FakeStream("s1"), FakeStream("s2"), FakeStream("s1")
    streams.current(s1)
    order.enter(101, CUDA0)
    streams.current(s2)
    order.enter(202, CUDA0)
    assert s2.waited_on == ["s1"] and (order.handle, order.stream) == (202, s2)
    order.enter(202, CUDA0)
    assert s2.waited_on == ["s1"]  # once per switch
    streams.current(s1_again)
    order.enter(101, CUDA0)
    assert s1_again.waited_on == ["s2"] and order.stream is s1_again


def test_capture_neither_waits_nor_becomes_the_last_stream(streams):
    order, s1, graph_stream, s2 = StreamOrder(), FakeStream("s1"), FakeStream("capture"), FakeStream("s2")
    streams.current(s1)
    order.enter(101, CUDA0)
    streams.current(graph_stream)
    streams.capturing(True)
    order.enter(303, CUDA0)  # a capture cannot wait on work outside it
    assert graph_stream.waited_on == [] and (order.handle, order.stream) == (101, s1)
    streams.capturing(False)
    streams.current(s1)
    order.enter(101, CUDA0)  # back on the warm-up stream after the capture: in order already
    assert s1.waited_on == []
    streams.current(s2)
    order.enter(202, CUDA0)
    assert s2.waited_on == ["s1"]  # the captured "work" was never the workspace's last


def test_capture_on_the_eager_stream_is_in_order_already(streams):
    order, s1 = StreamOrder(), FakeStream("s1")
    streams.current(s1)
    order.enter(101, CUDA0)
    streams.capturing(True)
    order.enter(101, CUDA0)
    assert s1.waited_on == [] and order.handle == 101


def _workspace() -> Workspace:
    return Workspace.allocate(16, 4, 64, 32, torch.bfloat16, torch.device("cpu"))


def test_the_workspace_orders_only_cuda_forwards(streams, monkeypatch):
    ws = _workspace()
    assert ws.enter(torch.device("cpu")) is None and ws.order.handle is None  # host execution: nothing to order
    s1, s2 = FakeStream("s1"), FakeStream("s2")
    handles = {0: 101}
    monkeypatch.setattr(pipeline, "_raw_stream", lambda index: handles[index])
    streams.current(s1)
    assert ws.enter(CUDA0) == 101
    handles[0] = 202
    streams.current(s2)
    assert ws.enter(CUDA0) == 202 and s2.waited_on == ["s1"]


def test_workspaces_have_their_own_lock_and_order():
    a, b = _workspace(), _workspace()
    assert a.lock is not b.lock and a.order is not b.order
    assert a.lock.acquire(blocking=False)
    assert b.lock.acquire(blocking=False)  # one workspace's forward does not hold up another's
    a.lock.release()
    b.lock.release()


# --------------------------------------------------------------------------- host threads

CASE = Case(3, 4, 2, 64, 32, note="a small layer: 6 slots in a 16-slot workspace")
STAGE_NAMES = ("routing", "quantize_rows", "grouped_gemm", "silu_mul_quantize", "grouped_gemm", "moe_reduce")


class SlowKernels:
    """Kernels that write nothing and record ``(thread, stage)`` around a short sleep, so that two
    forwards that were not serialized would interleave their records."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def _stage(self, name: str) -> None:
        self.log.append((threading.current_thread().name, name))
        time.sleep(0.002)

    def routing(self, topk_ids, out, scratch):
        self._stage("routing")

    def quantize_rows(self, x, gs, routing, gather, row_scale, out, config):
        self._stage("quantize_rows")

    def grouped_gemm(self, a, w, routing, out, scratch, config):
        self._stage("grouped_gemm")

    def silu_mul_quantize(self, h, gs, routing, out, config):
        self._stage("silu_mul_quantize")

    def moe_reduce(self, y, routing, topk_weights, out):
        self._stage("moe_reduce")


@pytest.mark.parametrize("warm", [False, True], ids=["first-runs", "plans"])
def test_threads_sharing_a_workspace_never_interleave_their_forwards(warm):
    kernels = SlowKernels()
    stages = StageSet.from_kernels("slow", kernels)
    gen = torch.Generator().manual_seed(CASE.seed)
    ex = make_experts(CASE, gen)
    x, w, ids = make_inputs(CASE, gen)
    problem = MoEProblem(x, ex, w, ids, False, None)
    ws = cached_workspace(stages, problem)
    if warm:
        run_pipeline(stages, problem, ws)  # the checked first run; the threads then run the plan
        kernels.log.clear()
    errors = []

    def forwards() -> None:
        try:
            for _ in range(3):
                run_pipeline(stages, problem, ws)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=forwards, name=f"t{i}") for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    log = kernels.log
    assert len(log) == 3 * 3 * len(STAGE_NAMES)
    for start in range(0, len(log), len(STAGE_NAMES)):
        forward = log[start : start + len(STAGE_NAMES)]
        assert [stage for _, stage in forward] == list(STAGE_NAMES), forward
        assert len({thread for thread, _ in forward}) == 1, f"interleaved forwards: {forward}"


def test_concurrent_first_calls_share_one_cached_workspace(monkeypatch):
    """Two threads that find no workspace for a shape both allocate one; the cache keeps the first,
    and both use it."""
    stages = StageSet.from_kernels("slow-ws", SlowKernels())
    gen = torch.Generator().manual_seed(CASE.seed)
    ex = make_experts(CASE, gen)
    x, w, ids = make_inputs(CASE, gen)
    problem = MoEProblem(x, ex, w, ids, False, None)
    monkeypatch.setattr(pipeline, "_WORKSPACES", {})
    barrier = threading.Barrier(2)
    allocate = Workspace.allocate.__func__

    def slow_allocate(cls, *args, **kwargs):
        barrier.wait()  # both threads have missed the cache
        return allocate(cls, *args, **kwargs)

    monkeypatch.setattr(Workspace, "allocate", classmethod(slow_allocate))
    got: list[Workspace] = []
    threads = [threading.Thread(target=lambda: got.append(cached_workspace(stages, problem))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2 and got[0] is got[1] is cached_workspace(stages, problem)


def test_a_capture_reuses_the_warm_up_workspace_and_allocates_nothing(monkeypatch):
    """A forward under (faked) graph capture finds the eager warm-up's workspace, for the same shape and
    for another one of the same bucket (a new plan, no new buffer); a shape with no workspace yet raises."""
    stages = StageSet.from_kernels("slow-capture", SlowKernels())
    gen = torch.Generator().manual_seed(CASE.seed)
    ex = make_experts(CASE, gen)
    x, w, ids = make_inputs(CASE, gen)
    monkeypatch.setattr(pipeline, "_WORKSPACES", {})
    warm = MoEProblem(x, ex, w, ids, False, None)
    run_pipeline(stages, warm, cached_workspace(stages, warm))
    workspace = cached_workspace(stages, warm)
    monkeypatch.setattr(pipeline, "_capturing", lambda device: True)
    for problem in (warm, MoEProblem(x[:2], ex, w[:2], ids[:2], False, None)):  # 6 and 4 slots: one bucket
        assert cached_workspace(stages, problem) is workspace
        run_pipeline(stages, problem, workspace)
    assert len(workspace.plans[ex]) == 2
    big = MoEProblem(x.repeat(4, 1), ex, w.repeat(4, 1), ids.repeat(4, 1), False, None)  # 24 slots: a new bucket
    with pytest.raises(RuntimeError, match="would be allocated during CUDA-graph capture"):
        cached_workspace(stages, big)
