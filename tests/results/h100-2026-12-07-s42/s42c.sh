# s42c (prepared in session 42, not run): first compile_first.py, a reduce-overhead compile with no eager call first
# (the README asks for one), per backend; then the GPU test files s42b did not reach, the reduce-overhead compile test
# on the fix of 9843b79 first (its cutlass case failed in s42b), one pytest process per file (tests/run_gpu_tests.sh), on the landed library
# (libL: csrc unchanged since 69e799f). Carry: .carry (../h100-2026-12-07-s40/prepare-carry.sh, then
# `git rev-parse --short HEAD > .carry/gpu/head`). test_distributed.py needs two GPUs and is left out.
set -u; L=/tmp/s42c; DEADLINE=${DL:-540}; source .carry/gpu/common.sh
G=/tmp/gs; mkdir -p $G; xz -dc .carry/gs/libL.so.xz > $G/libmoe_fp4_cuda.so
export PYTHONPATH=. MOE_FP4_LIB=$G/libmoe_fp4_cuda.so
env_record
for b in cutlass triton; do
  step compile_first_$b 120 python3 tests/results/h100-2026-12-07-s42/compile_first.py $b
done
tar czf $OUT/s42c.tgz -C $L .
# The in-tree runner (one pytest process per file, summary.txt), within what is left of DEADLINE.
GPU_TEST_FILES="test_compile.py test_precision.py test_cutlass_sm90.py test_cuda_pipeline.py test_sm90_restore.py
  test_check_inputs.py test_concurrency.py test_resident_layout.py test_verify.py test_bench_gpu.py test_huge_m.py
  test_properties.py" GPU_TEST_TIMEOUT=240 GPU_TEST_DEADLINE=$(( DEADLINE - ($(date +%s) - T0) )) PYTHON=python3 \
  bash tests/run_gpu_tests.sh $L/tests
tar czf $OUT/s42c.tgz -C $L .
cat $L/steps.txt
