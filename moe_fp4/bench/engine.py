"""The benchmark loop: for each layer and M, check then time every path, and collect a report.

A report is a JSON-ready dict (written by :mod:`.report`)::

    meta      GPU, driver, torch, CUDA, triton, Python, moe_fp4 version, commit, date, device
    method    timing protocol, ceilings and how they were measured, check tolerances
    models    per layer: shape, setup seconds, peers that could not be built and why
    cases     per (layer, M): experts touched, checked tokens, the roofline floor, stage sums
    rows      per (layer, M, path): status, µs (median, p20, p80), reps, mode, TFLOP/s, weight
              TB/s, % of roofline, ratios to each peer, the check's outcome, notes
    notes     anything that went wrong outside a row

A row's ``status`` is ``ok`` (checked, then timed, then checked again), ``failed`` (its output
did not pass the check: no time is reported), ``error`` (it raised), ``unavailable`` (it
cannot run here; the reason is in ``note``) or ``not_run`` (an earlier row of its case ended the
CUDA context: its ``context_lost`` is true, and :class:`ContextLost` ends the run once the case is
reported). Ratios ``vs_<peer>`` are ``peer µs / row µs``: above 1 means the row is faster than
that peer.

In a case, moe_fp4's paths (backends, then stages) run before the peers, and the peers in
:data:`PEER_RUN_ORDER`; the report keeps a case's rows in the order backends, peers (as
:data:`PEERS`), stages.
"""

from __future__ import annotations

import datetime
import functools
import gc
import importlib.metadata
import platform
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from .. import stages as ref_stages
from ..backends.registry import BACKENDS, get_backend_module, why_unavailable
from ..moe import fused_moe
from ..pipeline import StageSet
from .checks import ACT_QUANT_REL_TOL, BF16_ULP_REL_TOL, FUSED_REL_TOL, PEER_REL_TOL
from .memory import resident_memory
from .overhead import OVERHEAD_TOKENS, measure_overheads
from .peers import PeerConfig, build_peers, known_fault
from .roofline import Ceilings, row_metrics
from .shapes import ModelShape
from .workload import (
    STAGES,
    Case,
    StageChain,
    TimedPath,
    describe_exception,
    is_unavailable,
    poison,
    random_experts,
)

__all__ = ["PEERS", "PEER_RUN_ORDER", "BenchConfig", "ContextLost", "default_backends", "environment", "file_stem",
           "measure", "parse_driver_version", "release", "run_bench", "stage_set"]

PEERS = ("marlin", "humming", "bf16")
# The order a case runs its peers in, after every moe_fp4 path: a kernel that faults ends the CUDA context, and every
# later row of the process with it, so the peer that has faulted here (Humming: an illegal address at Qwen3-30B-A3B
# M = 512 on the H100 in the forty-sixth and forty-seventh sessions, besides its KNOWN_FAULTS entry) goes last.
PEER_RUN_ORDER = ("marlin", "bf16", "humming")
_KIND_ORDER = {"backend": 0, "peer": 1, "stage": 2}


class ContextLost(RuntimeError):
    """A row ended the CUDA context with a sticky error (an illegal address): no later row can run. Raised by
    :func:`run_bench` once that row's case is in the report (its later rows ``not_run``)."""


