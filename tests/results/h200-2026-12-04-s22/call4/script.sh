#!/bin/bash
# session 22 call 4: the rest of call 3's test file (it stopped at 240 s with no failure, in the fp16
# half of the grid; e = 256 of both dtypes and the CUDA-graph replays, m = 4096 the dense GEMM's), then
# Llama-4-Scout and DeepSeek-V3 at M = 4096, 8192, 16384 with every peer (the dense GEMM from 8192).
source .carry/gpu/common.sh
with_peers s22c4
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so
C=${COMMIT:-unknown}
step pytest 110 python3 -m pytest -q -p no:cacheprovider tests/test_triton_values.py -k "e256 or cuda_graph"
step ld 420 python3 -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --model deepseek-v3 --tokens 4096,8192,16384 --no-overhead --no-stages --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name ld --commit $C
save
cat $L/steps.txt
tail -3 $L/pytest.log
grep -E "^## |^\| [0-9]+ \| [0-9]+ \|" $L/res/ld.md
grep -E "^\| [0-9]+ \| triton \|" $L/res/ld.md
