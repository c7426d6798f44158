#!/bin/bash
# session 20 call 8: EXPERIMENT dyn (.carry/dyn/experiment.diff on f52f5fc): the persistent sm_90a GEMM
# takes tiles from a global counter when MOE_FP4_SM90_DYNAMIC=1 (the 8-, 16-token and 192-row tiles);
# checked, then timed against the static order (same library) and the landed library
L=/tmp/s20c8; mkdir -p $L/res
source .carry/gpu/common.sh
env_record
save() { tar czf $OUT/s20c8.tgz -C $L .; }
B=.carry/dyn/sm90_gemm_check; chmod +x $B
MOE_FP4_SM90_DYNAMIC=1 step chk_dyn 80 $B --no-bench
save
for d in 0 1; do MOE_FP4_SM90_DYNAMIC=$d step gemm_dyn$d 40 $B --bench-only --shapes qwen,llama --ms 16,64,256,1024,4096 --iters 10; done
save
export PYTHONPATH=.
for v in "s20b 0" "dyn 0" "dyn 1"; do set -- $v
  MOE_FP4_LIB=$PWD/.carry/$1/libmoe_fp4_cuda.so MOE_FP4_SM90_DYNAMIC=$2 step fwd_$1_$2 50 python3 -m moe_fp4 bench --backends cutlass --model llama4-scout --model qwen3-30b-a3b --tokens 16,64,256,1024,4096 --no-stages --no-overhead --budget-ms 15 --no-plot --out $L/res --name fwd_$1_$2 --commit $1
done
save
cat $L/steps.txt
tail -2 $L/chk_dyn.log
for d in 0 1; do echo "## dyn $d"; grep -E "^(qwen|llama)" $L/gemm_dyn$d.log | awk '{print $1,$2,$4,$5,$10}'; done
for f in $L/res/fwd_*.md; do echo "## $f"; grep -E "^\| [0-9]+ \| [0-9]+ \|" $f | cut -d'|' -f2,6; done
