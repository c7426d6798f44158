# s37b: the landed library whole: cutlass test files, memcheck, all three layers with every peer
set -u; source .carry/gpu/common.sh; L=/tmp/s37c; DEADLINE=${DL:-570}
C=$(cat .carry/gpu/commit); V=${V:-F}
G=/tmp/gs; mkdir -p $G; xz -dc .carry/gs/lib$V.so.xz > $G/libmoe_fp4_cuda.so
export PYTHONPATH=.:/tmp/site MOE_FP4_LIB=$G/libmoe_fp4_cuda.so
save(){ tar czf $OUT/s37c.tgz -C $L . ; }
env_record; mkdir -p $L/res
step pip 30 pip install --no-deps --no-index .peer/wheels/humming_kernels-0.1.19-cp310-abi3-manylinux_2_28_x86_64.whl --target /tmp/site
save
step qwen 100 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --name qwen --no-overhead --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --commit $C
save
step llama 65 python3 -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --name llama --no-overhead --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --commit $C
save
step deepseek 60 python3 -m moe_fp4 bench --backends cutlass,triton --model deepseek-v3 --tokens 1,4,16,64,256,1024,4096 --name deepseek --no-overhead --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --commit $C
save
save
cat $L/steps.txt
