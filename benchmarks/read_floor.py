"""How fast can a GPU read just the weight bytes a decode forward needs? A measured floor per M.

The benchmark's roofline divides the touched experts' NVFP4 bytes by the read bandwidth of one
large stream (``Ceilings.read_tbps``). At decode those bytes are a few MB in a few contiguous
ranges, read cold, and a forward reads them in two dependent kernels (w13, then w2), so that
floor may not be reachable by any kernel. This script measures, on the benchmark's own routing
(same seed, same touched experts) and under the same timer (CUDA-graph replay, cold L2), a plain
read of exactly those bytes:

* ``w13``: one launch reading the touched experts' w13 (codes and scales);
* ``w2``: the same for w2;
* ``w13;w2``: the two launches back to back, the dependent structure of a forward's two GEMMs
  with nothing else in it;
* ``both``: one launch reading both, the lower bound when the second GEMM's weights are requested
  while the first runs.

Each read is timed over a few chunk sizes (bytes per program) and the fastest is kept; every
configuration is in the JSON. ``--backends`` also measures ``fused_moe`` on the same cases in the
same process, as the benchmark does (its output checked against the reference, then timed), so a
forward's time can be put against the read floor of its bytes.

Run on a GPU (``PYTHONPATH=. python3 benchmarks/read_floor.py --out DIR``); it writes
``read_floor.json`` and ``read_floor.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from moe_fp4.bench.engine import environment, measure
from moe_fp4.bench.roofline import NVFP4_BITS, moe_floor
from moe_fp4.bench.shapes import MODELS, ModelShape
from moe_fp4.bench.timing import GpuTimer, measure_ceilings
from moe_fp4.bench.workload import Case, layer_inputs, random_experts

_CHUNK_KB = (4, 16, 64)  # bytes per program, tried for each read
_BLOCK_WORDS = 2048  # int32 words per load step (8 KiB)


@triton.jit
def _gather_read(buf_ptr, ids_ptr, out_ptr, stride, lo, n_words, chunks, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr):
    # Program p reads chunk p % chunks of expert ids[p // chunks]: the words [lo, lo + n_words) of
    # that expert's row of ``stride`` words. Every load is issued before the sum is stored.
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p // chunks).to(tl.int64)
    first = (p % chunks) * CHUNK
    base = e * stride + lo + first
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for j in tl.static_range(CHUNK // BLOCK):
        offs = j * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(buf_ptr + base + offs, mask=first + offs < n_words, other=0)
    tl.store(out_ptr + p, tl.sum(acc, axis=0))


class ExpertBytes:
    """Each expert's w13 and w2 as NVFP4 bytes (codes and e4m3 scales) in one row of int32 words."""

    def __init__(self, shape: ModelShape, device: torch.device) -> None:
        def words(rows: int, k: int) -> int:
            nbytes = rows * k // 2 + rows * k // 16  # 4-bit codes + one scale byte per 16
            return -(-nbytes // 64) * 16  # whole 64-byte lines

        self.w13_words = words(2 * shape.I, shape.H)
        self.w2_words = words(shape.H, shape.I)
        self.stride = self.w13_words + self.w2_words
        # Words below 2**16, so that a program's sum of at most 64 KiB of them fits an int32.
        self.buf = torch.randint(0, 1 << 16, (shape.E, self.stride), dtype=torch.int32, device=device)

    def reader(self, ids: torch.Tensor, part: str, chunk_kb: int):
        """A zero-argument launch reading ``part`` ("w13", "w2" or "both") of the experts in ``ids``."""
        lo, n = {"w13": (0, self.w13_words), "w2": (self.w13_words, self.w2_words), "both": (0, self.stride)}[part]
        chunk = chunk_kb * 256
        chunks = -(-n // chunk)
        grid = ids.numel() * chunks
        out = torch.empty(grid, dtype=torch.int32, device=ids.device)
        block = min(chunk, _BLOCK_WORDS)

        def run() -> torch.Tensor:
            _gather_read[(grid,)](self.buf, ids, out, self.stride, lo, n, chunks, CHUNK=chunk, BLOCK=block,
                                  num_warps=4 if block < _BLOCK_WORDS else 8)
            return out

        return run, grid


def touched(shape: ModelShape, m: int, seed: int, device: torch.device) -> torch.Tensor:
    """The expert ids that the benchmark's routing for M tokens touches (int32, ascending)."""
    return torch.unique(layer_inputs(shape, m, device, seed)[2]).to(torch.int32)


def run(models: list[str], tokens: list[int], backends: list[str], out_dir: Path, seed: int,
        device: torch.device | None = None, timer: GpuTimer | None = None, commit: str | None = None) -> dict:
    """Measure every (model, M) and write the JSON and Markdown after each row (``device`` and
    ``timer`` default to the GPU and the benchmark's timer with a 20 ms budget; ``commit`` is recorded, default
    ``git rev-parse HEAD``)."""
    device = device or torch.device("cuda")
    timer = timer or GpuTimer(device, budget_s=0.02)
    ceilings, _ = measure_ceilings(timer, device)
    result = {"env": environment(device, commit), "ceilings": ceilings.to_dict(), "timer": timer.description,
              "rows": []}
    for name in models:
        shape = MODELS[name]
        weights = ExpertBytes(shape, device)
        experts = None
        if backends:
            experts = random_experts(shape, device, seed)
        for m in tokens:
            ids = touched(shape, m, seed, device)
            row = {"model": name, "M": m, "experts_touched": int(ids.numel()),
                   "w13_bytes": ids.numel() * weights.w13_words * 4, "w2_bytes": ids.numel() * weights.w2_words * 4}
            row["stream_floor_us"] = moe_floor(shape, m, int(ids.numel()), ceilings).memory_us
            configs = {}
            for part in ("w13", "w2", "both"):
                for kb in _CHUNK_KB:
                    fn, grid = weights.reader(ids, part, kb)
                    configs[f"{part}/{kb}KiB"] = {"us": timer.time(timer.prepare(fn)).median_us, "programs": grid}
            for kb13 in _CHUNK_KB:
                for kb2 in _CHUNK_KB:
                    f13, _ = weights.reader(ids, "w13", kb13)
                    f2, _ = weights.reader(ids, "w2", kb2)
                    configs[f"w13;w2/{kb13};{kb2}KiB"] = {
                        "us": timer.time(timer.prepare(lambda f13=f13, f2=f2: (f13(), f2()))).median_us}
            row["configs"] = configs
            for part in ("w13", "w2", "both", "w13;w2"):
                best = min((v["us"], k) for k, v in configs.items() if k.split("/")[0] == part)
                row[part] = {"us": best[0], "config": best[1]}
            if backends:  # the benchmark's own forward rows: checked against the reference, then timed
                case = Case(shape, experts, m, ceilings, seed, check_tokens=8)
                for backend in backends:
                    measured = measure(case.backend_path(backend, None), timer)
                    row[backend] = {k: measured.get(k) for k in ("status", "us", "note")}
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "configs"}), flush=True)
            _write(result, backends, out_dir)  # after every row, so a run cut short keeps what it measured
        del weights, experts
        torch.cuda.empty_cache()
    return result


