set -u; source .carry/gpu/common.sh; L=/tmp/s34d; DEADLINE=200
C=$(cat .carry/gpu/commit)
export PYTHONPATH=.:/tmp/site
G=/tmp/gs; mkdir -p $G; for f in .carry/gs/*.so.xz; do xz -dc $f > $G/$(basename $f .xz); done
save(){ tar czf $OUT/s34d.tgz -C $L --exclude=triton-cache . ; }
env_record; mkdir -p $L/res
for r in 1 2; do for v in F G; do
step llama_${v}_r$r 25 env MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model llama4-scout --tokens 8,16,24,32,48,64 --name llama-$v-r$r --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
done; done
save
for v in F G; do
step deepseek_$v 25 env MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model deepseek-v3 --tokens 1,2,3,4 --name deepseek-$v --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
done
save
cat $L/steps.txt
