"""Where each sm_90a GEMM kernel's main loop starts in two builds of the library, and whether the loop is the same.

    python3 tests/results/h100-2026-12-07-s45/loop_offsets.py LIB_A LIB_B [CUOBJDUMP]

For every bf16 ``gemm_kernel`` instantiation: its SASS instruction count in each library, the byte offset of its
first HGMMA (and that offset modulo 128) in each, and whether the instructions from the first to the last HGMMA are
the same in both (hexadecimal constants and branch targets masked, register names kept). Runs on the CPU
(cuobjdump from the nvidia-cuda-cuobjdump wheel, or the one named).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def _cuobjdump() -> str:
    if len(sys.argv) > 3:
        return sys.argv[3]
    found = sorted(Path(sys.prefix).glob("lib/python3*/site-packages/nvidia/cu13/bin/cuobjdump"))
    return str(found[0]) if found else "cuobjdump"


def kernels(lib: str) -> dict[str, tuple[int, int, list[str]]]:
    """Per bf16 gemm_kernel (its template arguments): (instructions, first HGMMA's offset, the loop's instructions)."""
    sass = subprocess.run([_cuobjdump(), "-sass", lib], capture_output=True, text=True, check=True).stdout
    parts = re.split(r"\n\s*Function : (\S+)\n", sass)
    out = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        if "gemm_kernel" not in name or "bfloat16" not in name:
            continue
        short = re.sub(r"EEEv14.*", "", re.sub(r".*gemm_kernelI13__nv_bfloat16", "", name))
        code = [(int(m.group(1), 16), re.sub(r"0x[0-9a-f]+", "X", m.group(2)))
                for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", body)]
        hgmma = [i for i, (_, ins) in enumerate(code) if "HGMMA" in ins]
        out[short] = (len(code), code[hgmma[0]][0], [ins for _, ins in code[hgmma[0]:hgmma[-1] + 1]])
    return out


def main() -> None:
    a, b = kernels(sys.argv[1]), kernels(sys.argv[2])
    for k in sorted(a):
        (na, oa, la), (nb, ob, lb) = a[k], b[k]
        print(f"{k:42s} n {na:5d} {nb:5d}  first HGMMA {oa:#7x} ({oa % 128:3d}) {ob:#7x} ({ob % 128:3d})  "
              f"loop {'same' if la == lb else 'differs'}")


if __name__ == "__main__":
    main()
