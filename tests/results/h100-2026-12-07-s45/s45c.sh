# s45c: Nsight Compute on the two backends' GEMMs of one Llama-4-Scout forward at M = 64, where cutlass's second
# GEMM runs 1.17x a plain read of its weights and triton's 1.10x (s45b). Same sections as s39a's. Carry: .carry.
set -u; R=${RUN:-s45c}; L=/tmp/$R; DEADLINE=${DL:-150}; source .carry/gpu/common.sh
G=/tmp/gs; mkdir -p $G; xz -dc .carry/gs/libL.so.xz > $G/libL.so
export PYTHONPATH=. MOE_FP4_LIB=$G/libL.so
save(){ tar czf $OUT/$R.tgz -C $L . ; }
env_record
for b in cutlass triton; do
  step ncu_$b 60 /usr/local/cuda/bin/ncu --nvtx --nvtx-include forward/ -k regex:gemm_kernel --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats -o $L/ncu_$b -f python3 benchmarks/kernel_breakdown.py --ncu --backend $b \
    --model llama4-scout --tokens 64
  step ncu_${b}_details 20 /usr/local/cuda/bin/ncu --import $L/ncu_$b.ncu-rep --page details
  rm -f $L/ncu_$b.ncu-rep; save
done
cat $L/steps.txt
for b in cutlass triton; do grep -E "gemm_kernel|Duration|DRAM Throughput|Memory Throughput|Registers|Achieved Occupancy|Warp Cycles Per Issued|Issued Warp|No Eligible|Active Warps Per|Grid Size|Block Size|L2 Hit|Mem Busy|Max Bandwidth" $L/ncu_${b}_details.log | head -60; done
