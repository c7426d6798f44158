# s44a (prepared in session 43, not run): first the compile-before-eager test and its probe on the tree (5f34171 on:
# first calls off the graphs' pool, experts' tensors marked static when made; s43a ran the first change alone, and
# the static-address one has not run on a GPU); then experiment G2 (experiments/G2-...diff: Llama-4-Scout's second
# GEMM in 2 K splits at M = 28-51, by sm90_gemm_plan on libG2; s43a's sweep found that 7-9 % faster alone at M = 32
# and 48) against L in the whole forward, cutlass, Llama-4-Scout M = 32, 48, 64 (64: the control, whose plan G2
# leaves), three rounds in turns; the cutlass test files on G2 (what landing it needs); then the GPU test files s43a
# did not reach. Carry: .carry (bash tests/results/h100-2026-12-07-s43/prepare-carry.sh).
set -u; L=/tmp/s44a; DEADLINE=${DL:-540}; source .carry/gpu/common.sh
C=$(cat .carry/gpu/head)
G=/tmp/gs; mkdir -p $G; for v in L G2; do xz -dc .carry/gs/lib$v.so.xz > $G/lib$v.so; done
export PYTHONPATH=. MOE_FP4_LIB=$G/libL.so
save(){ tar czf $OUT/s44a.tgz -C $L . ; }
tests() {  # tests DIR FILES...: the files through the in-tree runner, within what is left of DEADLINE
  local d=$1; shift
  GPU_TEST_COMMIT=$C GPU_TEST_FILES="$*" GPU_TEST_TIMEOUT=240 GPU_TEST_DEADLINE=$(( DEADLINE - ($(date +%s) - T0) )) \
    PYTHON=python3 bash tests/run_gpu_tests.sh $L/$d
  save
}
env_record; mkdir -p $L/res
P=tests/results/h100-2026-12-07-s42/compile_first.py
(step compile_first_cutlass 150 python3 $P cutlass) & (step compile_first_triton 150 python3 $P triton) &
tests compile test_compile.py
wait; save
ab() {  # ab NAME SECONDS ROUNDS "LIBS" BENCH-ARGS...: the cutlass forward on each library in turns, ROUNDS rounds
  local name=$1 t=$2 rounds=$3 libs=$4; shift 4
  for r in $(seq "$rounds"); do
    for v in $libs; do
      step ${name}_${v}_r$r "$t" env MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --no-overhead \
        --budget-ms 20 --no-plot --out $L/res --name $name-$v-r$r --commit $C-$v "$@"
    done
    save
  done
}
ab llama 40 3 "L G2" --model llama4-scout --tokens 32,48,64
step tests_G2 150 env MOE_FP4_LIB=$G/libG2.so python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py \
  tests/test_cuda_pipeline.py
save
tests tests test_verify.py test_huge_m.py test_properties.py test_bench_gpu.py test_triton_values.py \
  test_triton_w4a16.py test_triton_batch.py test_triton_stages.py test_triton_launch.py
cat $L/steps.txt; grep -h "compile-first" $L/compile_first_*.log; tail -6 $L/compile/summary.txt
grep -h "^| 32 \|^| 48 \|^| 64 " $L/res/llama-*-r*.md | grep "cutlass |" | head -20; tail -12 $L/tests/summary.txt
