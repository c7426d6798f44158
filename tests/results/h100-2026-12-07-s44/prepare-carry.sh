#!/bin/bash
# What s44b / s44c carry, rebuilt on the CPU machine from the repository root (a few minutes on 2 cores), on a
# tree with experiments/T2-top1-reduce-in-the-second-gemm-epilogue.diff applied (s44c; s44b: with
# csrc/gemm_sm90.cu as experiments/T1-first-form-gemm_sm90.cu.diff has it):
#   git apply tests/results/h100-2026-12-07-s44/experiments/T2-top1-reduce-in-the-second-gemm-epilogue.diff
#   bash tests/results/h100-2026-12-07-s44/prepare-carry.sh
# .carry/gs/libT1.so.xz (the tree's csrc) and libL.so.xz (session 44's first commit's csrc, 8e62d75: csrc as since
# 69e799f), sm_90a only; .carry/gpu/base.tar.xz (8e62d75's tree, whose Python loads L: ABI 11);
# .carry/gpu/{common.sh,commit,head}.
set -eu
D=$(cd "$(dirname "$0")" && pwd); W=/tmp/s40-carry
bash $D/../h100-2026-12-07-s40/prepare-carry.sh T1
rm -rf $W/B && mkdir -p $W/B/src && git archive 8e62d75 csrc CMakeLists.txt | tar x -C $W/B/src
git archive 8e62d75 | xz -T2 > .carry/gpu/base.tar.xz
export PATH=$W/cut/site/bin:$PATH PYTHONPATH=$W/cut/site
cmake -S $W/B/src -B $W/B/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_FP4_CUDA_ARCHS=90a \
  "-DMOE_FP4_CUTLASS_INCLUDE_DIRS=$W/cut/site/cutlass_library/source/include;$W/cut/site/cutlass_library/source/tools/util/include" > $W/B/cmake.log
cmake --build $W/B/b --target moe_fp4_cuda -j2 > $W/B/build.log
xz -T2 -c $W/B/b/libmoe_fp4_cuda.so > .carry/gs/libL.so.xz
git rev-parse --short HEAD > .carry/gpu/head
