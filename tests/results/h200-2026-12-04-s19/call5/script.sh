#!/bin/bash
# session 19 call 5: the fused routing with the bitonic sort (0bf215c): GPU tests, compute-sanitizer on
# its tests, old (9307573) vs new fused kernel in one A/B per layer, benches with every peer
source .carry/gpu/common.sh
with_peers c5
step pytest 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cutlass_sm90.py
save
for tool in memcheck racecheck; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 step san_$tool 70 compute-sanitizer --tool $tool --error-exitcode 9 --kernel-name kns=routing_quantize python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cutlass_sm90.py -k "fused_routing_quantize"
  save
done
for lib in s19old s19; do
  MOE_FP4_LIB=$PWD/.carry/$lib/libmoe_fp4_cuda.so step ab_$lib 60 python3 benchmarks/fusion_ab.py --backend cutlass --models qwen3-30b-a3b,llama4-scout,deepseek-v3 --tokens 1,8,16,32,256 --rounds 2 --out $L/ab_$lib.json
done
save
step bench_qwen 170 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name qwen --commit 0bf215c
save
step bench_dsl 200 python3 -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --model deepseek-v3 --no-overhead --tokens 1,4,16,64,256,1024,4096 --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name dsl --commit 0bf215c
save
cat $L/steps.txt
tail -n 2 $L/pytest.log; for t in memcheck racecheck; do grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" $L/san_$t.log | tail -3; done
grep "M=" $L/ab_s19old.log $L/ab_s19.log
grep -A12 "### Whole forward" $L/res/qwen.md | grep -E "^\| [0-9]"
grep -A10 "### Whole forward" $L/res/dsl.md | grep -E "^\| [0-9]"