def default_backends() -> tuple[str, ...]:
    """Every registered backend but ``reference`` (float64 loops: far too slow at these shapes)."""
    return tuple(b for b in BACKENDS if b != "reference")


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run covers."""

    models: tuple[ModelShape, ...]
    tokens: tuple[int, ...]
    backends: tuple[str, ...]
    device: torch.device
    stages: bool = True
    peers: PeerConfig = field(default_factory=PeerConfig)
    seed: int = 0
    check_tokens: int = 256
    overhead: bool = True  # eager host overhead at the M of OVERHEAD_TOKENS that are timed

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models: expected at least one model shape, got none")
        if not self.tokens or any(not isinstance(m, int) or m < 1 for m in self.tokens):
            raise ValueError(f"tokens: expected positive token counts, got {list(self.tokens)}")
        unknown = [b for b in self.backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"backends: expected names from {list(BACKENDS)}, got {unknown}")
        if self.check_tokens < 1:
            raise ValueError(f"check_tokens: expected at least 1, got {self.check_tokens}")


def stage_set(backend: str, device: torch.device | None = None) -> StageSet:
    """The :class:`~moe_fp4.pipeline.StageSet` of ``backend``'s pipeline on ``device``
    (``reference``: ``moe_fp4.stages.STAGES``; a backend with ``stages_for(device)`` picks per device)."""
    if backend == "reference":
        return ref_stages.STAGES
    mod = get_backend_module(backend)
    pick = getattr(mod, "stages_for", None)
    stages = pick(device) if (pick is not None and device is not None) else getattr(mod, "STAGES", None)
    if not isinstance(stages, StageSet):
        raise NotImplementedError(f"{mod.__name__} has no StageSet STAGES of its pipeline's stages")
    return stages


# ----------------------------------------------------------------------------- environment


def parse_driver_version(text: str) -> str | None:
    """The driver version in ``/proc/driver/nvidia/version`` (proprietary or open kernel module)."""
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text)
    return found.group(1) if found else None


def _driver_version() -> str | None:
    try:
        version = parse_driver_version(Path("/proc/driver/nvidia/version").read_text())
        if version:
            return version
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def _git_commit() -> str | None:
    repo = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=20,
                              check=True).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+uncommitted-changes" if dirty else "")


def environment(device: torch.device, commit: str | None = None) -> dict:
    """Versions, device and commit of this run (``commit``: given, else ``git rev-parse HEAD``, else None)."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit or _git_commit(),
        "moe_fp4": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "device": str(device),
        "gpu": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, cc=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1), driver=_driver_version())
    return env


def file_stem(meta: dict) -> str:
    """``<gpu>-<date>``, e.g. ``h200-2026-11-30`` for an NVIDIA H200 (``cpu-...`` without a GPU)."""
    name = (meta.get("gpu") or "cpu").lower().replace("nvidia", "").split()
    slug = re.sub(r"[^a-z0-9]", "", name[0] if name else "") or "gpu"
    return f"{slug}-{meta['date'][:10]}"


# ----------------------------------------------------------------------------- one path


def measure(path: TimedPath, timer: Any, after_timing: Callable[[Any], None] | None = None) -> dict:
    """Check, time and check again one path; the row's fields besides model and M.

    ``after_timing(prepared)``, if given, runs once the timing is done and before the second
    check (the pytest-benchmark suite runs ``benchmark.pedantic`` there on the same replay).
    """
    row: dict[str, Any] = {"path": path.name, "kind": path.kind, "provider": path.provider, "stage": path.stage}
    if path.unavailable or path.error:
        return {**row, "status": "unavailable" if path.unavailable else "error", "note": path.unavailable or path.error}
    prepared = None
    try:
        prepared = timer.prepare(path.fn)
        if prepared.static_output is not None:
            poison(prepared.static_output)  # the checked replay must write every output itself
        out = prepared.run()
        timer.synchronize()
        first = path.check(out)
        row.update(first.to_dict(), mode=prepared.mode)
        if prepared.note:
            row["note"] = prepared.note
        if not first.ok:
            return {**row, "status": "failed"}
        timing = timer.time(prepared)
        if after_timing is not None:
            after_timing(prepared)
        last = path.check(prepared.last_output)  # the output the last timed replay left
        if not last.ok:
            return {**row, **last.to_dict(), "status": "failed", "check": "after timing: " + last.detail}
    except Exception as exc:  # noqa: BLE001 - one path's failure is a row, the run goes on
        row.update(status="unavailable" if is_unavailable(exc) else "error", note=describe_exception(exc))
        try:
            timer.synchronize()
        except Exception:  # noqa: BLE001 - a sticky CUDA error: the context is gone, whatever raised first
            row["context_lost"] = True
        return row
    finally:
        del prepared
    row.update(status="ok", us=timing.median_us, p20_us=timing.p20_us, p80_us=timing.p80_us, reps=timing.reps)
    if path.floor is not None:
        row.update(row_metrics(timing.median_us, path.floor, path.bits))
    return row


