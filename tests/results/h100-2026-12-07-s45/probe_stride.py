"""Does the sm_90a GEMM's weight layout read slower where a 64-row group's bytes sit a power of two apart?

Session 35 found Llama-4-Scout's second GEMM (K = 8192) moving 2.0-2.3 TB/s at decode where the first (K = 5120)
moves 2.6-2.7 and DeepSeek-V3's first (K = 7168) 2.8-2.9. In the prepared layout (csrc/include/moe_fp4/
sm90_layout.cuh) a 64-row group's codes take 32 K bytes, chunk by chunk (2 KiB per 64-wide K chunk): 256 KiB for
K = 8192, a power of two, so the 396 persistent CTAs' streams start 256 KiB apart. This probe reads bytes in the
GEMM's order only (no dequantization, no MMA): persistent programs, tile i = program + j * programs, each tile two
64-row groups read chunk by chunk (codes, then the scales' 256 bytes per group and chunk), with the groups' stride
padded or not. If the padded stride reads faster, the layout costs the GEMM; if not, the gap is the kernel's.

Run on a GPU: PYTHONPATH=. python3 tests/results/h100-2026-12-07-s45/probe_stride.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tile_read(codes, scales, out, tiles, chunks, group_words, scale_group_words,
               U: tl.constexpr, PROGRAMS: tl.constexpr):
    # Words are int32. A chunk is 512 code words (2 KiB) and 64 scale words (256 B) per group.
    p = tl.program_id(0)
    acc = tl.zeros([2, U * 512], dtype=tl.int32)
    sacc = tl.zeros([2, U * 64], dtype=tl.int32)
    g = tl.arange(0, 2)[:, None]
    cw = tl.arange(0, U * 512)[None, :]
    sw = tl.arange(0, U * 64)[None, :]
    for t in range(p, tiles, PROGRAMS):
        gbase = (2 * t + g).to(tl.int64)
        for c in range(0, chunks, U):
            acc += tl.load(codes + gbase * group_words + c * 512 + cw)
            sacc += tl.load(scales + gbase * scale_group_words + c * 64 + sw)
    tl.store(out + p, tl.sum(tl.sum(acc, 1), 0) + tl.sum(tl.sum(sacc, 1), 0))


def _time(fn, flush, reps=15):
    times = []
    for _ in range(reps):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    times.sort()
    return times[len(times) // 2]


def _setup():
    """The GPU, its SM count and a 512 MiB buffer whose zeroing flushes the L2; the GPU's name printed."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(torch.cuda.get_device_name(dev), sms, "SMs")
    return dev, sms, torch.empty(512 << 20, dtype=torch.uint8, device=dev)


def main() -> None:
    dev, sms, flush = _setup()
    # (name, experts x weight rows / 128 = tiles, K), the touched experts' full tiles at decode.
    cases = [("llama gemm2 K=8192", 16 * 40, 8192), ("llama gemm1 K=5120", 16 * 128, 5120),
             ("deepseek gemm1 K=7168", 64 * 32, 7168), ("deepseek gemm2 K=2048", 64 * 56, 2048)]
    for name, tiles, k in cases:
        chunks = k // 64
        for pad_kib in (0, 2, 6, 32):
            group_words = 8 * k + pad_kib * 256  # 32 K bytes per group, plus the pad
            scale_group_words = k + (pad_kib * 256) // 8
            codes = torch.ones(2 * tiles * group_words, dtype=torch.int32, device=dev)
            scales = torch.ones(2 * tiles * scale_group_words, dtype=torch.int32, device=dev)
            out = torch.empty(4 * sms, dtype=torch.int32, device=dev)
            nbytes = tiles * 2 * chunks * (2048 + 256)
            for per_sm in (2, 3, 4):
                programs = per_sm * sms
                for u in (4, 8):
                    def run(programs=programs, u=u):
                        _tile_read[(programs,)](codes, scales, out, tiles, chunks, group_words, scale_group_words,
                                                U=u, PROGRAMS=programs, num_warps=4)
                    run()
                    us = _time(run, flush)
                    print(f"{name:24s} pad {pad_kib:2d} KiB  {per_sm}/SM  U={u}: {us:8.1f} us  "
                          f"{nbytes / us / 1e6:.2f} TB/s")


if __name__ == "__main__":
    main()
