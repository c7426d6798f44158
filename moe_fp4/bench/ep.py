"""``moe-fp4 bench --ep N``: expert parallelism timed phase by phase, against one GPU.

N ranks are spawned with :mod:`torch.multiprocessing`: NCCL with one GPU each (``--device
cuda``: GPUs 0..N-1, NVLink multicast off with ``NCCL_NVLS_ENABLE=0``), or gloo processes on
the CPU (``--device cpu``: the plumbing only; its numbers are not measurements). Every rank
builds the same layer (:func:`~moe_fp4.bench.workload.random_experts`: the ``--model`` layer
or a ``--shape``), keeps its contiguous block of experts
(:func:`~moe_fp4.distributed.shard_experts`) and, per M (tokens per rank) and mode, times:

* ``total``: the whole :func:`~moe_fp4.distributed.ep_fused_moe` (``validate=False``; every
  rank's map given as the ``[N, E]`` table, so there is no ``all_gather`` of the maps per call);
* its phases, each alone on what the phase before it produced (the phase functions of
  :mod:`moe_fp4.distributed`, which ``ep_fused_moe`` is composed of):

  - ``"all_to_all"`` (each rank its own M tokens, N * M in all): ``dispatch`` (the routing
    sort, the row-count exchange and its host read-back, the all_to_all of the rows),
    ``experts`` (this rank's ``fused_moe`` on the rows it received, as top-1 rows),
    ``combine`` (the all_to_all of the outputs back, the slot-order float32 reduce);
  - ``"all_reduce"`` (the same M tokens on every rank): no dispatch, ``experts``
    (``fused_moe`` with the ``expert_map``), ``combine`` (the float32 ``all_reduce`` of the
    partials, rounded once);

* ``one GPU``: on rank 0 alone, ``fused_moe`` with the whole (unsharded) layer on the same
  global tokens (``"all_to_all"``: all N * M; ``"all_reduce"``: the M replicated ones).

Timing (:class:`_Clock`): eager calls, since ``ep_fused_moe`` reads the row counts back to the
host and so cannot be captured in a CUDA graph; the one-GPU baseline is timed the same way.
Each repetition: the L2 flushed (as in the main benchmark), the device synchronized, a barrier
(a one-element ``all_reduce``, then a synchronize), then the call alone between CUDA events
(on CPU: ``time.perf_counter``). Per rank the median over the repetitions, then the maximum
over the ranks. The repetition count follows ``--budget-ms`` from the slowest rank's warm-up,
so it is the same on every rank.

Each row's EP output (the last whole call's) is checked against the one-GPU output: bitwise
equality is recorded (expected for ``"all_to_all"`` with the reference backend), and the
norm-relative error must be within the main benchmark's whole-forward tolerance; a row that
fails shows no time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import distributed as ep_impl
from ..backends.registry import BACKENDS, why_unavailable
from ..distributed import ep_fused_moe, expert_maps, shard_experts
from ..moe import fused_moe
from .checks import FUSED_REL_TOL, within
from .engine import environment, file_stem, release
from .report import _fmt, _markdown_table, _text_table, write_json
from .shapes import ModelShape
from .timing import GpuTimer, Timing, _rep_count
from .workload import describe_exception, layer_inputs, random_experts

__all__ = ["MODES", "PHASES", "EpConfig", "ep_file_stem", "layer_inputs", "render_markdown", "run_cli", "run_ep",
           "terminal_summary"]

MODES = ("all_to_all", "all_reduce")
PHASES = ("dispatch", "experts", "combine")
CPU_REPS = 3  # --device cpu: warm-up 1, then 3 repetitions (plumbing only)
_HEADERS = ["M per rank", "mode", "global M", "dispatch µs", "experts µs", "combine µs", "total µs", "one-GPU µs",
            "ratio", "check"]
_CPU_WARNING = ("CPU run (gloo processes, host clock): these numbers check the plumbing; they are not measurements "
                "of expert parallelism")


@dataclass(frozen=True)
class EpConfig:
    """What one ``--ep`` run covers (checked here, in the parent process, before any rank starts)."""

    models: tuple[ModelShape, ...]
    tokens: tuple[int, ...]  # per rank
    backends: tuple[str, ...]
    world_size: int
    device: str = "cuda"  # "cuda": NCCL, GPUs 0..N-1; "cpu": gloo processes
    modes: tuple[str, ...] = MODES
    seed: int = 0
    budget_s: float = 0.25
    min_reps: int = 10
    max_reps: int = 200
    warmup: int = 3
    commit: str | None = None
    timeout_s: float = 1800.0  # the process group's timeout (a rank that stops leaves the others waiting)

    def __post_init__(self) -> None:
        W = self.world_size
        if not isinstance(W, int) or isinstance(W, bool) or W < 1:
            raise ValueError(f"--ep: expected a positive number of ranks, got {W!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError("--device: with --ep, expected cuda (GPUs 0..N-1, one per rank; choose them with "
                             f"CUDA_VISIBLE_DEVICES) or cpu (gloo processes, plumbing only), got {self.device!r}")
        if self.device == "cuda":
            found = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if found < W:
                raise ValueError(f"--ep {W}: expected {W} CUDA GPUs (one per rank), found {found} (--device cpu runs "
                                 "the ranks as gloo processes on the CPU, which checks the plumbing only)")
        if not self.models:
            raise ValueError("models: expected at least one layer, got none")
        few = [f"{m.name} has E={m.E}" for m in self.models if m.E < W]
        if few:
            raise ValueError(f"--ep {W}: expected at most E ranks (every rank holds at least one expert), but "
                             + ", ".join(few))
        if not self.tokens or any(not isinstance(m, int) or m < 1 for m in self.tokens):
            raise ValueError(f"tokens: expected positive token counts per rank, got {list(self.tokens)}")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"--ep-mode: expected modes from {list(MODES)}, got {list(self.modes)}")
        unknown = [b for b in self.backends if b not in BACKENDS]
        if not self.backends or unknown:
            raise ValueError(f"--backends: expected names from {list(BACKENDS)}, got {unknown or 'none'}")
        if not (self.budget_s > 0 and 1 <= self.min_reps <= self.max_reps and self.warmup >= 1):
            raise ValueError("budget_s, min_reps, max_reps, warmup: expected budget_s > 0, 1 <= min_reps <= max_reps "
                             f"and warmup >= 1, got {self.budget_s}, {self.min_reps}, {self.max_reps}, {self.warmup}")


def ep_file_stem(meta: dict) -> str:
    """``<gpu>-ep<N>-<date>``, e.g. ``h200-ep8-2026-12-02`` (``cpu-ep2-...`` for a gloo run)."""
    slug, date = file_stem(meta).split("-", 1)
    return f"{slug}-ep{meta['world_size']}-{date}"


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy()).hexdigest()  # no copy of the bytes


# --------------------------------------------------------------------------- one rank


class _Clock:
    """Times one call per repetition on every rank: flush, synchronize, barrier, then the call alone."""

    def __init__(self, config: EpConfig, device: torch.device) -> None:
        self.config, self.device, self.cuda = config, device, device.type == "cuda"
        self._gpu = GpuTimer(device) if self.cuda else None  # for its L2 flush
        self._token = torch.zeros(1, device=device)

    @property
    def description(self) -> str:
        c = self.config
        if not self.cuda:
            return (f"{_CPU_WARNING}. Per repetition a gloo barrier, then the eager call timed with "
                    f"time.perf_counter; {c.warmup} warm-up call(s), {c.min_reps}..{c.max_reps} repetitions; the "
                    "median per rank, the maximum over the ranks")
        return (f"eager calls (ep_fused_moe reads the row counts back to the host: no CUDA graph), each repetition "
                f"after a {self._gpu.flush_bytes >> 20} MiB L2 flush, a device synchronize and a barrier (a "
                "one-element all_reduce, then a synchronize), bracketed alone by CUDA events; "
                f"{c.warmup} warm-up calls; repetitions fill a {c.budget_s * 1e3:.0f} ms budget from the slowest "
                f"rank's warm-up ({c.min_reps}..{c.max_reps}, the same on every rank); the median per rank, the "
                "maximum over the ranks. The one-GPU baseline: the same, on rank 0 alone, without the barrier")

    def _barrier(self) -> None:
        dist.all_reduce(self._token)
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _sample(self, fn, collective: bool) -> float:
        if not self.cuda:
            if collective:
                self._barrier()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        self._gpu.flush()
        torch.cuda.synchronize(self.device)
        if collective:
            self._barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def time(self, fn, collective: bool = True) -> Timing:
        """``fn`` timed on this rank; ``collective``: every rank calls it (with a barrier per repetition)."""
        c = self.config
        warm = max(self._sample(fn, collective) for _ in range(c.warmup))
        estimate = torch.tensor([warm], dtype=torch.float64, device=self.device)
        if collective:
            dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
        reps = _rep_count(float(estimate) * 1e-6, c.budget_s, c.min_reps, c.max_reps)
        return Timing.from_samples([self._sample(fn, collective) for _ in range(reps)], "eager")


def _gather_floats(values: list[float], device: torch.device, world: int) -> list[list[float]]:
    """Every rank's ``values`` (the same length on every rank), by rank."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    return [p.tolist() for p in parts]


