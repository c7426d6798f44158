#!/bin/bash
# session 19 call 2: in-process A/B of the fused routing (cutlass plans, fused vs unfused) with the
# landed design (no early trigger) and experiment D (trigger after the routing writes + fence)
L=/tmp/c2; mkdir -p $L
source .carry/gpu/common.sh
env_record
export PYTHONPATH=.
for lib in s19 expD; do
  export MOE_FP4_LIB=$PWD/.carry/$lib/libmoe_fp4_cuda.so
  step ab_${lib}_qwen 120 python3 benchmarks/fusion_ab.py --backend cutlass --models qwen3-30b-a3b --tokens 1,2,4,8,16,32 --rounds 3 --out $L/ab_${lib}_qwen.json
  step ab_${lib}_llama 150 python3 benchmarks/fusion_ab.py --backend cutlass --models llama4-scout --tokens 1,2,4,8,16,32,64,128,256 --rounds 3 --out $L/ab_${lib}_llama.json
  step ab_${lib}_ds 150 python3 benchmarks/fusion_ab.py --backend cutlass --models deepseek-v3 --tokens 1,2,4,8,16,32 --rounds 3 --out $L/ab_${lib}_ds.json
done
tar czf $OUT/c2.tgz -C $L .
cat $L/steps.txt
for f in $L/ab_*.log; do echo "== $f"; grep -E "M=" $f; tail -n 2 $f | grep -i error; done
