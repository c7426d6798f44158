#!/bin/bash
# session 20 call 2: the tight token-tile bound (min(old bound, a_rows): no CTA past the last possible
# tile) A/B against call 1's library: GEMM check, decode sweeps, Nsight Compute SM activity, whole forwards
L=/tmp/s20c2; mkdir -p $L/res
source .carry/gpu/common.sh
env_record
save() { tar czf $OUT/s20c2.tgz -C $L .; }
chmod +x .carry/exp/sm90_gemm_check .carry/exp2/sm90_gemm_check
step chk2 150 .carry/exp2/sm90_gemm_check --no-bench
save
for r in 1 2; do for v in exp exp2; do
  step splits_${v}_$r 120 .carry/$v/sm90_gemm_check --bench-only --sweep-splits --tiles 8,1008 --shapes qwen,llama,deepseek --ms 1,4,16 --iters 10
done; done
save
NCU="ncu --clock-control none --cache-control all --section SpeedOfLight --section LaunchStats -k regex:gemm_kernel --launch-count 1"
step ncu2_llama_w13 60 $NCU --launch-skip 0 .carry/exp2/sm90_gemm_check --bench-only --shapes llama --ms 1 --iters 1
step ncu2_llama_w2 60 $NCU --launch-skip 9 .carry/exp2/sm90_gemm_check --bench-only --shapes llama --ms 1 --iters 1
save
export PYTHONPATH=.
for r in 1 2; do for v in exp exp2; do
  MOE_FP4_LIB=$PWD/.carry/$v/libmoe_fp4_cuda.so step fwd_${v}_$r 90 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --model llama4-scout --model deepseek-v3 --tokens 1,4,16 --no-stages --no-overhead --budget-ms 20 --no-plot --out $L/res --name fwd_${v}_$r --commit exp
done; done
save
cat $L/steps.txt
tail -2 $L/chk2.log
for f in $L/splits_*.log; do echo "## $f"; grep -E "^(qwen|ds|llama)" $f | awk '{print $1, $2, $4, $5}'; done
for f in $L/ncu2_*.log; do grep -E "gemm_kernel<|Elapsed Cycles|SM Active Cycles|Duration|Grid Size" $f; done
for f in $L/res/fwd_*.md; do echo "## $f"; grep -E "^## |^\| [0-9]+ \| [0-9]+ \|" $f; done
