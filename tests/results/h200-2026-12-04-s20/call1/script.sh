#!/bin/bash
# session 20 call 1: decode GEMM experiment (64-row CTAs with cluster split-K: tile codes 1008 = 4 per SM,
# 2008 = 5 per SM, 4008 = 16 stages 4 per SM), checked and swept at M = 1, 4, 16; Nsight Compute warp
# states of the current decode GEMMs (Qwen3 and Llama-4-Scout M = 1)
L=/tmp/s20c1; mkdir -p $L
source .carry/gpu/common.sh
env_record
save() { tar czf $OUT/s20c1.tgz -C $L .; }
B=.carry/exp/sm90_gemm_check; chmod +x $B
step chk 150 $B --no-bench
save
step splits 240 $B --bench-only --sweep-splits --tiles 8,1008,2008,4008 --shapes qwen,llama,deepseek --ms 1,4,16 --iters 10
save
NCU="ncu --clock-control none --cache-control all --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis -k regex:gemm_kernel --launch-count 1"
for sh in qwen llama; do
  step ncu_${sh}_w13 60 $NCU --launch-skip 0 $B --bench-only --shapes $sh --ms 1 --iters 1
  step ncu_${sh}_w2 60 $NCU --launch-skip 9 $B --bench-only --shapes $sh --ms 1 --iters 1
done
save
cat $L/steps.txt
tail -3 $L/chk.log
grep -E "^(qwen|ds|llama)" $L/splits.log
for f in $L/ncu_*.log; do echo "#### $f"; grep -E "gemm_kernel<|Duration|DRAM Throughput|Memory Throughput|Warp Cycles Per Issued|Issued Warp Per Scheduler|No Eligible|Active Warps Per Scheduler|Eligible Warps|Achieved Occupancy|Registers Per|Grid Size|Stall|stall" $f | head -40; done
