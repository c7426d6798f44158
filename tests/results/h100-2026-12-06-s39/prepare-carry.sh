#!/bin/bash
# Rebuilds, on the CPU machine, what s39d and s39e carry: .carry/gpu/{common.sh,commit} and, in .carry/gs,
# L (the tree's csrc), LI (the same with line tables), PF, PF2 and KC (L + this folder's experiment diffs), each built
# for sm_90a only with the nvidia-cutlass 4.2.0.0 headers and xz-compressed. Run from the repository root:
#   bash tests/results/h100-2026-12-06-s39/prepare-carry.sh      (a few minutes on 2 cores)
# then on the device: DL=75 bash tests/results/h100-2026-12-06-s39/s39d.sh; DL=560 bash .../s39e.sh
# (carry [".carry"]).
set -eu
D=$(cd "$(dirname "$0")" && pwd); ROOT=$PWD; W=/tmp/s39-carry
mkdir -p $W/cut .carry/gpu .carry/gs
if [ ! -d $W/cut/site/cutlass_library ]; then
  (cd $W/cut && pip download -q --no-deps nvidia-cutlass==4.2.0.0 "cmake>=4" ninja -d . &&
   pip install -q --no-deps --target site ./*.whl)
fi
S=$W/cut/site/cutlass_library/source
export PATH=$W/cut/site/bin:$PATH PYTHONPATH=$W/cut/site
build() {  # build NAME [DIFF] [extra cmake args...]
  local n=$1 diff=$2; shift 2
  rm -rf $W/$n && mkdir -p $W/$n/src && cp -r $ROOT/csrc $ROOT/CMakeLists.txt $W/$n/src/
  [ -n "$diff" ] && (cd $W/$n/src && patch -s -p1 < $diff)
  cmake -S $W/$n/src -B $W/$n/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_FP4_CUDA_ARCHS=90a \
    "-DMOE_FP4_CUTLASS_INCLUDE_DIRS=$S/include;$S/tools/util/include" "$@" > $W/$n/cmake.log
  cmake --build $W/$n/b --target moe_fp4_cuda -j2 > $W/$n/build.log
  xz -T2 -c $(find $W/$n/b -name libmoe_fp4_cuda.so | head -1) > .carry/gs/lib$n.so.xz
  echo "built $n"
}
build L ""
build LI "" -DMOE_FP4_LINEINFO=ON
build PF $D/experiments/PF-l2-prefetch.diff
build PF2 $D/experiments/PF2-l2-prefetch-two-turns.diff
build KC $D/experiments/KC-two-slices-in-a-cluster-of-2.diff
cp $D/common.sh .carry/gpu/common.sh
git rev-parse --short HEAD > .carry/gpu/commit
ls -la .carry/gs .carry/gpu
