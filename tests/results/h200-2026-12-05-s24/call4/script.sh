#!/bin/bash
# session 24, call 4: the three layers' benchmark with every peer (QUANT_VALUES_CONFIGS, FUSE_TOPK_REDUCE on)
source .carry/gpu/common.sh
with_peers s24c4
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so
C=${COMMIT:-unknown}; echo "commit $C" >> $L/env.txt
P="--budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --commit $C"
step qwen 200 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --tokens 1,4,16,64,256,1024,4096,8192,16384 --name qwen $P
step llama 150 python3 -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --tokens 1,4,16,64,256,4096 --no-overhead --name llama $P
step deepseek 200 python3 -m moe_fp4 bench --backends cutlass,triton --model deepseek-v3 --tokens 1,4,16,64,256,1024,4096 --no-overhead --name deepseek $P
save
cat $L/steps.txt
for n in qwen llama deepseek; do grep -A14 "Whole forward" $L/res/$n*.md | head -14; done
