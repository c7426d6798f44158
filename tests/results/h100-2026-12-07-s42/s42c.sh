# s42c (prepared in session 42, not run): first compile_first.py, a reduce-overhead compile with no eager call first
# (the README asks for one), per backend; then the GPU test files s42b did not reach, the reduce-overhead compile test
# on the fix of 9843b79 first (its cutlass case failed in s42b), one pytest process per file, on the landed library
# (libL: csrc unchanged since 69e799f). Carry: .carry (../h100-2026-12-07-s40/prepare-carry.sh, then
# `git rev-parse --short HEAD > .carry/gpu/head`). test_distributed.py needs two GPUs and is left out.
set -u; L=/tmp/s42c; DEADLINE=${DL:-540}; source .carry/gpu/common.sh
G=/tmp/gs; mkdir -p $G; xz -dc .carry/gs/libL.so.xz > $G/libmoe_fp4_cuda.so
export PYTHONPATH=. MOE_FP4_LIB=$G/libmoe_fp4_cuda.so
env_record
for b in cutlass triton; do
  step compile_first_$b 120 python3 tests/results/h100-2026-12-07-s42/compile_first.py $b
done
for f in compile precision cutlass_sm90 cuda_pipeline sm90_restore check_inputs concurrency resident_layout verify \
         bench_gpu huge_m properties; do
  step $f 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs tests/test_$f.py
  tar czf $OUT/s42c.tgz -C $L .
done
cat $L/steps.txt; grep -h "passed\|failed\|error" $L/*.log | grep -v "^E " | tail -40
