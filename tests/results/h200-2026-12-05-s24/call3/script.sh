#!/bin/bash
# session 24, call 3: session 23's --quant sweep (whole-block candidates) on the three layers, then more of its GPU tests
source .carry/gpu/common.sh
L=/tmp/s24c3; mkdir -p $L/res; env_record
export PYTHONPATH=.
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so
echo "commit ${COMMIT:-unknown}" >> $L/env.txt
step quant 330 python3 benchmarks/sweep_triton_values.py $L/res/triton-quant-sweep.json --quant --models qwen3-30b-a3b,llama4-scout,deepseek-v3 --tokens 1,64,1024,4096,16384 --budget-ms 5
step whole 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_values.py tests/test_triton_stages.py -k "halves or whole or fused_routing or configs" -x
tar czf $OUT/s24c3.tgz -C $L .
cat $L/steps.txt
tail -4 $L/whole.log
grep -A200 "best per" $L/quant.log | head -70
