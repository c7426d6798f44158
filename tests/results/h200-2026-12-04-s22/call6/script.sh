#!/bin/bash
# session 22 call 6: the codes-operand Triton tests on the GPU (the GEMM kernel's in-loop body moved under
# the dense branch's else), and whether the Humming peer fails at Llama-4-Scout M = 8192 without any
# Triton kernel in the process (call 4's illegal memory access came at its first call).
source .carry/gpu/common.sh
with_peers s22c6
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so
C=${COMMIT:-unknown}
step pytest 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_stages.py tests/test_triton_moe.py
step humming 150 python3 -m moe_fp4 bench --backends cutlass --model llama4-scout --tokens 8192 --no-overhead --no-stages --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name humming --commit $C
save
cat $L/steps.txt
tail -3 $L/pytest.log
grep -E "ERROR|us \[" $L/humming.log | tr '\r' '\n' | grep -E "ERROR|us \[" | tail -6
