#!/bin/bash
# session 19 call 4: the landed build (9307573): benches with every peer,
# kernel timelines, GPU tests, compute-sanitizer on the fused kernel's tests
source .carry/gpu/common.sh
with_peers c4
step bench_qwen 170 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name qwen --commit 9307573
save
step bench_dsl 200 python3 -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --model deepseek-v3 --no-overhead --tokens 1,4,16,64,256,1024,4096 --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name dsl --commit 9307573
save
step timeline 60 python3 benchmarks/fusion_ab.py --backend cutlass --models llama4-scout --tokens 8,256 --rounds 1 --timeline
save
step pytest 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cutlass_sm90.py
save
for tool in memcheck racecheck; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 step san_$tool 80 compute-sanitizer --tool $tool --error-exitcode 9 --kernel-name regex:routing_quantize python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cutlass_sm90.py -k "fused_routing_quantize"
  save
done
cat $L/steps.txt
grep -A12 "### Whole forward" $L/res/qwen.md | grep -E "^\| [0-9]"
grep -A10 "### Whole forward" $L/res/dsl.md | grep -E "^\| [0-9]"
cat $L/timeline.log
tail -n 2 $L/pytest.log; for t in memcheck racecheck; do tail -n 3 $L/san_$t.log; done
