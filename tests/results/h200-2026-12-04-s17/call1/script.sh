#!/bin/bash
# session 17 call 1: new CTA shapes (WG=3/4, 80/96 tokens): check + sweep
source .carry/gpu/common.sh
env_record
chmod +x .carry/c1/sm90_gemm_check
step chk1 150 .carry/c1/sm90_gemm_check --no-bench
step sweep_qwen 200 .carry/c1/sm90_gemm_check --bench-only --sweep --shapes qwen --ms 64,256,1024,4096,16384
step sweep_dsl 230 .carry/c1/sm90_gemm_check --bench-only --sweep --shapes deepseek,llama --ms 256,1024,4096 --iters 10
cat $OUT/steps.txt
tail -5 $OUT/chk1.log
cat $OUT/sweep_qwen.log
cat $OUT/sweep_dsl.log
