# s39e (prepared, not run): two candidates for the decode GEMMs against the landed L. PF / PF2: a one-tile CTA
# (Qwen3 M = 1, Llama-4-Scout M = 1) asks the L2 for the rest of its K range at its start, after the ring's first
# turn (PF: all of it; PF2: at most two more turns). KC: Qwen3's M = 1 first GEMM (two K-slices, 192 CTAs) also
# splits K across a cluster of 2, in a kernel of 66 registers that fits 3 CTAs per SM (384 CTAs, one ring turn
# each). Whole forwards, cutlass only, three rounds in turns (M = 4, whose plans none of them changes, is the
# control; every output checked against the reference; KC changes no Llama-4-Scout plan); memcheck on PF and KC
# over the test cases at Qwen3's decode shape; racecheck on KC's (its K-slices' and cluster's shared-memory
# exchanges meet for the first time) and on one of L's tail-split cases (s39a's ran past its 60 s, s39b lost its
# machine). The cutlass test files on a candidate that wins: a call of its own (~2 minutes each).
# Libraries: prepare-carry.sh in this folder (L at the tree's commit, PF, PF2 and KC from experiments/), carried
# xz-compressed in .carry/gs with .carry/gpu/{common.sh,commit}.
set -u; L=/tmp/s39e; DEADLINE=${DL:-560}; source .carry/gpu/common.sh
C=$(cat .carry/gpu/commit)
G=/tmp/gs; mkdir -p $G; for v in L PF PF2 KC; do xz -dc .carry/gs/lib$v.so.xz > $G/lib$v.so; done
export PYTHONPATH=.
save(){ tar czf $OUT/s39e.tgz -C $L . ; }
env_record; mkdir -p $L/res
B="python3 -m moe_fp4 bench --backends cutlass --no-overhead --budget-ms 20 --no-plot --out $L/res"
round() { for v in L PF PF2 KC; do
  step qwen_${v}_r$1 30 env MOE_FP4_LIB=$G/lib$v.so $B --model qwen3-30b-a3b --tokens 1,4 --name qwen-$v-r$1 --commit $C-$v
  [ $v = KC ] || step llama_${v}_r$1 30 env MOE_FP4_LIB=$G/lib$v.so $B --model llama4-scout --tokens 1,4 --name llama-$v-r$1 --commit $C-$v
done; save; }
round 1
round 2
for v in PF KC; do  # the forward and fused-GEMM cases at Qwen3's decode shape (M = 1: what PF and KC change)
  step memcheck_$v 100 env MOE_FP4_LIB=$G/lib$v.so compute-sanitizer --tool memcheck --error-exitcode=1 python3 -m pytest -q \
    -p no:cacheprovider tests/test_cutlass_sm90.py -k "fused_moe_cutlass_equals_reference or gemm_silu_equals_the_gemm"
  save
done
step racecheck_KC 120 env MOE_FP4_LIB=$G/libKC.so compute-sanitizer --tool racecheck --error-exitcode=1 python3 -m pytest -q \
  -p no:cacheprovider tests/test_cutlass_sm90.py -k "fused_moe_cutlass_equals_reference and h2048 and m1"
save
step tail_racecheck_L 150 env MOE_FP4_LIB=$G/libL.so compute-sanitizer --tool racecheck --error-exitcode=1 python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py -k "tail_split_within and 11"
save
round 3
cat $L/steps.txt
