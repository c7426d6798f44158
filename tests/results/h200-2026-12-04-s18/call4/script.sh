#!/bin/bash
# session 18 call 4: experiment build (57a243c + tile codes 1008 / 1016 = 8 / 16 tokens on persistent 64-row CTAs, 4 per SM;
# 3008 = 8 tokens on persistent CTAs of 2 warpgroups x 64 rows, 2 per SM), checked and swept at decode
L=/tmp/c4; mkdir -p $L
OUT_REAL=$OUT; OUT=$L
source .carry/gpu/common.sh
env_record
B=.carry/exp/sm90_gemm_check; chmod +x $B
step chk 150 $B --no-bench
step sweep 200 $B --bench-only --sweep --rounds 2 --tiles 8,1008,3008,16,1016 --shapes qwen,llama,deepseek --ms 1,4,16,64 --iters 10
tar czf $OUT_REAL/c4.tgz -C $L .
cat $L/steps.txt
tail -2 $L/chk.log
grep -E "^(qwen|ds|llama)" $L/sweep.log
