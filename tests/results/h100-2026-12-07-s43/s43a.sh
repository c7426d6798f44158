# s43a: torch.compile(mode="reduce-overhead") before any eager call (s42c's compile_first.py probe), per backend,
# on HEAD's Python before the change (.carry/base: `git archive <base> moe_fp4 triton_kernels`) and on the tree
# with first calls off the graphs' pool (pipeline.off_graph_pool), four processes at once; then the GPU test files
# through tests/run_gpu_tests.sh, test_compile.py first (its new compile-before-eager test and the reduce-overhead
# test s42b saw fail). Library: libL (csrc unchanged since 69e799f). Carry: .carry (prepare-carry.sh of
# ../h100-2026-12-07-s40, `git rev-parse --short HEAD > .carry/gpu/head`, and .carry/base as above).
set -u; L=/tmp/s43a; DEADLINE=${DL:-540}; source .carry/gpu/common.sh
G=/tmp/gs; mkdir -p $G; xz -dc .carry/gs/libL.so.xz > $G/libmoe_fp4_cuda.so
export MOE_FP4_LIB=$G/libmoe_fp4_cuda.so
env_record
P=tests/results/h100-2026-12-07-s42/compile_first.py
for b in cutlass triton; do
  (PYTHONPATH=.carry/base step base_compile_first_$b 150 python3 $P $b) &
  (PYTHONPATH=. step compile_first_$b 150 python3 $P $b) &
done
wait
tar czf $OUT/s43a.tgz -C $L .
export PYTHONPATH=.
GPU_TEST_FILES="test_compile.py test_cutlass_sm90.py test_cuda_pipeline.py test_triton_moe.py test_concurrency.py
  test_precision.py test_sm90_restore.py test_check_inputs.py test_resident_layout.py test_verify.py test_huge_m.py
  test_properties.py test_bench_gpu.py test_triton_values.py test_triton_w4a16.py test_triton_batch.py
  test_triton_stages.py test_triton_launch.py" GPU_TEST_TIMEOUT=240 \
  GPU_TEST_DEADLINE=$(( DEADLINE - ($(date +%s) - T0) )) PYTHON=python3 bash tests/run_gpu_tests.sh $L/tests
tar czf $OUT/s43a.tgz -C $L .
cat $L/steps.txt; grep -h "compile-first" $L/*compile_first*.log; cat $L/tests/summary.txt 2>/dev/null | tail -30
