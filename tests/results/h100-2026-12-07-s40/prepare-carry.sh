#!/bin/bash
# What s40b carries, rebuilt on the CPU machine from the repository root (a few minutes on 2 cores):
#   bash tests/results/h100-2026-12-07-s40/prepare-carry.sh
# .carry/gs/libL.so.xz (the tree's csrc), libN2.so.xz (+ experiments/N2-...diff's csrc part) and libM3.so.xz
# (+ experiments/M3-...diff), sm_90a
# only, nvidia-cutlass 4.2.0.0 headers; .carry/n2/py.diff (the diff's Python part, applied on the device to a copy of
# the tree); .carry/gpu/{common.sh,commit}. Then on the device: DL=330 bash tests/results/h100-2026-12-07-s40/s40b.sh,
# or s40c.sh (prepared for the next session)
set -eu
D=$(cd "$(dirname "$0")" && pwd); DIFF=$D/experiments/N2-next-gemm-l2-prefetch.diff; W=/tmp/s40-carry
[ -d $W/cut/site/cutlass_library ] || (mkdir -p $W/cut && cd $W/cut &&
  pip download -q --no-deps nvidia-cutlass==4.2.0.0 "cmake>=4" ninja -d . && pip install -q --no-deps --target site ./*.whl)
export PATH=$W/cut/site/bin:$PATH PYTHONPATH=$W/cut/site
mkdir -p .carry/gs .carry/gpu .carry/n2
sed -n '/^diff --git a\/moe_fp4/,$p' $DIFF > .carry/n2/py.diff
# Arguments (session 43 on): the libraries to build, each L (the tree's csrc) or NAME=DIFF (the tree's csrc with
# DIFF's csrc part applied); default L, N2 and M3 as above.
[ $# -gt 0 ] || set -- L N2=$DIFF M3=$D/experiments/M3-two-slice-kernel-3-per-sm.diff
for spec in "$@"; do
  v=${spec%%=*}
  rm -rf $W/$v && mkdir -p $W/$v/src && cp -r csrc CMakeLists.txt $W/$v/src/
  [ "$spec" != "$v" ] && sed '/^diff --git a\/moe_fp4/,$d' "${spec#*=}" | (cd $W/$v/src && patch -s -p1)
  cmake -S $W/$v/src -B $W/$v/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_FP4_CUDA_ARCHS=90a \
    "-DMOE_FP4_CUTLASS_INCLUDE_DIRS=$W/cut/site/cutlass_library/source/include;$W/cut/site/cutlass_library/source/tools/util/include" > $W/$v/cmake.log
  cmake --build $W/$v/b --target moe_fp4_cuda -j2 > $W/$v/build.log
  xz -T2 -c $(find $W/$v/b -name libmoe_fp4_cuda.so | head -1) > .carry/gs/lib$v.so.xz
done
cp $D/../h100-2026-12-06-s39/common.sh .carry/gpu/common.sh
git rev-parse --short HEAD > .carry/gpu/commit
