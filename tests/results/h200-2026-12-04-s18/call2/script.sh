#!/bin/bash
# session 18 call 2: the committed build (3edd233: 48-token tile + decode plans): check, GPU tests, benches with every peer
L=/tmp/c2; mkdir -p $L $L/res
OUT_REAL=$OUT; OUT=$L
source .carry/gpu/common.sh
env_record
COMMIT=${COMMIT:-unknown}
B=.carry/s18/sm90_gemm_check; chmod +x $B
export MOE_FP4_LIB=$PWD/.carry/s18/libmoe_fp4_cuda.so
step chk 150 $B --no-bench
step pytest 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cutlass_sm90.py
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peer/wheels/*.whl > $L/humming_install.log 2>&1
export PYTHONPATH=.:/tmp/site
step bench_qwen 200 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name qwen --commit $COMMIT
step bench_dsl 240 python3 -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --model deepseek-v3 --no-overhead --tokens 1,4,16,64,256,1024,4096 --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name dsl --commit $COMMIT
tar czf $OUT_REAL/c2.tgz -C $L .
cat $L/steps.txt
tail -2 $L/chk.log; tail -3 $L/pytest.log
grep -A12 "### Whole forward" $L/res/qwen.md
grep -A12 "### Stages of the cutlass" $L/res/qwen.md
grep -A12 "### Whole forward" $L/res/dsl.md | head -30
grep -A12 "### Stages of the" $L/res/dsl.md | head -60
