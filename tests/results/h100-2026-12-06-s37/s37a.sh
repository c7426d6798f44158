set -u; source .carry/gpu/common.sh; L=/tmp/s37a; DEADLINE=${DL:-560}
C=$(cat .carry/gpu/commit); export PYTHONPATH=.
G=/tmp/gs; mkdir -p $G; for f in .carry/gs/*.xz; do xz -dc $f > $G/$(basename $f .xz); done; chmod +x $G/sm90_gemm_check
for v in F DG DG4; do mkdir -p $G/$v && cp $G/lib$v.so $G/$v/libmoe_fp4_cuda.so; done
save(){ tar czf $OUT/s37a.tgz -C $L . ; }
env_record; mkdir -p $L/res
step newtest_F 60 env MOE_FP4_LIB=$G/libF.so python3 -m pytest -q -x tests/test_cutlass_sm90.py -k "second_gemm_split or second_gemm_splits"
step check_DG 80 env LD_LIBRARY_PATH=$G/DG $G/sm90_gemm_check --no-bench
step racecheck_DG 60 env LD_LIBRARY_PATH=$G/DG compute-sanitizer --tool racecheck --racecheck-report=analysis --error-exitcode=1 $G/sm90_gemm_check --small
step memcheck_DG 50 env LD_LIBRARY_PATH=$G/DG compute-sanitizer --tool memcheck --error-exitcode=1 $G/sm90_gemm_check --small
save
for v in F DG; do step sweep_$v 70 env LD_LIBRARY_PATH=$G/$v $G/sm90_gemm_check --bench-only --sweep-splits --shapes llama,deepseek --ms 4,16,64 --gs 2,4; done
save
for r in 1 2; do for v in F DG4; do
step llama_${v}_r$r 30 env MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model llama4-scout --tokens 1,2,4,8,16,24,32,64 --name llama-$v-r$r --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
done; save; done
cat $L/steps.txt
