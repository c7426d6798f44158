#!/bin/bash
# session 25, call 3: the three layers' benchmark with every peer (the long-K split at decode, the SiLU
# table's 2 x 256 row), the SiLU rows past 4096 slots on Qwen3, the GPU tests of this session's changes
source .carry/gpu/common.sh
L=$OUT/s25c3; mkdir -p $L/res; env_record
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peer/wheels/*.whl > $L/humming_install.log 2>&1
export PYTHONPATH=.:/tmp/site
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so
C=${COMMIT:-unknown}; echo "commit $C" >> $L/env.txt
P="--budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --commit $C"
step qwen 170 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --tokens 1,4,16,64,256,1024,4096,8192,16384 --name qwen $P
step llama 90 python3 -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --tokens 1,4,16,64,256,4096 --no-overhead --name llama $P
step deepseek 110 python3 -m moe_fp4 bench --backends cutlass,triton --model deepseek-v3 --tokens 1,4,16,64,256,1024,4096 --no-overhead --name deepseek $P
step quant 45 python3 benchmarks/sweep_triton_values.py $L/res/quant-qwen-prefill.json --quant --models qwen3-30b-a3b --tokens 4096,16384 --budget-ms 5 --fields "2,256,1,1024,T;4,256,2,1024,T;8,256,2,1024,T"
step ab_route 70 python3 benchmarks/fusion_ab.py --models qwen3-30b-a3b,deepseek-v3 --tokens 16,32 --variants topk --fused-routing-max 256 --rounds 3 --out $L/res/ab-route.json
step tests 80 python3 -m pytest -q -p no:cacheprovider tests/test_triton_values.py tests/test_host_path.py -k "long_k or narrow_tile or whole or plan_adds or triton_plan_equals"
cat $L/steps.txt
for n in qwen llama deepseek; do grep -A14 "Whole forward" $L/res/$n*.md | head -14; done
grep -A10 "best per" $L/quant.log | grep silu
cat $L/ab_route.log | grep -v "^\s*$"
tail -2 $L/tests.log
