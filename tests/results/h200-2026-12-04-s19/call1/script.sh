#!/bin/bash
# session 19 call 1: fused routing + quantization and the pre-wait prologues (tree 6f97014 + hoists), GPU tests, A/B bench against 51a0060
L=/tmp/c1; mkdir -p $L/res
source .carry/gpu/common.sh
env_record
export PYTHONPATH=.
NEW=$PWD/.carry/s19/libmoe_fp4_cuda.so BASE=$PWD/.carry/base/libmoe_fp4_cuda.so
export MOE_FP4_LIB=$NEW
step pytest_new 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cutlass_sm90.py -k "fused_routing or decode_plans or graph"
step pytest_pipe 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_pipeline.py
B="python3 -m moe_fp4 bench --backends cutlass,triton --no-overhead --tokens 1,4,16,64,256 --budget-ms 20 --no-plot --out $L/res"
for r in 1 2; do
  (cd .carry/basetree && PYTHONPATH=. MOE_FP4_LIB=$BASE step ab_base_$r 100 $B --name base$r --commit 51a0060)
  MOE_FP4_LIB=$NEW step ab_new_$r 100 $B --name new$r --commit s19-call1
done
step pytest_grid 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cutlass_sm90.py -k "not fused_routing and not decode_plans"
tar czf $OUT/c1.tgz -C $L .
cat $L/steps.txt
tail -3 $L/pytest_new.log $L/pytest_pipe.log $L/pytest_grid.log
for f in base1 new1 base2 new2; do echo "== $f"; grep -A8 "### Whole forward" $L/res/$f.md | grep -E "^\| [0-9]"; done
