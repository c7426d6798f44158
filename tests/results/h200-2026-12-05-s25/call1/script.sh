#!/bin/bash
# session 25, call 1: decode GEMM candidates with explicit K splits (wave quantization at M = 4-64), and
# 256-column whole-block rows for the values SiLU-and-mul quantization (Qwen3's I = 768) at 65-4096 slots
source .carry/gpu/common.sh
L=/tmp/s25c1; mkdir -p $L/res; env_record
export PYTHONPATH=.
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so
echo "commit ${COMMIT:-unknown}" >> $L/env.txt
step quant 150 python3 benchmarks/sweep_triton_values.py $L/res/quant.json --quant --models qwen3-30b-a3b --tokens 16,64,256,1024 --budget-ms 5 --fields "1,512,1,1024,T;2,256,1,1024,T;4,256,1,1024,T;4,256,2,1024,T;8,256,2,1024,T;2,512,1,1024,T"
F="16,64,256,T,4,3,0;16,64,256,T,4,3,2;16,64,256,T,4,4,2;16,64,128,T,4,4,2;16,64,128,T,4,4,4;16,128,128,T,4,5,0;16,128,128,T,4,5,2;16,64,128,T,4,6,0"
step gq 170 python3 benchmarks/sweep_triton_values.py $L/res/gemm-qwen.json --no-fused --models qwen3-30b-a3b --tokens 1,4,16,64 --budget-ms 5 --fields "$F"
step gl 120 python3 benchmarks/sweep_triton_values.py $L/res/gemm-llama.json --no-fused --models llama4-scout --tokens 1,4,16 --budget-ms 5 --fields "$F"
step gd 140 python3 benchmarks/sweep_triton_values.py $L/res/gemm-deepseek.json --no-fused --models deepseek-v3 --tokens 1,4,16 --budget-ms 5 --fields "$F"
tar czf $OUT/s25c1.tgz -C $L .
cat $L/steps.txt
for f in quant gq gl gd; do grep -A60 "best per" $L/$f.log; done
