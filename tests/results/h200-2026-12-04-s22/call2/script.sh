#!/bin/bash
# session 22 call 2: where the dense GEMM starts to pay (512 and 1024 rows per expert), its chunk size
# (512 / 1024 / 2048 MiB) and tile, against the table's in-loop tile.
L=/tmp/s22c2; mkdir -p $L
source .carry/gpu/common.sh
env_record
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so PYTHONPATH=.
F="128,256,64,F,8,3,1,bits,1024;128,256,64,F,8,4,1,bits,1024;256,128,64,F,8,3,1,bits,1024;128,256,64,F,8,3,1,bits,512;128,256,64,F,8,3,1,bits,2048"
step sweep_qwen 200 python3 benchmarks/sweep_triton_values.py $L/sweep_qwen.json --models qwen3-30b-a3b --tokens 8192,16384 --fields "$F" --no-fused
step sweep_llama 150 python3 benchmarks/sweep_triton_values.py $L/sweep_llama.json --models llama4-scout --tokens 8192,16384 --fields "$F" --no-fused
step sweep_ds 200 python3 benchmarks/sweep_triton_values.py $L/sweep_ds.json --models deepseek-v3 --tokens 16384 --fields "128,256,64,F,8,3,1,bits,1024;128,256,64,F,8,3,1,bits,2048" --no-fused --budget-ms 5
tar czf $OUT/s22c2.tgz -C $L .
cat $L/steps.txt
grep -hE "gemm[12] " $L/sweep_*.log | awk '{print $1,$2,$3,$4,$5,$6}'
