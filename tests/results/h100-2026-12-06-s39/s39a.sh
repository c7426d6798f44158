# s39a: the landed library (ba25f14, built 90a-only on the CPU machine, carried as .carry/gs/libL.so.xz) whole:
# all three layers with every peer (the run that decides `auto` on 9.x), the cutlass test files, memcheck of the
# sanitizer workload, memcheck and racecheck on the tail split's GPU tests, a second round of the close points
# (Llama-4-Scout M = 1, 16, 64, cutlass and triton), Nsight Compute on the M = 1 GEMMs (Qwen3, Llama-4-Scout).
set -u; L=/tmp/s39a; DEADLINE=${DL:-540}; source .carry/gpu/common.sh
C=$(cat .carry/gpu/commit)
G=/tmp/gs; mkdir -p $G; xz -dc .carry/gs/libL.so.xz > $G/libmoe_fp4_cuda.so
export PYTHONPATH=.:/tmp/site MOE_FP4_LIB=$G/libmoe_fp4_cuda.so
save(){ tar czf $OUT/s39a.tgz -C $L . ; }
env_record; mkdir -p $L/res
P="--peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer"
B="python3 -m moe_fp4 bench --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C"
step pip 30 pip install --no-deps --no-index .peer/wheels/humming_kernels-0.1.19-cp310-abi3-manylinux_2_28_x86_64.whl --target /tmp/site
step qwen 100 $B --backends cutlass,triton --model qwen3-30b-a3b --name qwen $P
save
step llama 70 $B --backends cutlass,triton --model llama4-scout --name llama $P
save
step deepseek 70 $B --backends cutlass,triton --model deepseek-v3 --tokens 1,4,16,64,256,1024,4096 --name deepseek $P
save
step cutlass 170 python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py tests/test_cuda_pipeline.py tests/test_sm90_restore.py
save
for tool in memcheck racecheck; do
  step tail_$tool 60 compute-sanitizer --tool $tool --error-exitcode=1 python3 -m pytest -q -p no:cacheprovider \
    tests/test_cutlass_sm90.py -k "tail_split_within and (11 or 13)"
done
save
step llama_r2 40 $B --backends cutlass,triton --model llama4-scout --tokens 1,16,64 --name llama-r2
save
step memcheck 100 env SANITIZER_TOOLS=memcheck SANITIZER_TIMEOUT=90 PYTHON=python3 bash tests/run_sanitizer.sh $L/san
save
step ncu 60 /usr/local/cuda/bin/ncu --nvtx --nvtx-include forward/ -k regex:gemm_kernel --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats -o $L/ncu -f python3 benchmarks/kernel_breakdown.py --ncu --backend cutlass --model qwen3-30b-a3b --tokens 1
step ncu_details 20 /usr/local/cuda/bin/ncu --import $L/ncu.ncu-rep --page details
step ncu_llama 60 /usr/local/cuda/bin/ncu --nvtx --nvtx-include forward/ -k regex:gemm_kernel --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy -o $L/ncul -f python3 benchmarks/kernel_breakdown.py --ncu --backend cutlass --model llama4-scout --tokens 1
step ncu_llama_details 20 /usr/local/cuda/bin/ncu --import $L/ncul.ncu-rep --page details
rm -f $L/ncu.ncu-rep $L/ncul.ncu-rep
save
cat $L/steps.txt
