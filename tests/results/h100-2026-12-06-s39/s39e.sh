# s39e (prepared, not run): a one-tile CTA (decode: Qwen3 M = 1, Llama-4-Scout M = 1) asks the L2 for the rest of
# its K range at its start, after the ring's first turn (PF: all of it; PF2: at most two more turns), against the
# landed L: whole forwards, cutlass only, three rounds in turns (M = 4, whose plans run persistent CTAs and no
# prefetch, is the control); the cutlass test files and memcheck of the sanitizer workload on PF; racecheck on one
# of L's tail-split cases (s39a's ran past its 60 s, s39b lost its machine).
# Libraries: prepare-carry.sh in this folder (L at the tree's commit, PF and PF2 from experiments/), carried
# xz-compressed in .carry/gs with .carry/gpu/{common.sh,commit}.
set -u; L=/tmp/s39e; DEADLINE=${DL:-560}; source .carry/gpu/common.sh
C=$(cat .carry/gpu/commit)
G=/tmp/gs; mkdir -p $G; for v in L PF PF2; do xz -dc .carry/gs/lib$v.so.xz > $G/lib$v.so; done
export PYTHONPATH=.
save(){ tar czf $OUT/s39e.tgz -C $L . ; }
env_record; mkdir -p $L/res
B="python3 -m moe_fp4 bench --backends cutlass --no-overhead --budget-ms 20 --no-plot --out $L/res"
round() { for v in L PF PF2; do
  step qwen_${v}_r$1 30 env MOE_FP4_LIB=$G/lib$v.so $B --model qwen3-30b-a3b --tokens 1,4 --name qwen-$v-r$1 --commit $C-$v
  step llama_${v}_r$1 30 env MOE_FP4_LIB=$G/lib$v.so $B --model llama4-scout --tokens 1,4 --name llama-$v-r$1 --commit $C-$v
done; save; }
round 1
round 2
step tests_PF 170 env MOE_FP4_LIB=$G/libPF.so python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py tests/test_cuda_pipeline.py tests/test_sm90_restore.py
save
step memcheck_PF 100 env MOE_FP4_LIB=$G/libPF.so SANITIZER_TOOLS=memcheck SANITIZER_TIMEOUT=90 PYTHON=python3 bash tests/run_sanitizer.sh $L/san
save
step tail_racecheck_L 150 env MOE_FP4_LIB=$G/libL.so compute-sanitizer --tool racecheck --error-exitcode=1 python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py -k "tail_split_within and 11"
save
round 3
cat $L/steps.txt
