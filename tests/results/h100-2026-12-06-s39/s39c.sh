# s39c: the small token tiles' consumer loop unrolled by 2 instead of over the ring's 8 stages (R: every kernel;
# RN: the one-tile kernels only, the persistent ones keep the turn), against the landed library L: Nsight Compute's
# stall reasons on Qwen3's M = 1 GEMMs, whole forwards (cutlass only, two rounds in turns), the cutlass test files
# on the candidate.
set -u; L=/tmp/s39c; DEADLINE=${DL:-330}; source .carry/gpu/common.sh
C=$(cat .carry/gpu/commit)
G=/tmp/gs; mkdir -p $G; for v in L R RN; do xz -dc .carry/gs/lib$v.so.xz > $G/lib$v.so; done
export PYTHONPATH=.
save(){ tar czf $OUT/s39c.tgz -C $L . ; }
env_record; mkdir -p $L/res
B="python3 -m moe_fp4 bench --backends cutlass --no-overhead --budget-ms 20 --no-plot --out $L/res"
for v in L R; do
  step ncu_$v 40 env MOE_FP4_LIB=$G/lib$v.so /usr/local/cuda/bin/ncu --nvtx --nvtx-include forward/ -k regex:gemm_kernel --section SpeedOfLight --section WarpStateStats -o $L/ncu_$v -f python3 benchmarks/kernel_breakdown.py --ncu --backend cutlass --model qwen3-30b-a3b --tokens 1
  step ncu_raw_$v 20 bash -c "/usr/local/cuda/bin/ncu --import $L/ncu_$v.ncu-rep --page raw | grep -E 'gemm_kernel|stalled_.*per_issue_active|gpu__time_duration.sum|sm__cycles_active.avg |smsp__inst_executed.sum '"
done
rm -f $L/*.ncu-rep; save
round() { for v in L R RN; do
  step qwen_${v}_r$1 40 env MOE_FP4_LIB=$G/lib$v.so $B --model qwen3-30b-a3b --tokens 1,2,4,16,64,256 --name qwen-$v-r$1 --commit $C-$v
  step llama_${v}_r$1 40 env MOE_FP4_LIB=$G/lib$v.so $B --model llama4-scout --tokens 1,4,16,64 --name llama-$v-r$1 --commit $C-$v
  step ds_${v}_r$1 40 env MOE_FP4_LIB=$G/lib$v.so $B --model deepseek-v3 --tokens 1,4,16 --name ds-$v-r$1 --commit $C-$v
done; save; }
round 1
step tests_R 170 env MOE_FP4_LIB=$G/libR.so python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py tests/test_cuda_pipeline.py tests/test_sm90_restore.py
save
round 2
cat $L/steps.txt