def _gather_rows(out: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Every rank's output ``[M, H]`` (the same shape on every rank), as bytes through the collective."""
    mine = out.contiguous().view(torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    return [p.view(out.dtype) for p in parts]


def _nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _topology() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30,
                              check=True).stdout.rstrip() or None
    except (OSError, subprocess.SubprocessError):
        return None


class _Rank:
    """One rank's run: every (layer, backend, M, mode) row; rank 0 keeps the report and rewrites its JSON."""

    def __init__(self, config: EpConfig, rank: int, device: torch.device, report_path: str) -> None:
        self.config, self.rank, self.device, self.path = config, rank, device, Path(report_path)
        self.W = config.world_size
        self.clock = _Clock(config, device)
        self.report: dict[str, Any] = {}

    # ------------------------------------------------------------------ report

    def _header(self) -> None:
        cuda = self.device.type == "cuda"
        name = torch.cuda.get_device_name(self.device) if cuda else f"cpu ({platform.machine()})"
        names: list[Any] = [None] * self.W
        dist.all_gather_object(names, name)
        if self.rank:
            return
        meta = environment(self.device, self.config.commit)
        meta.update(
            world_size=self.W, process_group=dist.get_backend(), devices=names,
            nccl=_nccl_version() if cuda else None,
            NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE"), platform=platform.platform(),
            cpu_count=os.cpu_count(), topology=_topology() if cuda else None)
        self.report = {
            "schema": "ep-1",
            "meta": meta,
            "method": {
                "timing": self.clock.description,
                "modes": "all_to_all: data-parallel tokens, M per rank (N * M in all); all_reduce: the same M tokens "
                         "replicated on every rank",
                "phases": "all_to_all: dispatch = routing sort, row-count all_to_all and its host read-back, "
                          "all_to_all of the rows; experts = this rank's fused_moe on the rows it received; combine = "
                          "all_to_all of the outputs back and the slot-order float32 reduce. all_reduce: no dispatch; "
                          "experts = fused_moe with the expert_map; combine = float32 all_reduce of the partials. "
                          "Each phase is timed alone, on what the phase before it produced",
                "total": "the whole ep_fused_moe(validate=False) with the [N, E] expert-map table",
                "one_gpu": "fused_moe(validate=False) on rank 0 with the whole layer, on the same global tokens",
                "ratio": "one-GPU us / EP total us: above 1, the EP forward is faster than one GPU",
                "placement": "contiguous blocks of experts (shard_experts' default)",
                "routing": "softmax of N(0,1) logits, top-k, renormalized (near-uniform); x ~ N(0,1) bf16",
                "check": f"EP output vs one-GPU output: bitwise equality recorded, rel err <= {FUSED_REL_TOL}",
                "seed": self.config.seed,
            },
            "models": {},
            "rows": [],
            "notes": [],
        }
        if not cuda:
            self.report["notes"].append(_CPU_WARNING)
        self._save()

    def _save(self) -> None:
        if self.rank == 0:
            tmp = self.path.with_suffix(".tmp")
            write_json(self.report, tmp)
            tmp.replace(self.path)

    # ------------------------------------------------------------------ the run

    def run(self) -> None:
        self._header()
        for shape in self.config.models:
            t0 = time.perf_counter()
            full = random_experts(shape, self.device, self.config.seed)
            local, _ = shard_experts(full, self.rank, self.W)
            table = expert_maps(shape.E, self.W).to(self.device)
            if self.rank:
                full = None  # only rank 0 runs the one-GPU baseline
                release(self.device)
            if self.rank == 0:
                self.report["models"][shape.name] = {
                    "E": shape.E, "topk": shape.topk, "H": shape.H, "I": shape.I,
                    "experts_per_rank": (table >= 0).sum(1).tolist(), "weights_s": round(time.perf_counter() - t0, 2),
                    "unavailable": {}}
            for backend in self.config.backends:
                why = self._why_not(backend, local)
                if why:
                    if self.rank == 0:
                        self.report["models"][shape.name]["unavailable"][backend] = why
                        self._save()
                        print(f"{shape.name} {backend}: n/a ({why})", file=sys.stderr, flush=True)
                    continue
                for M in self.config.tokens:
                    inputs = layer_inputs(shape, self.W * M, self.device, self.config.seed)
                    for mode in self.config.modes:
                        row = self._row(shape, backend, mode, M, inputs, local, full, table)
                        if self.rank == 0:
                            self.report["rows"].append(row)
                            self._save()
                            print(_progress_line(row), file=sys.stderr, flush=True)
                    del inputs
                    release(self.device)
            del full, local
            release(self.device)

    def _why_not(self, backend: str, local) -> str | None:
        """Why ``backend`` cannot run here (on any rank), from the registry and one local top-1 call; else None."""
        why = why_unavailable(backend, self.device, torch.bfloat16)
        if why is None:
            x = torch.zeros((1, local.hidden_size), dtype=torch.bfloat16, device=self.device)
            try:
                fused_moe(x, local, torch.ones((1, 1), device=self.device),
                          torch.zeros((1, 1), dtype=torch.int32, device=self.device), backend=backend, validate=False)
            except Exception as exc:  # noqa: BLE001 - the backend is reported as not run, on every rank
                why = describe_exception(exc)
        flags = _gather_floats([float(why is not None)], self.device, self.W)
        bad = [r for r, (f,) in enumerate(flags) if f]
        if bad and why is None:
            why = f"cannot run on rank(s) {bad}"
        return why

    def _row(self, shape: ModelShape, backend: str, mode: str, M: int, inputs, local, full, table) -> dict:
        """One (layer, backend, M, mode) row: every rank times, rank 0 also runs the baseline and the check."""
        x, w, ids = inputs
        if mode == "all_to_all":
            part = slice(self.rank * M, (self.rank + 1) * M)
            mine, global_in = (x[part], w[part], ids[part]), inputs
        else:
            mine = global_in = (x[:M], w[:M], ids[:M])
        timings, out, composed = self._time_phases(mode, backend, *mine, local, table)
        names = [p for p in (*PHASES, "total") if p in timings]
        flat = [v for p in names for v in (timings[p].median_us, timings[p].p20_us, timings[p].p80_us, timings[p].reps)]
        stats = _gather_floats([*flat, float(composed)], self.device, self.W)
        outs = _gather_rows(out, self.W)
        if self.rank:
            return {}
        phases = {p: {"median_us": [s[4 * i] for s in stats], "p20_us": [s[4 * i + 1] for s in stats],
                      "p80_us": [s[4 * i + 2] for s in stats], "reps": int(stats[0][4 * i + 3])}
                  for i, p in enumerate(names)}
        base = functools.partial(fused_moe, global_in[0], full, *global_in[1:], backend=backend, validate=False)
        one_gpu = self.clock.time(base, collective=False)
        check = _check(torch.cat(outs) if mode == "all_to_all" else outs[0], base())
        check["phases_match_whole"] = all(s[-1] == 1.0 for s in stats)
        if mode == "all_reduce":
            check["ranks_agree"] = all(torch.equal(o.view(torch.uint8), outs[0].view(torch.uint8)) for o in outs)
        row: dict[str, Any] = {"model": shape.name, "backend": backend, "mode": mode, "M": M,
                               "global_M": int(global_in[0].shape[0]), "status": "ok" if check["ok"] else "failed"}
        if check["ok"]:  # no time for a wrong output
            row.update({f"{p}_us": max(phases[p]["median_us"]) if p in phases else None for p in (*PHASES, "total")})
            row.update(one_gpu_us=one_gpu.median_us, ratio=one_gpu.median_us / row["total_us"])
        return {**row, "phases": phases, "one_gpu": one_gpu.to_dict(), "check": check}

    def _time_phases(self, mode: str, backend: str, x, w, ids, local, table) -> tuple[dict[str, Timing], Any, bool]:
        """This rank's timings of the whole ep_fused_moe and of its phases, the whole call's output, and
        whether the phases, run one after the other, gave that output bit for bit."""
        rank, W, E = self.rank, self.W, table.shape[1]
        ids_l, table_l = ids.long(), table.long()  # what ep_fused_moe hands its phases
        whole = functools.partial(ep_fused_moe, x, local, w, ids, expert_map=table, mode=mode, backend=backend,
                                  validate=False)
        timings = {"total": self.clock.time(whole)}
        out = whole()
        if mode == "all_to_all":
            dispatch = functools.partial(ep_impl._dispatch, x, w, ids_l, table_l, E, local.num_experts, rank, W,
                                         None, False, False)
            timings["dispatch"] = self.clock.time(dispatch)
            d = dispatch()
            experts = functools.partial(ep_impl._local_experts, d, local, backend, False, "w4a4")
            timings["experts"] = self.clock.time(experts)
            y = experts()
            combine = functools.partial(ep_impl._combine_back, d, y, w, None, False)
        else:
            local_map = table_l[rank]
            experts = functools.partial(fused_moe, x, local, w, ids_l, backend=backend, expert_map=local_map,
                                        validate=False)
            timings["experts"] = self.clock.time(experts)
            y = experts()
            combine = functools.partial(ep_impl._reduce_partials, y, x, w, ids_l, local_map, E, local.num_experts,
                                        rank, W, None, False)
        timings["combine"] = self.clock.time(combine)
        return timings, out, torch.equal(combine().view(torch.uint8), out.view(torch.uint8))


def _check(ep_out: torch.Tensor, ref: torch.Tensor) -> dict:
    """The EP output against the one-GPU output: bitwise, else within the whole-forward tolerance."""
    res = within("EP vs one GPU", ep_out, ref, FUSED_REL_TOL)
    bitwise = ep_out.shape == ref.shape and torch.equal(ep_out.view(torch.uint8), ref.view(torch.uint8))
    return {"ok": res.ok or bitwise, "detail": "bitwise equal" if bitwise else res.detail, "rel_err": res.rel_err,
            "tol": FUSED_REL_TOL, "bitwise_equal": bitwise, "ep_sha256": _digest(ep_out),
            "one_gpu_sha256": _digest(ref)}


def _worker(rank: int, config: EpConfig, port: int, report_path: str) -> None:
    if config.device != "cuda":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.world_size))
    dev = ep_impl.init_local_group(rank, config.world_size, port, config.device, config.timeout_s)
    try:
        _Rank(config, rank, dev, report_path).run()
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the parent process


