#!/bin/bash
# session 21 call 1: split K through global memory (GS) for the persistent 8- and 16-token tiles
# (experiment): checked (random cases incl. GS), swept against the cluster splits at M = 1..64,
# whole-forward A/B (MOE_FP4_SM90_GS=0/1) in turns.
L=/tmp/s21c1; mkdir -p $L/res
source .carry/gpu/common.sh
env_record
save() { tar czf $OUT/s21c1.tgz -C $L .; }
B=.carry/gs/sm90_gemm_check; chmod +x $B
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so PYTHONPATH=.
step chk 170 $B --no-bench
save
step splits 200 $B --bench-only --sweep-splits --tiles 8,16 --gs 2,3,4,6,8,12 --shapes qwen,llama,deepseek --ms 1,4,16,64 --iters 10
save
for r in 1 2; do
  for g in 0 1; do
    MOE_FP4_SM90_GS=$g step fwd_g${g}_r$r 120 python3 -m moe_fp4 bench --backends cutlass --model llama4-scout --model qwen3-30b-a3b --model deepseek-v3 --no-stages --no-overhead --tokens 1,4,16,64 --budget-ms 20 --no-plot --out $L/res --name g${g}_r$r --commit gs-exp
  done
  save
done
cat $L/steps.txt
tail -3 $L/chk.log
grep -E "^(qwen|ds|llama)" $L/splits.log | sed 's/1008.*//' 
for f in $L/res/*.md; do echo "## $f"; grep -E "^\| [0-9]+ \| [0-9]+ \|" $f; done
