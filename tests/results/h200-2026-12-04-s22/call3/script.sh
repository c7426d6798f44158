#!/bin/bash
# session 22 call 3: the table with the dense GEMM past 256 rows per expert (DENSE_FROM): the values
# path's GPU tests (the 640-case grid: its e = 8 cases at m = 1024 with top-6 and top-8 take the dense
# GEMM; CUDA-graph replay at m = 4096), then Qwen3 M = 1 .. 16384 (and 8192) with every peer.
source .carry/gpu/common.sh
with_peers s22c3
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so
C=${COMMIT:-unknown}
step pytest 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_values.py
step qwen 300 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --tokens 1,4,16,64,256,1024,4096,8192,16384 --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name qwen --commit $C
save
cat $L/steps.txt
tail -3 $L/pytest.log
grep -E "^\| [0-9]+ \| [0-9]+ \|" $L/res/qwen.md
grep -E "^\| [0-9]+ \| triton \|" $L/res/qwen.md | tail -12
