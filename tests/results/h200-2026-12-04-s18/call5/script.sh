#!/bin/bash
# session 18 call 5: the landed build (HEAD), the check tool with its new cases, the sanitizer, the CUDA pipeline GPU tests
L=/tmp/c5; mkdir -p $L
OUT_REAL=$OUT; OUT=$L
source .carry/gpu/common.sh
env_record
B=.carry/s18/sm90_gemm_check; chmod +x $B
export MOE_FP4_LIB=$PWD/.carry/s18/libmoe_fp4_cuda.so
step chk 70 $B --no-bench
step memcheck 30 compute-sanitizer --tool memcheck --error-exitcode 9 $B --small
step racecheck 40 compute-sanitizer --tool racecheck --error-exitcode 9 $B --small
step pytest 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_pipeline.py
tar czf $OUT_REAL/c5.tgz -C $L .
cat $L/steps.txt
tail -2 $L/chk.log; tail -2 $L/memcheck.log; tail -2 $L/racecheck.log; tail -2 $L/pytest.log
