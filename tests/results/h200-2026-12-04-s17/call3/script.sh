#!/bin/bash
# session 17 call 3: the 192-row tiles landed (lib m0 = the commit): checks, sanitizer, 112 4 vs 8 stages (m2), benches, GPU tests
source .carry/gpu/common.sh
env_record
COMMIT=${COMMIT:-unknown}
chmod +x .carry/c0/sm90_gemm_check .carry/c2/sm90_gemm_check
step chk 150 .carry/c0/sm90_gemm_check --no-bench
step race 120 compute-sanitizer --tool racecheck .carry/c0/sm90_gemm_check --small
step mem 90 compute-sanitizer --tool memcheck .carry/c0/sm90_gemm_check --small
step st112 100 .carry/c2/sm90_gemm_check --bench-only --sweep --rounds 2 --tiles 112,1112,96 --shapes qwen,llama --ms 1536,8192,16384 --iters 10
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peer/wheels/*.whl > $OUT/humming_install.log 2>&1
export PYTHONPATH=.:/tmp/site
export MOE_FP4_LIB=$PWD/.carry/m0/libmoe_fp4_cuda.so
mkdir -p $OUT/res
step bench_qwen 200 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $OUT/res --name qwen --commit $COMMIT
step bench_dsl 170 python3 -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --model deepseek-v3 --no-stages --no-overhead --tokens 1,4,16,64,256,1024,4096 --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $OUT/res --name dsl --commit $COMMIT
cat $OUT/steps.txt
tail -2 $OUT/chk.log; tail -3 $OUT/race.log; tail -3 $OUT/mem.log
grep -E "^(qwen|llama)" $OUT/st112.log
grep -A12 "### Whole forward" $OUT/res/qwen.md
grep -A12 "### Whole forward" $OUT/res/dsl.md | head -30
step grid 160 python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py -m gpu -k issue_grid
step suite 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cutlass_sm90.py tests/test_cuda_pipeline.py -k "not issue_grid"
cat $OUT/steps.txt | tail -2
tail -3 $OUT/grid.log; tail -3 $OUT/suite.log
