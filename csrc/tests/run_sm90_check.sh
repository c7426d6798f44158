#!/usr/bin/env bash
# Builds the standalone sm_90a GEMM check (csrc/tests/sm90_gemm_check.cu) against
# libmoe_fp4_cuda.so and runs it on GPU 0 (an H100/H200). Not part of the library build or CI.
#
#   csrc/tests/run_sm90_check.sh [--lib DIR] [--out DIR] [--build-only] [-- ARGS for the check]
#
#   --lib DIR     use DIR/libmoe_fp4_cuda.so (default: build one for 90a with CMake into OUT/lib)
#   --out DIR     where the binary (and the library build) go (default /tmp/sm90check)
#   --build-only  build, do not run
#   ARGS          --quick, --no-bench, --bench-only, --iters N (see the .cu file)
#
# Building the library needs CMake >= 3.27, ninja, nvcc >= 12.9 and the nvidia-cutlass==4.2.0.0
# headers (found through python's cutlass_library, or MOE_FP4_CUTLASS_INCLUDE_DIRS).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=/tmp/sm90check
LIB=""
RUN=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --lib) LIB=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --build-only) RUN=0; shift ;;
    --) shift; break ;;
    *) break ;;
  esac
done
mkdir -p "$OUT"
NVCC=${CUDACXX:-nvcc}

if [[ -z "$LIB" ]]; then
  INC=${MOE_FP4_CUTLASS_INCLUDE_DIRS:-}
  if [[ -z "$INC" ]]; then
    PY=${PYTHON:-python3}
    SRC=$("$PY" -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source"))')
    INC="$SRC/include;$SRC/tools/util/include"
  fi
  cmake -S "$ROOT" -B "$OUT/lib" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$(command -v "$NVCC")" \
    -DMOE_FP4_CUDA_ARCHS=90a "-DMOE_FP4_CUTLASS_INCLUDE_DIRS=$INC" >/dev/null
  cmake --build "$OUT/lib" --target moe_fp4_cuda -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
  LIB="$OUT/lib"
fi
if [[ "$(cd "$LIB" && pwd)" != "$(cd "$OUT" && pwd)" ]]; then cp "$LIB/libmoe_fp4_cuda.so" "$OUT/"; fi

"$NVCC" -std=c++17 -O2 -I"$ROOT/csrc/include" "$ROOT/csrc/tests/sm90_gemm_check.cu" -Xcompiler -pthread \
  -L"$OUT" -lmoe_fp4_cuda -Xlinker -rpath -Xlinker '$ORIGIN' -o "$OUT/sm90_gemm_check"
echo "built $OUT/sm90_gemm_check"
if [[ $RUN -eq 1 ]]; then
  exec "$OUT/sm90_gemm_check" "$@"
fi
