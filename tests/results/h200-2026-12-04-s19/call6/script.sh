#!/bin/bash
# session 19 call 6: the review mend (the values kernels wait before staging the offsets again; the
# fused entry writes the offsets for 0 slots too): its GPU tests, and its whole forward against call 5's library
L=/tmp/c6; mkdir -p $L/res
source .carry/gpu/common.sh
env_record
export PYTHONPATH=. MOE_FP4_LIB=$PWD/.carry/s19/libmoe_fp4_cuda.so
save() { tar czf $OUT/c6.tgz -C $L .; }
step pytest 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_pipeline.py tests/test_cutlass_sm90.py -k "not grid and not equals_reference"
save
B="python3 -m moe_fp4 bench --backends cutlass --no-overhead --no-stages --model qwen3-30b-a3b --model llama4-scout --tokens 1,16,64,256,1024 --budget-ms 20 --no-plot --out $L/res"
for lib in s19c5 s19; do MOE_FP4_LIB=$PWD/.carry/$lib/libmoe_fp4_cuda.so step bench_$lib 60 $B --name $lib --commit $lib; done
save
cat $L/steps.txt; tail -n 2 $L/pytest.log
for lib in s19c5 s19; do echo "== $lib"; grep -A8 "### Whole forward" $L/res/$lib.md | grep -E "^\| [0-9]" | awk -F'|' '{printf "%s:%s ", $2, $6}'; echo; done
