set -u; source .carry/gpu/common.sh; L=/tmp/s34c; DEADLINE=560
C=$(cat .carry/gpu/commit)
G=/tmp/gs; mkdir -p $G; xz -dc .carry/gs/libF.so.xz > $G/libF.so
export PYTHONPATH=.:/tmp/site MOE_FP4_LIB=$G/libF.so
save(){ tar czf $OUT/s34c.tgz -C $L --exclude=triton-cache . ; }
env_record; mkdir -p $L/res
step pip 30 pip install --no-deps --no-index .peer/wheels/humming_kernels-0.1.19-cp310-abi3-manylinux_2_28_x86_64.whl --target /tmp/site
step routing_tests 40 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_pipeline.py -k routing
step racecheck_routing 60 compute-sanitizer --tool racecheck --racecheck-report=analysis --error-exitcode=1 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_pipeline.py -k "routing and not 1.6M and not prefill and not 1031"
save
step cutlass 150 python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py tests/test_cuda_pipeline.py tests/test_sm90_restore.py
save
step qwen 100 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --name qwen --no-overhead --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --commit $C
save
step llama 55 python3 -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --name llama --no-overhead --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --commit $C
save
step memcheck 110 env SANITIZER_TOOLS=memcheck SANITIZER_TIMEOUT=100 PYTHON=python3 bash tests/run_sanitizer.sh $L/san
save
step deepseek 55 python3 -m moe_fp4 bench --backends cutlass,triton --model deepseek-v3 --tokens 1,4,16,64,256,1024,4096 --name deepseek --no-overhead --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --commit $C
save
cat $L/steps.txt
