# s43a: torch.compile(mode="reduce-overhead") before any eager call (s42c's compile_first.py probe), per backend,
# on the Python before the change (.carry/base: `git archive 293be99 moe_fp4 triton_kernels`) and on the tree with
# first calls off the graphs' pool (pipeline.off_graph_pool, 84f66de), four processes at once; test_compile.py's
# GPU tests (the new compile-before-eager test, and the reduce-overhead test s42b saw fail for cutlass); s42d's
# sweeps (each decode GEMM alone over the plans the library can run: ../h100-2026-12-07-s42/s42d.sh says why);
# then the other GPU test files through tests/run_gpu_tests.sh until the deadline. Library: libL (csrc unchanged
# since 69e799f). Carry: .carry (../h100-2026-12-07-s40/prepare-carry.sh, `git rev-parse --short HEAD >
# .carry/gpu/head`, .carry/base as above, and the check binary as s42d.sh says).
set -u; L=/tmp/s43a; DEADLINE=${DL:-540}; source .carry/gpu/common.sh
G=/tmp/gs; mkdir -p $G; xz -dc .carry/gs/libL.so.xz > $G/libmoe_fp4_cuda.so
xz -dc .carry/gs/sm90_gemm_check.xz > $G/sm90_gemm_check && chmod +x $G/sm90_gemm_check
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
tests() {  # tests DIR FILES...: the files through the in-tree runner, within what is left of DEADLINE
  local d=$1; shift
  GPU_TEST_FILES="$*" GPU_TEST_TIMEOUT=240 GPU_TEST_DEADLINE=$(( DEADLINE - ($(date +%s) - T0) )) PYTHON=python3 \
    bash tests/run_gpu_tests.sh $L/$d
  tar czf $OUT/s43a.tgz -C $L .
}
tests compile test_compile.py
step sweep_llama 150 $G/sm90_gemm_check --bench-only --sweep-splits --shapes llama --ms 16,32,48,64,96
tar czf $OUT/s43a.tgz -C $L .
step sweep_qwen 120 $G/sm90_gemm_check --bench-only --sweep-splits --shapes qwen --ms 1,4,16,64
tar czf $OUT/s43a.tgz -C $L .
tests tests test_cutlass_sm90.py test_cuda_pipeline.py test_triton_moe.py test_concurrency.py test_precision.py \
  test_sm90_restore.py test_check_inputs.py test_resident_layout.py test_verify.py test_huge_m.py test_properties.py \
  test_bench_gpu.py test_triton_values.py test_triton_w4a16.py test_triton_batch.py test_triton_stages.py \
  test_triton_launch.py
cat $L/steps.txt; grep -h "compile-first" $L/*compile_first*.log; tail -4 $L/compile/summary.txt
cut -c1-300 $L/sweep_llama.log $L/sweep_qwen.log | tail -60; tail -20 $L/tests/summary.txt
