#!/bin/bash
# session 19 call 3: experiment E (the values quantization kernels allow no early launch of the GEMM
# after them) against the landed tree (s19): fused / unfused decode A/B and whole forwards to M = 16384
L=/tmp/c3; mkdir -p $L/res
source .carry/gpu/common.sh
env_record
export PYTHONPATH=.
for lib in s19 expE; do
  export MOE_FP4_LIB=$PWD/.carry/$lib/libmoe_fp4_cuda.so
  step ab_${lib}_qwen 120 python3 benchmarks/fusion_ab.py --backend cutlass --models qwen3-30b-a3b --tokens 1,4,8,16,32 --rounds 3 --out $L/ab_${lib}_qwen.json
  step ab_${lib}_llama 150 python3 benchmarks/fusion_ab.py --backend cutlass --models llama4-scout --tokens 1,4,8,16,32,128,256 --rounds 3 --out $L/ab_${lib}_llama.json
  step ab_${lib}_ds 150 python3 benchmarks/fusion_ab.py --backend cutlass --models deepseek-v3 --tokens 1,4,8,32 --rounds 3 --out $L/ab_${lib}_ds.json
done
B="python3 -m moe_fp4 bench --backends cutlass --no-overhead --no-stages --tokens 64,256,1024,4096,16384 --budget-ms 20 --no-plot --out $L/res"
for r in 1 2; do
  for lib in s19 expE; do
    MOE_FP4_LIB=$PWD/.carry/$lib/libmoe_fp4_cuda.so step big_${lib}_$r 150 $B --name ${lib}_$r --commit $lib
  done
done
tar czf $OUT/c3.tgz -C $L .
cat $L/steps.txt
for f in $L/ab_*.log; do echo "== $f"; grep -E "M=" $f; done
for r in 1 2; do for lib in s19 expE; do echo "== $lib $r"; grep -A8 "### Whole forward" $L/res/${lib}_$r.md | grep -E "^\| [0-9]" | awk -F'|' '{printf "%s:%s ", $2, $6}'; echo; done; done
