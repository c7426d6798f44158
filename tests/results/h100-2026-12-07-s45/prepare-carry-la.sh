#!/bin/bash
# What s46a.sh carries, rebuilt on the CPU machine from the repository root (about 2.5 minutes a library on 2 cores):
#   bash tests/results/h100-2026-12-07-s45/prepare-carry-la.sh
# .carry/gs/libL.so.xz (the tree's csrc) and libLA1..7.so.xz (+ experiments/LA<i>-...diff: <i> membar.cta before
# the 8- and 16-token tiles' kernels' code splits into producer and consumers, which moves those kernels' main loops
# by 16 <i> bytes and nothing else; loop_offsets.py checks that on the CPU), sm_90a only; .carry/gpu/{common.sh,commit}.
set -eu
D=$(cd "$(dirname "$0")" && pwd)
bash $D/../h100-2026-12-07-s40/prepare-carry.sh L $(for i in 1 2 3 4 5 6 7; do
  echo LA$i=$(ls $D/experiments/LA$i-*.diff); done)
git rev-parse --short HEAD > .carry/gpu/head
