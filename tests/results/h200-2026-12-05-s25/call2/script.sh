#!/bin/bash
# session 25, call 2: the long-K split in whole forwards (fusion_ab short-k against the default), and the
# 256-column whole-block SiLU rows on Llama-4-Scout, DeepSeek-V3 and Qwen3's prefill
source .carry/gpu/common.sh
L=$OUT/s25c2; mkdir -p $L/res; env_record
export PYTHONPATH=.
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so
echo "commit ${COMMIT:-unknown}" >> $L/env.txt
step ab_llama 130 python3 benchmarks/fusion_ab.py --models llama4-scout --tokens 1,4,16,64,128 --variants topk,short-k,prefetch --rounds 3 --out $L/res/ab-llama.json
step ab_ds 110 python3 benchmarks/fusion_ab.py --models deepseek-v3 --tokens 1,4 --variants topk,short-k,prefetch --rounds 3 --out $L/res/ab-deepseek.json
step ab_qwen 100 python3 benchmarks/fusion_ab.py --models qwen3-30b-a3b --tokens 1,4,16,64,256 --variants topk,prefetch --rounds 3 --out $L/res/ab-qwen.json
step quant 100 python3 benchmarks/sweep_triton_values.py $L/res/quant.json --quant --models llama4-scout,deepseek-v3 --tokens 256,1024 --budget-ms 5 --fields "1,512,1,1024,T;2,256,1,1024,T;4,256,2,1024,T;8,256,2,1024,T;2,512,1,1024,T"
step tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_triton_stages.py tests/test_host_path.py tests/test_triton_values.py -k "topk_reduce or k_ranges or narrow_tile or long_k or plan_adds" -x
cat $L/steps.txt
cat $L/ab_llama.log $L/ab_ds.log $L/ab_qwen.log | grep -v "^\s*$" | tail -12
grep -A40 "best per" $L/quant.log | grep silu
tail -3 $L/tests.log
