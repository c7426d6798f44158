#!/bin/bash
# session 17 call 4: the committed build (m3): checks, sanitizer, grid, benches; everything tarred into one file
L=/tmp/c4; mkdir -p $L $L/res
OUT_REAL=$OUT; OUT=$L
source .carry/gpu/common.sh
env_record
COMMIT=${COMMIT:-unknown}
chmod +x .carry/c3/sm90_gemm_check
step chk 150 .carry/c3/sm90_gemm_check --no-bench
step race 120 compute-sanitizer --tool racecheck .carry/c3/sm90_gemm_check --small
step mem 90 compute-sanitizer --tool memcheck .carry/c3/sm90_gemm_check --small
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peer/wheels/*.whl > $L/humming_install.log 2>&1
export PYTHONPATH=.:/tmp/site
export MOE_FP4_LIB=$PWD/.carry/m3/libmoe_fp4_cuda.so
step bench_qwen 200 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name qwen --commit $COMMIT
step bench_dsl 170 python3 -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --model deepseek-v3 --no-stages --no-overhead --tokens 1,4,16,64,256,1024,4096 --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name dsl --commit $COMMIT
step grid 160 python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py -m gpu -k issue_grid
tar czf $OUT_REAL/c4.tgz -C $L .
cat $L/steps.txt
tail -2 $L/chk.log; tail -2 $L/race.log; tail -1 $L/mem.log; tail -2 $L/grid.log
grep -A12 "### Whole forward" $L/res/qwen.md
grep -A12 "### Stages of the cutlass" $L/res/qwen.md
grep -A12 "### Whole forward" $L/res/dsl.md | head -30
