set -u; source .carry/gpu/common.sh; L=/tmp/s36a; DEADLINE=575
C=$(cat .carry/gpu/commit)
export PYTHONPATH=.
G=/tmp/gs; mkdir -p $G; for f in .carry/gs/*.xz; do xz -dc $f > $G/$(basename $f .xz); done; chmod +x $G/sm90_gemm_check
for v in F Y X YG2 YG4; do mkdir -p $G/$v && cp $G/lib$v.so $G/$v/libmoe_fp4_cuda.so; done
save(){ tar czf $OUT/s36a.tgz -C $L --exclude=triton-cache . ; }
env_record; mkdir -p $L/res
step check_Y 90 env LD_LIBRARY_PATH=$G/Y $G/sm90_gemm_check --no-bench
save
step sweep_F 100 env LD_LIBRARY_PATH=$G/F $G/sm90_gemm_check --bench-only --sweep-splits --shapes all --ms 4,16,64 --gs 2,3,4,8
save
step sweep_Y 100 env LD_LIBRARY_PATH=$G/Y $G/sm90_gemm_check --bench-only --sweep-splits --shapes all --ms 4,16,64 --gs 2,3,4,8
save
step sweep_X 60 env LD_LIBRARY_PATH=$G/X $G/sm90_gemm_check --bench-only --sweep-splits --shapes llama,deepseek --ms 16,64 --gs 2,4
save
for r in 1 2; do for v in F Y YG2 YG4; do
step llama_${v}_r$r 30 env MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model llama4-scout --tokens 1,4,8,16,24,32,48,64 --name llama-$v-r$r --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
done; save; done
step tests_YG2 90 env MOE_FP4_LIB=$G/libYG2.so python3 -m pytest -q -x tests/test_cutlass_sm90.py -k "gs or split or workspace"
save
cat $L/steps.txt
