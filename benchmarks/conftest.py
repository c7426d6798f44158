"""Fixtures of the pytest-benchmark suite (GPU only; every test is skipped without CUDA).

The suite uses the engine of ``moe-fp4 bench`` (``moe_fp4.bench``): the same weights, inputs,
checks, CUDA-graph cold-L2 timing and roofline, so a row here and a row of the CLI's report
are the same measurement. Peers come from the kit named by the environment:

* ``MOE_FP4_PEER_LIB``: vLLM 0.26.0's ``_moe_C`` library (``.so.xz``) for the Marlin peer;
* ``MOE_FP4_PEER_KIT``: the folder of ``marlin_moe.py`` (default: the folder of the library).

One layer's weights live at a time (the DeepSeek-V3-like layer takes 6.3 GB in NVFP4 plus its
peers), so run the tests in their collected order.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    # benchmarks/ can be run on its own, without tests/conftest.py: skip GPU tests here too.
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none here)"))


class BenchSession:
    """Everything the suite shares: the timer, the ceilings, the current layer and its cases."""

    def __init__(self) -> None:
        from moe_fp4.bench.peers import PeerConfig
        from moe_fp4.bench.timing import GpuTimer, measure_ceilings

        self.device = torch.device("cuda", torch.cuda.current_device())
        self.timer = GpuTimer(self.device)
        self.ceilings, _ = measure_ceilings(self.timer, self.device)
        self.peer_config = PeerConfig.from_args(os.environ.get("MOE_FP4_PEER_KIT"), os.environ.get("MOE_FP4_PEER_LIB"))
        self._model: str | None = None
        self.experts = self.peers = None
        self._cases: dict = {}
        self._peer_rows: dict = {}
        self._stage_paths: dict = {}

    def _layer(self, model: str) -> None:
        from moe_fp4.bench.engine import release
        from moe_fp4.bench.peers import build_peers
        from moe_fp4.bench.shapes import MODELS
        from moe_fp4.bench.workload import random_experts

        if model == self._model:
            return
        self.experts = self.peers = None
        self._cases.clear()
        self._peer_rows.clear()
        self._stage_paths.clear()
        release(self.device)
        self.experts = random_experts(MODELS[model], self.device, seed=0)
        self.peers = build_peers(self.experts, self.peer_config)
        self._model = model

    def case(self, model: str, M: int):
        """The inputs of (layer, M), the same as ``moe-fp4 bench --seed 0`` uses."""
        from moe_fp4.bench.shapes import MODELS
        from moe_fp4.bench.workload import Case

        self._layer(model)
        if M not in self._cases:
            self._cases.clear()  # one M at a time
            self._stage_paths.clear()
            self._cases[M] = Case(MODELS[model], self.experts, M, self.ceilings, seed=0, check_tokens=256)
        return self._cases[M]

    def stage_path(self, model: str, M: int, provider: str, stage: str):
        """The path of one stage of ``provider``'s pipeline on (layer, M); the pipeline runs (and its
        stages are checked) once per (layer, M, provider), for all six stage tests."""
        from moe_fp4.bench.engine import stage_set
        from moe_fp4.bench.workload import StageChain

        case = self.case(model, M)
        if provider not in self._stage_paths:
            self._stage_paths.clear()  # one provider's intermediates at a time
            self._stage_paths[provider] = list(StageChain(case, provider, stage_set(provider)).paths())
        return next(p for p in self._stage_paths[provider] if p.stage == stage)

    def peer_path(self, model: str, M: int, name: str):
        case = self.case(model, M)
        return case.peer_path(name, self.peers.forwards.get(name), self.peers.unavailable.get(name))

    def peer_us(self, model: str, M: int) -> dict[str, float]:
        """Checked median µs of each peer that runs, measured once per (layer, M)."""
        from moe_fp4.bench.engine import PEER_RUN_ORDER, measure

        key = (model, M)
        if key not in self._peer_rows:
            self._peer_rows[key] = {p: measure(self.peer_path(model, M, p), self.timer) for p in PEER_RUN_ORDER}
        return {p: r["us"] for p, r in self._peer_rows[key].items() if r["status"] == "ok"}

    def run(self, benchmark, path, peer_us: dict[str, float]) -> dict:
        """Check, time (CUDA events: ``extra_info``) and check again ``path``; pytest-benchmark's own
        rounds replay the same graph with the L2 flushed in ``setup`` (host clock, incl. launch and sync)."""
        from moe_fp4.bench.engine import measure, release

        def pedantic(prepared) -> None:
            def replay() -> None:
                prepared.run()
                self.timer.synchronize()

            benchmark.pedantic(replay, setup=self.timer.flush, rounds=20, warmup_rounds=2)

        row = measure(path, self.timer, after_timing=pedantic)
        release(self.device)  # the path's graph (a stage chain's intermediates stay for its other stages)
        if row["status"] == "unavailable":
            pytest.skip(f"{path.name}: {row['note']}")
        if row["status"] != "ok":
            pytest.fail(f"{path.name}: {row['status']}: {row.get('check') or row.get('note')}")
        for name, us in peer_us.items():
            if name != path.name:
                row[f"vs_{name}"] = us / row["us"]
        benchmark.extra_info.update({k: v for k, v in row.items() if v is not None})
        return row


@pytest.fixture(scope="session")
def bench() -> BenchSession:
    return BenchSession()
