"""Which read order of the decode GEMMs' weights reaches the measured read floor? (No dequantization, no MMA.)

s45a's probe_stride.py read the touched weights in the sm_90a GEMM's order (persistent CTAs, a tile's two 64-row
groups as two code streams and two scale streams, 2 KiB and 256 B per 64-wide K chunk) at 2.77 TB/s for
Llama-4-Scout's second GEMM and 2.92 for its first. Written when that looked like the GEMMs' limit in the forward
(a reading that compared the probe's 16 experts with the forward's 14; the README has the correction). This probe
reads the same tiles in other orders, and a plain read of the same bytes in the same run, to find what a layout or
scheduler change would buy before building it (s45b: at most the 2-6 % the GEMM's order costs where K is long):

- ``split``: the GEMM's layout (4 streams per tile); ``joint``: one stream per tile, each chunk's 4 KiB of codes
  then its 512 B of scales (the 128-row tile's chunk contiguous); ``joint64``: one stream per 64-row group (its
  chunk's 2 KiB of codes, then 256 B of scales), two per tile;
- ``persistent P/SM``: P * SMs programs taking tiles p, p + programs, ... (the GEMM's schedule); ``grid``: one
  program per tile (the hardware's dynamic schedule); ``grid/2``: one program per half of a tile's K;
- ``U``: chunks per loop step (loads in flight per stream).

Run on a GPU: PYTHONPATH=. python3 tests/results/h100-2026-12-07-s45/probe_order.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from probe_stride import _setup, _time  # (this directory: run as a script)


@triton.jit
def _read(buf, scales, out, tiles, chunks, kparts, JOINT: tl.constexpr, U: tl.constexpr, programs,
          PERSISTENT: tl.constexpr):
    # Words are int32. Per tile and chunk: 1024 code words and 128 scale words. split: codes of tile t's group g
    # at (2t + g) * chunks * 512 + c * 512 (buf), scales at (2t + g) * chunks * 64 + c * 64 (scales); JOINT 1:
    # both at t * chunks * 1152 + c * 1152 (codes, then scales) in buf; JOINT 2: group g's at (2t + g) * chunks *
    # 576 + c * 576.
    p = tl.program_id(0)
    acc = tl.zeros([U, 1024], dtype=tl.int32)
    sacc = tl.zeros([U, 128], dtype=tl.int32)
    u = tl.arange(0, U)[:, None]
    cw = tl.arange(0, 1024)[None, :]
    sw = tl.arange(0, 128)[None, :]
    units = tiles * kparts
    per = chunks // kparts
    step = programs if PERSISTENT else units
    for unit in range(p, units, step):
        t = (unit // kparts).to(tl.int64)
        c0 = (unit % kparts) * per
        for c in range(c0, c0 + per, U):
            cc = c + u
            if JOINT == 1:
                base = t * chunks * 1152 + cc * 1152
                acc += tl.load(buf + base + cw)
                sacc += tl.load(buf + base + 1024 + sw)
            elif JOINT == 2:
                acc += tl.load(buf + (2 * t + cw // 512) * chunks * 576 + cc * 576 + cw % 512)
                sacc += tl.load(buf + (2 * t + sw // 64) * chunks * 576 + cc * 576 + 512 + sw % 64)
            else:
                g = cw // 512
                acc += tl.load(buf + (2 * t + g) * chunks * 512 + cc * 512 + cw % 512)
                gs = sw // 64
                sacc += tl.load(scales + (2 * t + gs) * chunks * 64 + cc * 64 + sw % 64)
    tl.store(out + p, tl.sum(tl.sum(acc, 1), 0) + tl.sum(tl.sum(sacc, 1), 0))


@triton.jit
def _plain(buf, out, n_words, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # read_floor.py's plain read: program p reads CHUNK contiguous words, every load issued before the sum.
    p = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for j in tl.static_range(CHUNK // BLOCK):
        offs = p * CHUNK + j * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(buf + offs, mask=offs < n_words, other=0)
    tl.store(out + p, tl.sum(acc, axis=0))


# (name, tiles: touched experts x weight rows / 128, K) of decode GEMMs.
_CASES = (("llama gemm2 K=8192", 16 * 40, 8192), ("llama gemm1 K=5120", 16 * 128, 5120),
          ("qwen gemm1 M=64 K=2048", 126 * 12, 2048), ("qwen gemm2 M=64 K=768", 126 * 16, 768))


def main() -> None:
    dev, sms, flush = _setup()
    for name, tiles, chunks in ((name, tiles, k // 64) for name, tiles, k in _CASES):
        words = tiles * chunks * 1152
        buf = torch.ones(words, dtype=torch.int32, device=dev)
        scales = torch.ones(tiles * chunks * 128, dtype=torch.int32, device=dev)
        out = torch.empty(max(4 * tiles, 4 * sms), dtype=torch.int32, device=dev)
        nbytes = words * 4
        rows = []
        for chunk_kib in (16, 64):
            cw = chunk_kib * 256
            grid = triton.cdiv(words, cw)
            def run(grid=grid, cw=cw):
                _plain[(grid,)](buf, out, words, CHUNK=cw, BLOCK=2048, num_warps=4)
            run()
            rows.append((f"plain {chunk_kib} KiB per program", _time(run, flush)))
        for joint in (0, 1, 2):
            lay = ("split", "joint", "joint64")[joint]
            for sched, per_sm, kparts in (("persistent 2/SM", 2, 1), ("persistent 3/SM", 3, 1),
                                          ("persistent 4/SM", 4, 1), ("grid", 0, 1), ("grid/2", 0, 2)):
                for u in (4, 8):
                    if (chunks // kparts) % u:
                        continue
                    persistent = per_sm > 0
                    programs = per_sm * sms if persistent else tiles * kparts
                    def run(programs=programs, u=u, persistent=persistent, kparts=kparts, joint=joint):
                        _read[(programs,)](buf, scales, out, tiles, chunks, kparts, JOINT=joint, U=u,
                                           programs=programs, PERSISTENT=persistent, num_warps=4)
                    run()
                    rows.append((f"{lay} {sched} U={u}", _time(run, flush)))
        for label, us in rows:
            print(f"{name:24s} {label:32s} {us:8.1f} us  {nbytes / us / 1e6:.2f} TB/s")


if __name__ == "__main__":
    main()