def _why_stopped(exc: BaseException) -> str:
    if isinstance(exc, mp.ProcessRaisedException):
        lines = [ln for ln in exc.msg.strip().splitlines() if ln.strip()]
        return f"rank {exc.error_index} raised {lines[-1].strip() if lines else 'an exception'}"
    return str(exc)


def run_ep(config: EpConfig, out_dir: str | Path, name: str | None = None) -> tuple[dict, list[Path]]:
    """Spawn the ranks, wait for them, write ``<stem>.{json,md}`` into ``out_dir``; return the report and the paths.

    If a rank fails, what the finished rows give is still written (with a note), then
    ``RuntimeError`` says which rank raised what.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    failure: BaseException | None = None
    with tempfile.TemporaryDirectory(prefix="moe-fp4-ep-") as tmp:
        path = Path(tmp) / "report.json"
        ctx = mp.start_processes(_worker, args=(config, ep_impl.free_port(), str(path)), nprocs=config.world_size,
                                 join=False, start_method="spawn")
        try:
            while not ctx.join(timeout=5):
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            failure = exc
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        report = json.loads(path.read_text()) if path.is_file() else None
    if report is None:
        raise RuntimeError(f"--ep {config.world_size}: the ranks stopped before any result"
                           + (f": {_why_stopped(failure)}" if failure else ""))
    if failure:
        report["notes"].append(f"run stopped early: {_why_stopped(failure)}")
    stem = name or ep_file_stem(report["meta"])
    written = [write_json(report, out / f"{stem}.json"), out / f"{stem}.md"]
    written[1].write_text(render_markdown(report))
    if failure:
        raise RuntimeError(f"--ep {config.world_size}: {_why_stopped(failure)}; partial results in {out / stem}.json")
    return report, written


# --------------------------------------------------------------------------- report writers


def _us(v: float | None) -> str:
    return "–" if v is None else _fmt(float(v))


def _table(report: dict, model: str, backend: str) -> tuple[list[str], list[list[str]]]:
    body = []
    for r in (r for r in report["rows"] if r["model"] == model and r["backend"] == backend):
        c = r["check"]
        if r["status"] == "ok":
            times = [*(_us(r[f"{p}_us"]) for p in PHASES), _us(r["total_us"]), _us(r["one_gpu_us"]),
                     _fmt(r["ratio"], 2)]
            verdict = "bitwise" if c["bitwise_equal"] else f"rel {c['rel_err']:.1e}"
        else:
            times, verdict = ["FAILED"] * 6, f"FAILED: {c['detail']}"
        body.append([str(r["M"]), r["mode"], str(r["global_M"]), *times, verdict])
    return _HEADERS, body


def _groups(report: dict) -> list[tuple[str, str]]:
    return list(dict.fromkeys((r["model"], r["backend"]) for r in report["rows"]))


def _heading(report: dict, model: str, backend: str) -> str:
    m = report["models"][model]
    return (f"{model} (E={m['E']}, top-{m['topk']}, H={m['H']}, I={m['I']}; experts per rank "
            f"{','.join(map(str, m['experts_per_rank']))}), backend {backend}")


def render_markdown(report: dict) -> str:
    meta, method = report["meta"], report["method"]
    W = meta["world_size"]
    lines = [f"# moe-fp4 bench --ep {W}: expert parallelism over {W} ranks ({meta['process_group']})", ""]
    if meta["process_group"] == "gloo":
        lines += [f"**{_CPU_WARNING}.**", ""]
    devices = ", ".join(f"rank {r}: {d}" for r, d in enumerate(meta["devices"]))
    lines += [
        f"- date {meta['date']}, commit {meta['commit']}, moe_fp4 {meta['moe_fp4']}",
        f"- devices: {devices}",
        f"- driver {meta.get('driver')}, torch {meta['torch']}, CUDA {meta['cuda']}, triton {meta['triton']}, "
        f"NCCL {meta['nccl']}, Python {meta['python']}",
        f"- world size {W}, process group {meta['process_group']}, NCCL_NVLS_ENABLE={meta['NCCL_NVLS_ENABLE']}",
        f"- {meta['platform']}, {meta['cpu_count']} CPUs",
        "",
        f"- timing: {method['timing']}",
        f"- modes: {method['modes']}",
        f"- phases: {method['phases']}",
        f"- total: {method['total']}; one GPU: {method['one_gpu']}",
        f"- ratio: {method['ratio']}; check: {method['check']}",
        "- –: no such phase (all_reduce has no dispatch)",
    ]
    for model, backend in _groups(report):
        lines += ["", f"## {_heading(report, model, backend)}", "", *_markdown_table(*_table(report, model, backend))]
    missing = [f"- {model} {b}: {why}" for model, info in report["models"].items()
               for b, why in info.get("unavailable", {}).items()]
    if missing:
        lines += ["", "## Not run", "", *missing]
    notes = [n for n in report["notes"] if n != _CPU_WARNING]
    if notes:
        lines += ["", "## Notes", "", *(f"- {n}" for n in notes)]
    if meta.get("topology"):
        lines += ["", "## GPU topology (nvidia-smi topo -m)", "", "```", meta["topology"], "```"]
    return "\n".join(lines) + "\n"


def terminal_summary(report: dict) -> str:
    out = []
    if report["meta"]["process_group"] == "gloo":
        out.append(_CPU_WARNING)
    for model, backend in _groups(report):
        out += ["", _heading(report, model, backend), *_text_table(*_table(report, model, backend))]
    for model, info in report["models"].items():
        out += [f"{model} {b}: n/a ({why})" for b, why in info.get("unavailable", {}).items()]
    return "\n".join(out)


def _progress_line(row: dict) -> str:
    head = f"{row['model']} {row['backend']} M={row['M']} {row['mode']}:"
    if row["status"] != "ok":
        return f"{head} FAILED ({row['check']['detail']})"
    phases = ", ".join(f"{p} {_us(row[f'{p}_us'])}" for p in PHASES)
    return f"{head} {phases}, total {_us(row['total_us'])} us; one GPU {_us(row['one_gpu_us'])} us"


# --------------------------------------------------------------------------- the command


def run_cli(args) -> int:
    """``moe-fp4 bench --ep N ...`` (the parsed arguments of :mod:`.cli`): 1 if a row failed its check."""
    from .cli import resolve_models
    from .engine import default_backends

    cpu = args.device == "cpu"
    config = EpConfig(
        models=resolve_models(args.model, args.shape), tokens=tuple(args.tokens),
        backends=tuple(args.backends or default_backends()), world_size=args.ep, device=args.device,
        modes=MODES if args.ep_mode in (None, "both") else (args.ep_mode,), seed=args.seed,
        budget_s=args.budget_ms / 1e3, min_reps=CPU_REPS if cpu else 10, max_reps=CPU_REPS if cpu else 200,
        warmup=1 if cpu else 3, commit=args.commit)
    report, written = run_ep(config, args.out, args.name)
    print(terminal_summary(report))
    print("wrote " + ", ".join(map(str, written)))
    failed = [r for r in report["rows"] if r["status"] != "ok"]
    if failed:
        print(f"{len(failed)} rows failed their check (see the report)", file=sys.stderr)
    return 1 if failed else 0
