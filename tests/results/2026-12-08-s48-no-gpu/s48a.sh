# s48a (prepared in session 48, which was lent no machine): the whole triton column on the landed values table with
# every peer, one process per layer (every timed output checked against the reference), then the Triton GPU test
# files that hold the tables, to completion. Qwen3 M = 512 runs alone and last: Humming faulted there in sessions
# 46 and 47 (it now runs last in its case, and a fault ends only that process: moe_fp4/bench/engine.py).
# Carry: .carry (libL, common.sh, head: `git rev-parse --short HEAD > .carry/gpu/head`) and .peer (the peer kit).
set -u; R=${RUN:-s48a}; L=/tmp/$R; DEADLINE=${DL:-585}; source .carry/gpu/common.sh
C=$(cat .carry/gpu/head)
save(){ tar czf $OUT/$R.tgz -C $L . ; }
env_record
source tests/results/h100-2026-12-07-s42/peers.sh  # MOE_FP4_LIB=libL, Humming on the path, $P and $B
for spec in "qwen qwen3-30b-a3b 110 1,4,16,64,128,256,1024,4096,16384" \
    "llama llama4-scout 90 1,4,16,64,128,256,512,1024,4096,16384" \
    "deepseek deepseek-v3 90 1,4,16,64,256,512,1024,4096" "qwen512 qwen3-30b-a3b 40 512"; do
  read -r name model t tokens <<< "$spec"
  step $name $t $B --backends cutlass,triton --model $model --name $name $P --tokens $tokens
  save
done
# The two test files through tests/run_gpu_tests.sh (its summary records the GPU, versions and commit), to the
# deadline left.
PYTHON=python3 GPU_TEST_COMMIT=$C GPU_TEST_DEADLINE=$(( DEADLINE - $(date +%s) + T0 )) \
  GPU_TEST_FILES="test_triton_values.py test_triton_moe.py" bash tests/run_gpu_tests.sh $L/tests
save
cat $L/steps.txt
for f in $L/res/*.md; do echo "$(basename $f)"; grep -E "^\| [0-9]+ \| [0-9]+ \| " $f; done
