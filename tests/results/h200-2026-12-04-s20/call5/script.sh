#!/bin/bash
# session 20 call 5: the mend (a K below 40 chunks stays whole): whole forwards against 326d959 in
# alternating processes, the cutlass GPU tests on it, the Qwen3 bench with every peer
source .carry/gpu/common.sh
with_peers s20c5
for r in 1 2; do for v in s20 s20b; do
  MOE_FP4_LIB=$PWD/.carry/$v/libmoe_fp4_cuda.so step fwd_${v}_$r 90 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --model llama4-scout --model deepseek-v3 --tokens 1,4,16 --no-stages --no-overhead --budget-ms 20 --no-plot --out $L/res --name fwd_${v}_$r --commit $v
done; done
save
export MOE_FP4_LIB=$PWD/.carry/s20b/libmoe_fp4_cuda.so
step pytest 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cutlass_sm90.py
save
step bench_qwen 200 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name qwen --commit $COMMIT
save
cat $L/steps.txt
for f in $L/res/fwd_*.md; do echo "## $f"; grep -E "^\| [0-9]+ \| [0-9]+ \|" $f | cut -d'|' -f2,6,7; done
tail -n 2 $L/pytest.log
grep -A12 "### Whole forward" $L/res/qwen.md | grep -E "^\| [0-9]"
