#!/bin/bash
# session 20 call 6: tests/run_sanitizer.sh (memcheck and racecheck) on the landed build f52f5fc
L=/tmp/s20c6; mkdir -p $L
source .carry/gpu/common.sh
env_record
export MOE_FP4_LIB=$PWD/.carry/s20b/libmoe_fp4_cuda.so PYTHONPATH=. PYTHON=python3
SANITIZER_TOOLS="memcheck racecheck" SANITIZER_TIMEOUT=200 step sanitizer 450 bash tests/run_sanitizer.sh $L/san
rm -rf $L/san/triton-cache
tar czf $OUT/s20c6.tgz -C $L .
cat $L/steps.txt; cat $L/san/summary.txt
