# s46d (prepared in session 46, for after s46b): a launch-table change landed from s46b's sweep and A/B, checked and
# timed the way a claim needs: the benchmark with every peer (Marlin, Humming, bf16) at the points the change touches,
# cutlass and triton rows, one process per layer (each timed output checked against the reference), then the Triton
# GPU test files that hold the tables (about 130 and 160 s in session 42).
# SPECS (default below): "name model tokens" triples separated by ';'. Carry: .carry (libL: prepare-carry-la.sh or
# prepare-carry-t2a.sh) and .peer (the peer kit: ../shared/peers' prepare_marlin.sh and prepare_humming.sh).
set -u; R=${RUN:-s46d}; L=/tmp/$R; DEADLINE=${DL:-520}; source .carry/gpu/common.sh
C=$(cat .carry/gpu/head)
save(){ tar czf $OUT/$R.tgz -C $L . ; }
env_record
source tests/results/h100-2026-12-07-s42/peers.sh  # MOE_FP4_LIB=libL, Humming on the path, $P and $B
IFS=';' read -ra specs <<< "${SPECS:-deepseek deepseek-v3 64,256,1024;llama llama4-scout 128,256,1024;qwen qwen3-30b-a3b 16,64,128,256,1024}"
for spec in "${specs[@]}"; do
  read -r name model tokens <<< "$spec"
  step $name 110 $B --backends cutlass,triton --model $model --name $name $P --tokens $tokens
  save
done
for f in triton_values triton_moe; do
  step $f 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs tests/test_$f.py
  save
done
cat $L/steps.txt; grep -h "passed\|failed" $L/triton_*.log | tail -4
for f in $L/res/*.md; do echo "$(basename $f)"; grep -E "^\| [0-9]+ \| (triton|cutlass|marlin|humming) \|" $f | awk -F'|' '{print $2, $3, $4, $8}'; done
