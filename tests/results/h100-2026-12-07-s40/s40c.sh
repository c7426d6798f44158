# s40c (prepared for the next session, not run): M3 (experiments/M3-two-slice-kernel-3-per-sm.diff), the two-slice
# kernel of Qwen3's M = 1 GEMMs built for 3 CTAs per SM (66-72 registers, no spill) instead of 2 (76-84). Reading
# (s40a's profile): the M = 1 GEMMs wait for their weights, first of all the first chunk. Under programmatic
# dependent launch the second GEMM's CTAs start, and request their whole ring, where an SM has room beside the
# first GEMM's CTAs: with 80-register CTAs (3 x 288 x 80 > 65536) only the 72 SMs that hold one first-GEMM CTA
# have room, with 72-register CTAs every SM does. Against L at Qwen3 M = 1 (M = 2 and 4, whose plans take other
# kernels, are the control), three rounds in turns; then the cutlass test files and memcheck of the M = 1 forwards
# on M3 (what landing it needs), and racecheck of one of L's tail-split cases (still owed since s39a).
# Carry: .carry/gs/lib{L,M3}.so.xz and .carry/gpu/{common.sh,commit} from prepare-carry.sh.
set -u; L=/tmp/s40c; DEADLINE=${DL:-420}; source .carry/gpu/common.sh
C=$(cat .carry/gpu/commit)
G=/tmp/gs; mkdir -p $G; for v in L M3; do xz -dc .carry/gs/lib$v.so.xz > $G/lib$v.so; done
export PYTHONPATH=.
save(){ tar czf $OUT/s40c.tgz -C $L . ; }
env_record; mkdir -p $L/res
B="python3 -m moe_fp4 bench --backends cutlass --no-overhead --budget-ms 20 --no-plot --out $L/res --model qwen3-30b-a3b --tokens 1,2,4"
for r in 1 2 3; do
  for v in L M3; do step qwen_${v}_r$r 25 env MOE_FP4_LIB=$G/lib$v.so $B --name qwen-$v-r$r --commit $C-$v; done
  save
done
step tests_M3 150 env MOE_FP4_LIB=$G/libM3.so python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py \
  tests/test_cuda_pipeline.py tests/test_sm90_restore.py
save
san() {  # san NAME SECONDS TOOL LIB -k EXPR: a sanitizer over the cutlass GEMM tests selected by EXPR
  step $1 $2 env MOE_FP4_LIB=$G/lib$4.so compute-sanitizer --tool $3 --error-exitcode=1 python3 -m pytest -q \
    -p no:cacheprovider tests/test_cutlass_sm90.py "${@:5}"
  save
}
san memcheck_M3 90 memcheck M3 -k "fused_moe_cutlass_equals_reference and m1- and h2048"
san tail_racecheck_L 150 racecheck L -k "tail_split_within and 11"
cat $L/steps.txt
