"""Warp-stall samples per source line and per SASS instruction of the GEMM kernels in an Nsight Compute source-page
CSV (``ncu --import R.ncu-rep --page source --csv --print-source cuda,sass``; the library built with line tables).

    python tests/results/h100-2026-12-07-s40/stall_by_line.py tests/results/h100-2026-12-07-s40/s40a/s39d/source.csv.xz

The export repeats each kernel's files (one block of "File Path" rows per profiled kernel, the first file being
gemm_sm90.cu): a kernel starts where gemm_sm90.cu's block starts again. Each SASS row is counted once (the export
lists it under its CUDA line and again in the SASS view).
"""

import collections
import csv
import io
import lzma
import sys

STALLS = slice(33, 51)  # the stall_* columns (all samples)


def kernels(rows):
    header, cur, out, fname, line = rows[2], None, [], None, None
    for r in rows:
        if not r:
            continue
        if r[0] == "File Path":
            fname = r[1].rsplit("/", 1)[-1]
            if cur is None or (fname == "gemm_sm90.cu" and cur["seen_other"]):
                cur = {"sass": {}, "seen_other": False}
                out.append(cur)
            cur["seen_other"] |= fname != "gemm_sm90.cu"
            continue
        if r[0] in ("Function Name", "Line No"):
            continue
        if r[0]:
            line = int(r[0])
            continue
        if r[2].startswith("0x") and r[2] not in cur["sass"]:
            stalls = {h: int(v or 0) for h, v in zip(header[STALLS], r[STALLS])}
            cur["sass"][r[2]] = (fname, line, r[3].strip(), int(r[4] or 0), stalls)
    return out


def main(path):
    text = lzma.open(path, "rt").read() if path.endswith(".xz") else open(path).read()
    rows = list(csv.reader(io.StringIO(text)))
    for i, k in enumerate(kernels(rows), 1):
        sass = list(k["sass"].values())
        total = sum(s[3] for s in sass)
        reasons = collections.Counter()
        lines = collections.Counter()
        for f, line, _, n, st in sass:
            reasons.update(st)
            lines[(f, line)] += n
        print(f"kernel {i}: {total} samples, {len(sass)} SASS instructions")
        print("  by reason:", ", ".join(f"{r[6:]} {n} ({100 * n / total:.0f} %)" for r, n in reasons.most_common(6)))
        print("  by line:")
        for (f, line), n in lines.most_common(8):
            print(f"    {f}:{line:<5} {n:5d} ({100 * n / total:4.1f} %)")
        print("  by instruction:")
        for f, line, text, n, st in sorted(sass, key=lambda s: -s[3])[:6]:
            top = max(st, key=st.get)
            print(f"    {n:5d}  {f}:{line:<5} {text[:58]:<58} (mostly {top[6:]})")


if __name__ == "__main__":
    main(sys.argv[1])
