#!/bin/bash
# What s44a.sh carries, rebuilt on the CPU machine from the repository root (a few minutes on 2 cores):
#   bash tests/results/h100-2026-12-07-s43/prepare-carry.sh
# .carry/gs/libL.so.xz (the tree's csrc) and libG2.so.xz (+ experiments/G2-...diff), sm_90a only, by session 40's
# script; .carry/gpu/{common.sh,commit,head}.
set -eu
D=$(cd "$(dirname "$0")" && pwd)
bash $D/../h100-2026-12-07-s40/prepare-carry.sh L G2=$D/experiments/G2-two-k-splits-llama-gemm2-m32-48.diff
git rev-parse --short HEAD > .carry/gpu/head
