#!/bin/bash
# session 18 call 3: where the decode forward's time goes, cutlass against triton (ncu, cold caches, clocks unlocked)
L=/tmp/c3; mkdir -p $L
OUT_REAL=$OUT; OUT=$L
source .carry/gpu/common.sh
env_record
export MOE_FP4_LIB=$PWD/.carry/s18/libmoe_fp4_cuda.so
for m in deepseek-v3 llama4-scout; do
  for b in cutlass triton; do
    step ncu_${m}_${b} 110 ncu --nvtx --nvtx-include "forward/" --clock-control none --cache-control all --section SpeedOfLight --section LaunchStats --section Occupancy python3 benchmarks/kernel_breakdown.py --ncu --backend $b --model $m --tokens 1,4
  done
  step prof_${m} 60 bash -c "python3 benchmarks/kernel_breakdown.py --backend cutlass --model $m --tokens 1,4; python3 benchmarks/kernel_breakdown.py --backend triton --model $m --tokens 1,4"
done
tar czf $OUT_REAL/c3.tgz -C $L .
cat $L/steps.txt
cat $L/prof_*.log
for f in $L/ncu_*.log; do echo "#### $f"; grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Grid Size|Block Size|Registers Per|Achieved Occupancy|Waves Per SM|==PROF==" $f | grep -v "^==PROF== Profiling" | head -120; done
