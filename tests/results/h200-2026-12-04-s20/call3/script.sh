#!/bin/bash
# session 20 call 3: the landed build (tight token-tile bound, 16 chunks per cluster CTA): GEMM check,
# compute-sanitizer on the small cases, the cutlass GPU tests (the 640-case grid, both precisions) and
# the CUDA pipeline GPU tests
L=/tmp/s20c3; mkdir -p $L
source .carry/gpu/common.sh
env_record
save() { tar czf $OUT/s20c3.tgz -C $L .; }
export MOE_FP4_LIB=$PWD/.carry/s20/libmoe_fp4_cuda.so PYTHONPATH=.
B=.carry/s20/sm90_gemm_check; chmod +x $B
step chk 100 $B --no-bench
save
for tool in memcheck racecheck; do step san_$tool 60 compute-sanitizer --tool $tool --error-exitcode 9 $B --small; done
save
step pytest 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cutlass_sm90.py tests/test_cuda_pipeline.py
save
cat $L/steps.txt
tail -2 $L/chk.log; for t in memcheck racecheck; do tail -n 3 $L/san_$t.log; done
tail -n 3 $L/pytest.log