def release(device: torch.device) -> None:
    """Free what the finished case or layer held (its closures form cycles) before the next allocates."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _add_ratios(rows: list[dict]) -> None:
    peer_us = {r["path"]: r["us"] for r in rows if r["kind"] == "peer" and r["status"] == "ok"}
    for r in rows:
        if r["kind"] in ("backend", "peer") and r["status"] == "ok":
            for name, us in peer_us.items():
                if name != r["path"]:
                    r[f"vs_{name}"] = us / r["us"]


def _stage_sums(rows: list[dict]) -> dict[str, float]:
    sums: dict[str, float] = {}
    for provider in {r["provider"] for r in rows if r["kind"] == "stage"}:
        stage_rows = [r for r in rows if r["kind"] == "stage" and r["provider"] == provider]
        if len(stage_rows) == len(STAGES) and all(r["status"] == "ok" for r in stage_rows):
            sums[provider] = sum(r["us"] for r in stage_rows)
    return sums


# ----------------------------------------------------------------------------- the run


def _case_paths(case: Case, config: BenchConfig, peers, providers: dict[str, StageSet | str], lost: list[dict] = ()):
    """A case's paths in the order they run: backends, their stages, then the peers (:data:`PEER_RUN_ORDER`). Once
    ``lost`` holds a row (one that ended the CUDA context), the rest are yielded by name only: nothing more is
    built on the GPU."""
    for b in config.backends:
        yield TimedPath(b, "backend", None, None) if lost else case.backend_path(
            b, why_unavailable(b, config.device, torch.bfloat16))
    if config.stages:
        for b, stages in providers.items():
            if lost or isinstance(stages, str):
                for stage in STAGES:
                    yield TimedPath(f"{b}/{stage}", "stage", None, None, provider=b, stage=stage,
                                    unavailable=None if lost else stages)
            else:
                yield from StageChain(case, b, stages).paths()
    for name in PEER_RUN_ORDER:
        if lost:
            yield TimedPath(name, "peer", None, None)
        else:
            why = peers.unavailable.get(name) or known_fault(name, case.shape, case.M)
            yield case.peer_path(name, peers.forwards.get(name), why)


def _report_order(row: dict) -> tuple[int, int]:
    """Sort key of a case's rows in the report: backends, peers (as :data:`PEERS`), stages; else as they ran."""
    return _KIND_ORDER.get(row["kind"], len(_KIND_ORDER)), PEERS.index(row["path"]) if row["path"] in PEERS else 0


def _not_run(path: TimedPath, lost: dict) -> dict:
    """The row of a path that did not run because ``lost``'s path ended the CUDA context."""
    return {"path": path.name, "kind": path.kind, "provider": path.provider, "stage": path.stage, "status": "not_run",
            "note": f"{lost['path']} ended the CUDA context before it ran ({lost['note']})"}


def _overheads(case: Case, config: BenchConfig, peers, rows: list[dict]) -> list[dict]:
    """Eager host overhead (:func:`measure_overhead`) of the method's floor (one small torch kernel), every
    backend that passed its check, with ``validate=False`` and ``True``, and every peer that did, at this case's M."""
    ok = {r["path"] for r in rows if r["status"] == "ok"}
    out = torch.empty_like(case.x)
    calls: list[tuple[str, bool | None, Callable[[], Any]]] = [("floor", None, out.zero_)]
    for b in config.backends:
        if b in ok:
            for validate in (False, True):
                calls.append((b, validate, functools.partial(
                    fused_moe, case.x, case.experts, case.topk_weights, case.topk_ids, backend=b, out=out,
                    validate=validate)))
    for name, forward in peers.forwards.items():
        if name in ok:
            calls.append((name, None, functools.partial(forward, case.x, case.topk_weights, case.topk_ids, out=out)))
    measured = measure_overheads([fn for _, _, fn in calls], config.device, reps=300, rounds=30)
    return [{"model": case.shape.name, "M": case.M, "path": path, "validate": validate, **m}
            for (path, validate, _), m in zip(calls, measured, strict=True)]


