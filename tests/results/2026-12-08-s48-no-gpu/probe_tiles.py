"""Compile candidate tiles of the Triton values GEMM for sm_90 on the CPU (no GPU) and print what bounds how many
programs an SM holds: registers a thread, shared memory a program, spills, wgmma count, and the K loop's SASS length.

    PYTHONPATH=. python tests/results/2026-12-08-s48-no-gpu/probe_tiles.py "32,128,128,T,8,3;..."

Fields: block_m, block_n, block_k, swap (T/F), warps, stages, and optionally maxnreg (GemmConfig.maxnreg). Counts,
not timings.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("tc", ROOT / "tests" / "test_triton_compile.py")
tc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tc)


def main(text: str) -> None:
    import triton.runtime.jit as jit

    from moe_fp4 import stages
    from moe_fp4.backends import triton as tb
    from moe_fp4.buffers import WeightOperand

    tk = tb.kernels()
    captured = []
    jit.JITFunction.__getitem__ = lambda self, grid: (lambda *a, **k: captured.append((self, a, k)))
    gen = torch.Generator().manual_seed(0)
    M, topk, E, H, I = 64, 8, 40, 1024, 768
    ids = torch.randint(0, E, (M, topk), generator=gen, dtype=torch.int32)
    r = stages.routing(ids, E)
    w = torch.randint(0, 255, (E, 2 * I, H // 2), generator=gen, dtype=torch.uint8)
    wt = WeightOperand.build(w, torch.ones(E, 2 * I, H // 16).to(torch.float8_e4m3fn), torch.ones(E, 2))
    vals = torch.empty(M * topk, H, dtype=torch.float16)
    k16 = tk.k16_codes(wt.packed)
    cfgs = []
    for f in text.split(";"):
        bm, bn, bk, swap, warps, st, *reg = f.split(",")
        cfgs.append(tk.GemmConfig(int(bm), int(bn), int(bk), swap_ab=swap == "T", num_warps=int(warps),
                                  num_stages=int(st), split_k=1, maxnreg=int(reg[0]) if reg else 0))
    for cfg in cfgs:
        tk.grouped_gemm_launcher(vals, None, k16, wt.scales, wt.alpha, r.expert_offsets, r.blockscale_offsets,
                                 torch.empty(M * topk, 2 * I, dtype=torch.bfloat16), cfg)()
    print("| tile | regs | stack | shared KiB | programs/SM (regs, smem) | wgmma | K loop SASS |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for cfg, (fn, args, kwargs) in zip(cfgs, captured, strict=True):
        kwargs = dict(kwargs, PDL=True, launch_pdl=True) if "PDL" in kwargs else kwargs
        kernel = tc._compile(fn, args, kwargs, 90)
        use = tc._resource_usage(kernel.asm["cubin"])
        loop = tc._main_loop(tc._sass(kernel.asm["cubin"], "-sass"))
        threads = 32 * cfg.num_warps
        by_regs = 65536 // (threads * ((use.get("REG", 0) + 7) // 8 * 8))
        by_smem = (228 * 1024) // (kernel.metadata.shared + 1024)  # (a block's 1 KiB of reserved shared memory)
        swap = "swap " if cfg.swap_ab else ""
        reg = f" r{cfg.maxnreg}" if cfg.maxnreg else ""
        name = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} {swap}w{cfg.num_warps}s{cfg.num_stages}{reg}"
        print(f"| {name} | {use.get('REG')} | {use.get('STACK', 0)} | {kernel.metadata.shared / 1024:.1f} | "
              f"{min(by_regs, by_smem, 64 // cfg.num_warps)} ({by_regs}, {by_smem}) | "
              f"{kernel.asm['ptx'].count('wgmma.mma_async')} | {len(loop)} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
