"""SASS instruction counts of the Triton GEMM's K loop (the codes operand against the values operand) and
of the values form's quantization kernels.

Compiles every launch tests/test_triton_compile.py captures (Triton's compiler and ptxas, no
GPU needed) and prints, per GEMM configuration on sm_90, the K loop's instructions, its operand
work (integer bit operations, PRMTs and the fp16 scale multiplies) and both per weight element,
for ``STAGES`` (codes: both operands dequantized in registers) and ``STAGES_VALUES`` (fp16
activation values, K16 weights); then, per quantization launch (both forms, 16-wide blocks or whole
blocks per thread, ``QuantConfig.whole_blocks``), its static instructions per element.
Counts, not timings: what they buy is measured on the H200.

    python benchmarks/triton_sass.py > benchmarks/results/triton-sass-<date>.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def records() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "test_triton_compile.py"), "--worker"], env=env,
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def quant_table(recs: list[dict]) -> None:
    """The quantization launches: static SASS instructions per element of a program."""
    print("\n## Quantization kernels, sm_90 SASS\n")
    print("Static instructions of the kernel divided by the elements a thread quantizes (BLOCK_R x BLOCK_K / "
          "threads; the kernels have no loop; the routing kernel's own code counts in its rows, and the codes "
          "form's the scale padding's zeroing branch). Values: fp16 `e2m1 * e4m3` (the Hopper form); codes: "
          "packed codes and swizzled scales. Whole: `QuantConfig.whole_blocks`. E block: the experts' offsets "
          "read per step (1024 for more than 256 experts). Rows alike in every column are builds for another "
          "input dtype (the capture's fp16 SiLU rows).\n")
    print("| kernel | form | front end | router weight | BLOCK_R x BLOCK_K | warps | E block | whole "
          "| per element | bf16 cvt (PTX) | regs |")
    print("|---|---|---|---|---|---:|---:|---|---:|---:|---:|")
    quant = [r for r in recs if r["kernel"] in ("quantize_grouped_kernel", "routing_quantize_kernel")
             and r["arch"] == 90 and r["constexprs"].get("MODE", 1) in (1, 2)]

    def values(r) -> bool:
        return bool(r["constexprs"].get("VALUES", r["kernel"] == "routing_quantize_kernel"))

    for r in sorted(quant, key=lambda r: (r["kernel"], not values(r), r["constexprs"].get("MODE", 1),
                                          r["constexprs"]["BLOCK_R"] * r["constexprs"]["BLOCK_K"],
                                          r["constexprs"]["HAS_ROW_SCALE"], bool(r["constexprs"].get("WHOLE")))):
        c = r["constexprs"]
        front = {1: "gather", 2: "SiLU-mul"}[c.get("MODE", 1)]
        print(f"| {r['kernel']} | {'values' if values(r) else 'codes'} | {front} | {c['HAS_ROW_SCALE']} "
              f"| {c['BLOCK_R']} x {c['BLOCK_K']} | {r['options']['num_warps']} | {c['E_BLOCK']} "
              f"| {bool(c.get('WHOLE'))} "
              f"| {r['per_element']} | {r['cvt_bf16']} | {r['usage']['REG']} |")


def main() -> None:
    import torch
    import triton

    shape = ("BM", "BN", "BK", "SWAP_AB", "SPLIT", "FAST", "ASM")
    recs = records()
    gemms = [r for r in recs if r["kernel"] == "grouped_gemm_kernel" and r["arch"] == 90]
    codes = {}
    for r in gemms:
        if not r["constexprs"]["VALUES"]:
            codes.setdefault((tuple(r["constexprs"][k] for k in shape), r["options"]["num_warps"]), r)
    tree = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or "unknown"
    print(f"# Triton GEMM K loop, sm_90 SASS (compiled here, not run): triton {triton.__version__}, "
          f"torch {torch.__version__}\n")
    print(f"Generated {time.strftime('%Y-%m-%d', time.gmtime())} from tree {tree} on a machine without a GPU "
          "(Triton's compiler and ptxas only).\n")
    print("Per thread and K step. Operand work: LOP3, SHF, IMAD, LEA, PRMT and HMUL2 in the loop. Per weight "
          "element: divided by the weight elements a thread builds per step (BN x BK / threads); the codes GEMM "
          "builds as many activation elements again (BM x BK / threads) besides.\n")
    print("| BM x BN x BK | swap | split | dequant | warps | epilogue | loop codes | loop values "
          "| operand work codes | operand work values | per weight el. codes | per weight el. values "
          "| regs codes | regs values |")
    print("|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in gemms:
        c = r["constexprs"]
        if not c["VALUES"]:
            continue
        warps = r["options"]["num_warps"]
        # The values table's own tiles have no codes twin; the SiLU-fused first GEMM is a row of its own.
        twin = codes.get((tuple(c[k] for k in shape), warps))
        weights = c["BN"] * c["BK"] / (32 * warps)
        dequant = "bits (asm)" if c["ASM"] else ("bits" if c["FAST"] else "float")
        if c.get("DENSE"):
            dequant = "dense (none in the loop)"  # the weights come dequantized (dequantize_k16_kernel)
        epilogue = "SiLU-mul quant" if c.get("SILU") else "store"

        def col(key, rec=twin, per=1.0, fmt="") -> str:
            return "-" if rec is None else format(rec[key] / per if per != 1.0 else rec[key], fmt)

        print(f"| {c['BM']} x {c['BN']} x {c['BK']} | {c['SWAP_AB']} | {c['SPLIT']} | {dequant} | {warps} "
              f"| {epilogue} | {col('loop')} | {r['loop']} | {col('loop_alu')} | {r['loop_alu']} "
              f"| {col('loop_alu', per=weights, fmt='.2f')} | {r['loop_alu'] / weights:.2f} "
              f"| {'-' if twin is None else twin['usage']['REG']} | {r['usage']['REG']} |")
    quant_table(recs)


if __name__ == "__main__":
    main()