def _write(result: dict, backends: list[str], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "read_floor.json").write_text(json.dumps(result, indent=1))
    (out_dir / "read_floor.md").write_text(markdown(result, backends))


def markdown(result: dict, backends: list[str]) -> str:
    env, c = result["env"], result["ceilings"]
    lines = [f"# Read floor of the decode weights: {env['gpu']}, {env['date']}", "",
             f"commit `{env['commit']}`, driver {env.get('driver')}, torch {env['torch']}, triton {env['triton']}; "
             f"read ceiling {c['read_tbps']:.2f} TB/s; {result['timer']}.", "",
             f"Bytes: NVFP4 codes and scales ({NVFP4_BITS} bits per weight) of the touched experts. "
             f"`stream` = the roofline's memory floor (the bytes at {NVFP4_BITS} bits per weight over the read "
             "ceiling); "
             "`w13`, `w2`, `w13;w2` (two launches), `both` "
             "(one launch): a plain Triton read of exactly those bytes, fastest chunk size, µs (TB/s)."
             + (" Forwards: `fused_moe` µs, and the forward / `w13;w2` ratio." if backends else ""), "",
             "| layer | M | experts | MB | stream | w13 | w2 | w13;w2 | both |"
             + "".join(f" {b} | {b} / w13;w2 |" for b in backends),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * len(backends)]
    for r in result["rows"]:
        mb = (r["w13_bytes"] + r["w2_bytes"]) / 1e6

        def cell(part: str, nbytes: float) -> str:
            return f"{r[part]['us']:.1f} ({nbytes / r[part]['us'] / 1e6:.2f})"

        line = (f"| {r['model']} | {r['M']} | {r['experts_touched']} | {mb:.1f} | {r['stream_floor_us']:.1f} | "
                f"{cell('w13', r['w13_bytes'])} | {cell('w2', r['w2_bytes'])} | "
                f"{cell('w13;w2', r['w13_bytes'] + r['w2_bytes'])} | {cell('both', r['w13_bytes'] + r['w2_bytes'])} |")
        for b in backends:
            f = r[b]
            line += (f" {f['us']:.1f} | {f['us'] / r['w13;w2']['us']:.2f} |" if f["status"] == "ok"
                     else f" {f['status']} | |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,llama4-scout,deepseek-v3")
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--backends", default="", help="comma-separated fused_moe backends to time beside the reads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD, if there is a .git)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    run([m for m in a.models.split(",") if m], [int(t) for t in a.tokens.split(",")],
        [b for b in a.backends.split(",") if b], a.out, a.seed, commit=a.commit)


if __name__ == "__main__":
    main()
