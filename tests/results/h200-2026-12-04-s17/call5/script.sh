#!/bin/bash
# session 17 call 5: the 48-token tile on 192-row CTAs (m4 = the tree, c5/m5 = + experiment codes 2048, 2032)
L=/tmp/c5; mkdir -p $L $L/res
OUT_REAL=$OUT; OUT=$L
source .carry/gpu/common.sh
env_record
COMMIT=${COMMIT:-unknown}
chmod +x .carry/c4/sm90_gemm_check .carry/c5/sm90_gemm_check
step chk 120 .carry/c4/sm90_gemm_check --no-bench
step sweep 110 .carry/c5/sm90_gemm_check --bench-only --sweep --rounds 2 --tiles 32,2032,48,2048,64,80 --shapes qwen,llama,deepseek --ms 256,512,768,1024 --iters 10
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peer/wheels/*.whl > $L/humming_install.log 2>&1
export PYTHONPATH=.:/tmp/site
export MOE_FP4_LIB=$PWD/.carry/m4/libmoe_fp4_cuda.so
step bench 110 python3 -m moe_fp4 bench --backends cutlass --model qwen3-30b-a3b --model deepseek-v3 --tokens 512,1024 --no-stages --no-overhead --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name c5 --commit $COMMIT
tar czf $OUT_REAL/c5.tgz -C $L .
cat $L/steps.txt
tail -2 $L/chk.log
grep -E "^(qwen|ds|llama)" $L/sweep.log
grep -B2 -A8 "### Whole forward" $L/res/c5.md
