#!/bin/bash
# session 24's plan for the next device call (no device in session 24; benchmarks/README "Next (H200)"):
# the GPU exactness tests of sessions 23 and 24 (whole-block quantization, the top-k reduce fused with
# GEMM2's split-K reduce, FUSE_SILU = "split"), then the launch fusions' whole-forward A/B at decode.
# Then .carry/gpu/s23c1.sh (the --quant sweep) as the second call.
source .carry/gpu/common.sh
L=/tmp/s24c1; mkdir -p $L/res; env_record
export PYTHONPATH=.
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so
C=${COMMIT:-unknown}; echo "commit $C" >> $L/env.txt
step exact 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_numerics.py tests/test_triton_values.py tests/test_triton_stages.py tests/test_host_path.py -k "numerics or quantize or silu or fused_routing or halves or configs or topk_reduce or k_ranges or fuse_silu_split or plan"
step cuda 120 python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py -k "values or fused_routing or equals_reference"
step ab 220 python3 benchmarks/fusion_ab.py --models qwen3-30b-a3b,llama4-scout,deepseek-v3 --tokens 1,4,16 --rounds 3 --timeline --out $L/res/fusion-ab.json
tar czf $OUT/s24c1.tgz -C $L .
cat $L/steps.txt
tail -3 $L/exact.log $L/cuda.log
grep -v "^  " $L/ab.log | tail -12
