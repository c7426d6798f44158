#!/bin/bash
# session 22 call 1: the Triton dense GEMM (weights dequantized into an fp16 scratch, then fp16 x fp16):
# its GPU cases, then the dense candidates against the table's in-loop tile on the three layers' prefill.
L=/tmp/s22c1; mkdir -p $L
source .carry/gpu/common.sh
env_record
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so PYTHONPATH=.
step pytest 110 python3 -m pytest -q -p no:cacheprovider tests/test_triton_values.py -k "dense"
step sweep_qwen 240 python3 benchmarks/sweep_triton_values.py $L/sweep_qwen.json --models qwen3-30b-a3b --tokens 1024,4096,16384 --dense --no-fused
step sweep_ld 200 python3 benchmarks/sweep_triton_values.py $L/sweep_ld.json --models llama4-scout,deepseek-v3 --tokens 4096 --dense --no-fused
tar czf $OUT/s22c1.tgz -C $L .
cat $L/steps.txt
tail -3 $L/pytest.log
grep -A40 "best per" $L/sweep_qwen.log $L/sweep_ld.log
