#!/bin/bash
# session 17 call 2: interleaved tile sweep (2 rounds, best of), wide M range
source .carry/gpu/common.sh
env_record
chmod +x .carry/c1/sm90_gemm_check
T=64,3080,3180,3096,3196,3112,128,3128
step chk2 150 .carry/c1/sm90_gemm_check --no-bench
step sweep_qwen 200 .carry/c1/sm90_gemm_check --bench-only --sweep --rounds 2 --tiles $T --shapes qwen --ms 512,768,1024,1536,2048,4096,8192,16384
step sweep_llama 120 .carry/c1/sm90_gemm_check --bench-only --sweep --rounds 2 --tiles $T --shapes llama --ms 512,1024,2048,4096 --iters 10
step sweep_ds 200 .carry/c1/sm90_gemm_check --bench-only --sweep --rounds 2 --tiles $T --shapes deepseek --ms 1024,2048,4096 --iters 10
cat $OUT/steps.txt
tail -3 $OUT/chk2.log
grep -E "^(qwen|ds|llama)" $OUT/sweep_*.log
