#!/bin/bash
# What s46c.sh carries, rebuilt on the CPU machine from the repository root (about a minute a library on 2 cores):
#   bash tests/results/h100-2026-12-07-s46/prepare-carry-t2a.sh
# .carry/gs/libL.so.xz (the tree's csrc), libLA5.so.xz (+ session 45's LA5 diff: the 8- and 16-token kernels' main
# loops moved by 80 bytes, nothing else), libT2.so.xz (+ experiments/T2-...diff's csrc part: the top-1 reduce in
# the second GEMM's epilogue, second form, as session 45 ran it, rebased onto e244d15) and libT2A.so.xz
# (+ experiments/T2A-...diff's: T2 with 16-byte fences before the 8- and 16-token kernels' code splits, so that each
# main loop starts where L's does within a 128-byte block; t2a_offsets.log), sm_90a only; .carry/gpu/t2tree.tar.xz
# (the tree with the T2 diff applied, whose Python loads T2 and T2A: ABI 12; tests/results and benchmarks/results
# left out); .carry/gpu/{common.sh,commit,head}.
set -eu
D=$(cd "$(dirname "$0")" && pwd); E=$D/experiments; W=/tmp/s40-carry
csrc_part() {  # csrc_part DIFF OUT: the diff's csrc/ files only
  python3 -c "
import re, sys
parts = re.split(r'(?m)^(?=diff --git )', open(sys.argv[1]).read())
open(sys.argv[2], 'w').write(''.join(p for p in parts if p.startswith('diff --git a/csrc/')))" "$1" "$2"
}
mkdir -p $W
csrc_part $E/T2-top1-reduce-on-e244d15.diff $W/T2-csrc.diff
csrc_part $E/T2A-top1-reduce-loops-where-L-has-them.diff $W/T2A-csrc.diff
bash $D/../h100-2026-12-07-s40/prepare-carry.sh L LA5=$(ls $D/../h100-2026-12-07-s45/experiments/LA5-*.diff) \
  T2=$W/T2-csrc.diff T2A=$W/T2A-csrc.diff
rm -rf $W/t2tree && mkdir -p $W/t2tree && git archive HEAD | tar x -C $W/t2tree
(cd $W/t2tree && git apply $E/T2-top1-reduce-on-e244d15.diff && rm -rf tests/results benchmarks/results &&
  tar cf - . | xz -T2) > .carry/gpu/t2tree.tar.xz
git rev-parse --short HEAD > .carry/gpu/head
