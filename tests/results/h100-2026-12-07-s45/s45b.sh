# s45b: where the decode forward's time goes against the read order (no library change).
# probe_order.py: the touched weights of Llama-4-Scout's and Qwen3's decode GEMMs read in the GEMM's order and in
# others (one stream per tile, the hardware's schedule, K halves), against a plain read; fusion_ab.py's timelines
# of both backends at Llama-4-Scout M = 1 and 64 and Qwen3 M = 64 (triton leads cutlass at Llama-4-Scout M = 1 and
# 64 in session 42's run). Carry: .carry (prepare-carry.sh of session 44: libL = the tree's csrc, ABI 11).
set -u; R=${RUN:-s45b}; L=/tmp/$R; DEADLINE=${DL:-300}; source .carry/gpu/common.sh
G=/tmp/gs; mkdir -p $G; xz -dc .carry/gs/libL.so.xz > $G/libL.so
export PYTHONPATH=. MOE_FP4_LIB=$G/libL.so
save(){ tar czf $OUT/$R.tgz -C $L . ; }
env_record
step probe_order 150 python3 tests/results/h100-2026-12-07-s45/probe_order.py
save
for bv in triton:topk cutlass:fused; do  # each backend's default plan (and unfused, always run)
  b=${bv%:*}
  step ab_$b 60 python3 benchmarks/fusion_ab.py --backend $b --models llama4-scout,qwen3-30b-a3b --tokens 1,64 \
    --rounds 2 --timeline --variants ${bv#*:} --out $L/ab_$b.json
  save
done
cat $L/steps.txt; cat $L/probe_order.log; grep -h "M=\|: " $L/ab_*.log | grep -v Warn