def run_bench(
    config: BenchConfig,
    timer: Any,
    ceilings: Ceilings,
    *,
    meta: dict | None = None,
    ceilings_method: dict | None = None,
    on_row: Callable[[dict], None] | None = None,
    on_case: Callable[[dict], None] | None = None,
) -> dict:
    """Run every (layer, M, path) of ``config`` with ``timer``; return the report.

    ``on_row(row)`` is called after each row, ``on_case(report)`` after each (layer, M), so a
    caller can show progress and save partial results (a CUDA error ends the process).
    """
    report: dict[str, Any] = {
        "schema": 1,
        "meta": meta or environment(config.device),
        "method": {
            "timing": timer.description,
            "ceilings": ceilings.to_dict(),
            "ceilings_method": ceilings_method or {},
            "roofline": "max(weight bytes of the experts touched at 4.5 bits/weight / read bandwidth, "
                        "FLOPs / bf16 matmul rate)",
            "tolerances": {"fused_rel": FUSED_REL_TOL, "peer_rel": PEER_REL_TOL, "gemm_reduce_rel": BF16_ULP_REL_TOL,
                           "intermediate_rel": ACT_QUANT_REL_TOL, "routing_quantize": "bit-exact"},
            "check_tokens": config.check_tokens,
            "routing": "softmax of N(0,1) logits, top-k, renormalized (near-uniform); x ~ N(0,1) bf16",
            "seed": config.seed,
        },
        "models": {},
        "cases": [],
        "rows": [],
        "notes": [],
        "overhead": [],
    }
    providers: dict[str, StageSet | str] = {}
    if config.stages:
        for b in config.backends:
            devices = BACKENDS[b].devices
            if config.device.type not in devices:
                providers[b] = f"runs on {'/'.join(devices)} devices, not {config.device.type}"
                continue
            try:
                providers[b] = stage_set(b, config.device)
            except Exception as exc:  # noqa: BLE001 - the stage rows say why
                providers[b] = describe_exception(exc)
    for shape in config.models:
        t0 = time.perf_counter()
        experts = random_experts(shape, config.device, config.seed)
        t1 = time.perf_counter()
        peers = build_peers(experts, config.peers)
        t2 = time.perf_counter()
        report["models"][shape.name] = {
            "E": shape.E, "topk": shape.topk, "H": shape.H, "I": shape.I,
            "weights_s": round(t1 - t0, 2), "peers_s": round(t2 - t1, 2),
            "peers_unavailable": dict(peers.unavailable), "marlin_library": peers.library,
        }
        for M in config.tokens:
            case = Case(shape, experts, M, ceilings, config.seed, config.check_tokens)
            rows = []
            lost: list[dict] = []  # the row that ended the CUDA context, once one has (_case_paths reads it too)
            for path in _case_paths(case, config, peers, providers, lost):
                row = {"model": shape.name, "M": M, **(_not_run(path, lost[0]) if lost else measure(path, timer))}
                rows.append(row)
                if row.get("context_lost"):
                    lost.append(row)
                if on_row:
                    on_row(row)
            rows.sort(key=_report_order)
            _add_ratios(rows)
            if config.overhead and M in OVERHEAD_TOKENS and not lost:
                report["overhead"].extend(_overheads(case, config, peers, rows))
            summary = case.summary()
            summary["stage_sum_us"] = _stage_sums(rows)
            report["cases"].append(summary)
            report["rows"].extend(rows)
            del case
            if lost:  # nothing more can run in this process; what ran is reported
                if on_case:
                    on_case(report)
                raise ContextLost(f"{shape.name} M={M}: {lost[0]['path']} ended the CUDA context ({lost[0]['note']}); "
                                  "the rows after it in this case, and every later case, did not run")
            release(config.device)
            if on_case:
                on_case(report)
        ran = {r["path"] for r in report["rows"]
               if r["model"] == shape.name and r["kind"] == "backend" and r["status"] == "ok"}
        sets = {b: stage_set(b, config.device) for b in config.backends if b in ran}
        report["models"][shape.name]["resident"] = resident_memory(experts, sets, peers.forwards)
        del experts, peers
        release(config.device)
    return report
