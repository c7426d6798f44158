set -u; source .carry/gpu/common.sh; L=/tmp/s36b; DEADLINE=560
C=$(cat .carry/gpu/commit)
G=/tmp/gs; mkdir -p $G; for f in .carry/gs/*.xz; do xz -dc $f > $G/$(basename $f .xz); done; chmod +x $G/sm90_gemm_check
for v in F M MG; do mkdir -p $G/$v && cp $G/lib$v.so $G/$v/libmoe_fp4_cuda.so; done
# M, MG: the Python side without the rule that leaves the SiLU epilogue out beside a split second GEMM
T=/tmp/tm; rm -rf $T; mkdir -p $T; cp -r moe_fp4 $T/
sed -i 's/    return second_gemm is None or sm90_gemm_plan(slots, num_experts, \*second_gemm, device).gs_splits <= 1/    return True  # EXPERIMENT (session 36)/' $T/moe_fp4/backends/cutlass.py
grep -c EXPERIMENT $T/moe_fp4/backends/cutlass.py > /dev/null || echo "PATCH FAILED"
save(){ tar czf $OUT/s36b.tgz -C $L --exclude=triton-cache . ; }
env_record; mkdir -p $L/res
pp(){ case $1 in F) echo .;; *) echo $T;; esac; }
step check_M 80 env LD_LIBRARY_PATH=$G/M $G/sm90_gemm_check --no-bench
save
for r in 1 2; do
for v in F M MG; do
step llama_${v}_r$r 30 env PYTHONPATH=$(pp $v) MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model llama4-scout --tokens 1,2,4,8,16,24,32,64 --name llama-$v-r$r --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
done
for v in F M; do
step qwen_${v}_r$r 30 env PYTHONPATH=$(pp $v) MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model qwen3-30b-a3b --name qwen-$v-r$r --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
done; save; done
for v in F M; do
step deepseek_${v} 40 env PYTHONPATH=$(pp $v) MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model deepseek-v3 --tokens 1,4,16,64,256,1024 --name deepseek-$v --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
done; save
step tests_MG 170 env PYTHONPATH=$T MOE_FP4_LIB=$G/libMG.so python3 -m pytest -q -x tests/test_cutlass_sm90.py tests/test_cuda_pipeline.py tests/test_sm90_restore.py
save
step memcheck_M 50 env LD_LIBRARY_PATH=$G/M compute-sanitizer --tool memcheck --error-exitcode=1 $G/sm90_gemm_check --small
save
cat $L/steps.txt
