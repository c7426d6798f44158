# s40b: N2 (experiments/N2-next-gemm-l2-prefetch.diff): the fused first GEMM's CTAs of each expert's first
# token tile, once their own loads are issued, prefetch their share of the expert's second-GEMM weights (w2)
# into the L2 (cp.async.bulk.prefetch.L2), so that the second GEMM's first ring finds them there; against L
# (the tree's library), whole forwards at decode, cutlass only, two rounds in turns (outputs checked against
# the reference by the benchmark). Also: the forward's kernels with a warm L2 (kernel_breakdown.py, L) beside
# the cold-L2 stage timings, the forward grid on N2, memcheck on N2's decode forwards, and racecheck on one of
# L's tail-split cases (s39a's ran past 60 s, s39e's was cut by its deadline).
# Carry: .carry/gs/lib{L,N2}.so.xz, .carry/gpu/{common.sh (../h100-2026-12-06-s39/common.sh),commit}, .carry/n2/py.diff (the diff's Python part).
set -u; L=/tmp/s40b; DEADLINE=${DL:-330}; source .carry/gpu/common.sh
C=$(cat .carry/gpu/commit)
G=/tmp/gs; mkdir -p $G; for v in L N2; do xz -dc .carry/gs/lib$v.so.xz > $G/lib$v.so; done
N=/tmp/n2tree; rm -rf $N; mkdir -p $N; tar cf - --exclude=./.carry --exclude=./.peer . | tar xf - -C $N
(cd $N && patch -p1 < $OLDPWD/.carry/n2/py.diff) > $L.patch.log 2>&1 || true
save(){ mkdir -p $L; cp $L.patch.log $L/ 2>/dev/null; tar czf $OUT/s40b.tgz -C $L . ; }
env_record; mkdir -p $L/res
B="python3 -m moe_fp4 bench --backends cutlass --no-overhead --budget-ms 20 --no-plot --out $L/res"
run_l="env PYTHONPATH=. MOE_FP4_LIB=$G/libL.so"
run_n2="env -C $N PYTHONPATH=. MOE_FP4_LIB=$G/libN2.so"  # the tree with the diff's Python part
step tests_N2 60 $run_n2 python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py -k "fused_moe_cutlass_equals_reference or gemm_silu_equals"
save
round() {
  step qwen_L_r$1 25 $run_l $B --model qwen3-30b-a3b --tokens 1,2,4,16 --name qwen-L-r$1 --commit $C-L
  step qwen_N2_r$1 25 $run_n2 $B --model qwen3-30b-a3b --tokens 1,2,4,16 --name qwen-N2-r$1 --commit $C-N2
  step llama_L_r$1 25 $run_l $B --model llama4-scout --tokens 1,4,16 --name llama-L-r$1 --commit $C-L
  step llama_N2_r$1 25 $run_n2 $B --model llama4-scout --tokens 1,4,16 --name llama-N2-r$1 --commit $C-N2
  step ds_L_r$1 25 $run_l $B --model deepseek-v3 --tokens 1,4 --name ds-L-r$1 --commit $C-L
  step ds_N2_r$1 25 $run_n2 $B --model deepseek-v3 --tokens 1,4 --name ds-N2-r$1 --commit $C-N2
  save
}
round 1
step warm_L 30 $run_l python3 benchmarks/kernel_breakdown.py --backend cutlass --model qwen3-30b-a3b --tokens 1,4,16
step warm_N2 30 $run_n2 python3 benchmarks/kernel_breakdown.py --backend cutlass --model qwen3-30b-a3b --tokens 1,4,16
save
round 2
step memcheck_N2 50 $run_n2 compute-sanitizer --tool memcheck --error-exitcode=1 python3 -m pytest -q -p no:cacheprovider \
  tests/test_cutlass_sm90.py -k "fused_moe_cutlass_equals_reference and m1-"
save
step tail_racecheck_L 150 $run_l compute-sanitizer --tool racecheck --error-exitcode=1 python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py -k "tail_split_within and 11"
save
cat $L/steps.txt
