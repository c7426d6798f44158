#!/bin/bash
# session 20 call 4: the landed build with every peer: Qwen3 (stages, eager overhead) and
# Llama-4-Scout / DeepSeek-V3
source .carry/gpu/common.sh
with_peers s20c4
export MOE_FP4_LIB=$PWD/.carry/s20/libmoe_fp4_cuda.so
C=${COMMIT:-s20}
step bench_qwen 200 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name qwen --commit $C
save
step bench_dsl 220 python3 -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --model deepseek-v3 --no-overhead --tokens 1,4,16,64,256,1024,4096 --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name dsl --commit $C
save
cat $L/steps.txt
grep -A12 "### Whole forward" $L/res/qwen.md | grep -E "^\| [0-9]"
grep -A10 "### Whole forward" $L/res/dsl.md | grep -E "^\| [0-9]"
