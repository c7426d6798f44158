set -u; source .carry/gpu/common.sh; L=/tmp/s34b; DEADLINE=300
C=$(cat .carry/gpu/commit)
export PYTHONPATH=.:/tmp/site
G=/tmp/gs; mkdir -p $G; for f in .carry/gs/*.so.xz; do xz -dc $f > $G/$(basename $f .xz); done
save(){ tar czf $OUT/s34b.tgz -C $L --exclude=triton-cache . ; }
env_record; mkdir -p $L/res
step routing_tests 40 env MOE_FP4_LIB=$G/libA16.so python3 -m pytest -q -p no:cacheprovider tests/test_cuda_pipeline.py -k "routing"
save
for r in 1 2; do for v in H R16 A16; do
step qwen_${v}_r$r 25 env MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model qwen3-30b-a3b --tokens 64,128,256,512,1024,2048 --name qwen-$v-r$r --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
done; done
save
for v in H A16; do
step deepseek_$v 25 env MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model deepseek-v3 --tokens 64,256,1024,2048 --name deepseek-$v --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
step llama_$v 25 env MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model llama4-scout --tokens 1024,4096,16384 --name llama-$v --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
done
save
cat $L/steps.txt
