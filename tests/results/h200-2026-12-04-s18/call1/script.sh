#!/bin/bash
# session 18 call 1: the 48-token tile on two 128-row CTAs per SM (tree = b859f8a + 48), checks, sweeps, GPU tests
L=/tmp/c1; mkdir -p $L
OUT_REAL=$OUT; OUT=$L
source .carry/gpu/common.sh
env_record
B=.carry/s18/sm90_gemm_check; chmod +x $B
export MOE_FP4_LIB=$PWD/.carry/s18/libmoe_fp4_cuda.so
step chk 150 $B --no-bench
step memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 9 $B --small
step racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 9 $B --small
step sweep48 150 $B --bench-only --sweep --rounds 2 --tiles 32,48,64 --shapes qwen,llama,deepseek --ms 512,640,768,1024,1280 --iters 10
step splits 120 $B --bench-only --sweep-splits --shapes llama,deepseek,qwen --ms 1,4,16,64 --iters 10
step pytest 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cutlass_sm90.py tests/test_cuda_pipeline.py
tar czf $OUT_REAL/c1.tgz -C $L .
cat $L/steps.txt
tail -2 $L/chk.log; tail -3 $L/memcheck.log; tail -3 $L/racecheck.log
grep -E "^(qwen|ds|llama)" $L/sweep48.log
grep -E "^(qwen|ds|llama)" $L/splits.log
tail -5 $L/pytest.log
