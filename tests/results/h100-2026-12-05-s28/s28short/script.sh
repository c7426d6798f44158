#!/bin/bash
# session 28, a short call for what is left of the device time: the Triton W4A16 GPU tests, then Qwen3 with every peer.
source .carry/gpu/common.sh
L=/tmp/s28short; mkdir -p $L/res; env_record; cp $0 $L/script.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peer/wheels/*.whl > $L/humming_install.log 2>&1
export PYTHONPATH=.:/tmp/site
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so
C=${COMMIT:-unknown}; echo "commit $C" >> $L/env.txt
save() { tar czf $OUT/s28short.tgz -C $L .; }
step w4a16 100 python3 -m pytest -q -p no:cacheprovider tests/test_triton_w4a16.py tests/test_precision.py
save
P="--budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --commit $C"
step qwen 125 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --tokens 1,4,16,64,256,1024,4096,16384 --no-overhead --name qwen $P
save
cat $L/steps.txt
tail -2 $L/w4a16.log
grep -A12 "Whole forward" $L/res/qwen.md | tail -10
