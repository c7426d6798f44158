#!/bin/bash
# session 22 call 5: call 4's bench stopped at Llama-4-Scout M = 8192 on an illegal memory access at the
# Humming peer's first call (after the triton and Marlin rows had passed their checks after timing); the
# same layers without Humming: Llama-4-Scout M = 8192, 16384, DeepSeek-V3 M = 4096, 8192, 16384.
L=/tmp/s22c5; mkdir -p $L/res
source .carry/gpu/common.sh
env_record
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so PYTHONPATH=.
C=${COMMIT:-unknown}
step ld 450 python3 -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --model deepseek-v3 --tokens 8192,16384 --no-overhead --no-stages --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name ld --commit $C
tar czf $OUT/s22c5.tgz -C $L .
cat $L/steps.txt
grep -E "^## |^\| [0-9]+ \| [0-9]+ \|" $L/res/ld.md
grep -E "^\| [0-9]+ \| triton \|" $L/res/ld.md
