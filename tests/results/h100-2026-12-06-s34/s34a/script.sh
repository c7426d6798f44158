set -u; source .carry/gpu/common.sh; L=/tmp/s34a; DEADLINE=585
C=$(cat .carry/gpu/commit)
export PYTHONPATH=.:/tmp/site
G=/tmp/gs; mkdir -p $G; for f in .carry/gs/*.so.xz; do xz -dc $f > $G/$(basename $f .xz); done
save(){ tar czf $OUT/s34a.tgz -C $L --exclude=triton-cache . ; }
env_record; mkdir -p $L/res
step pip 30 pip install --no-deps --no-index .peer/wheels/humming_kernels-0.1.19-cp310-abi3-manylinux_2_28_x86_64.whl --target /tmp/site
step routing_tests 60 env MOE_FP4_LIB=$G/libR16.so python3 -m pytest -q -p no:cacheprovider tests/test_cuda_pipeline.py -k "routing"
save
for r in 1 2; do for v in H R16 R64; do
step qwen_${v}_r$r 30 env MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model qwen3-30b-a3b --tokens 64,128,256,512,1024,2048,4096,8192 --name qwen-$v-r$r --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
done; done
save
for v in H R16 R64; do
step deepseek_$v 30 env MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model deepseek-v3 --tokens 64,256,1024,2048 --name deepseek-$v --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
step llama_$v 30 env MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model llama4-scout --tokens 1024,4096,16384 --name llama-$v --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
done
save
step fusion_llama 60 env PYTHONPATH=.carry/base_py:/tmp/site MOE_FP4_LIB=$G/libR16.so python3 -P benchmarks/fusion_ab.py --backend cutlass --models llama4-scout --tokens 1,2,3,4,8 --rounds 2 --out $L/res/fusion_llama.json
save
step timeline 30 env MOE_FP4_LIB=$G/libR16.so python3 benchmarks/fusion_ab.py --backend cutlass --models qwen3-30b-a3b --tokens 64,256,1024 --rounds 1 --timeline --out $L/res/timeline.json
save
step cutlass 170 env MOE_FP4_LIB=$G/libR16.so python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py tests/test_cuda_pipeline.py tests/test_sm90_restore.py
save
step memcheck 150 env MOE_FP4_LIB=$G/libR16.so SANITIZER_TOOLS=memcheck SANITIZER_TIMEOUT=140 PYTHON=python3 bash tests/run_sanitizer.sh $L/san
save
cat $L/steps.txt
