# s42a: the landed library (csrc unchanged since 69e799f; .carry/gs/libL.so.xz from
# tests/results/h100-2026-12-07-s40/prepare-carry.sh) at HEAD ($(cat .carry/gpu/head)), on whichever GPU came:
# the measured read floor beside cutlass and triton, all three layers with every peer (the run that decides `auto`),
# then the tail split's racecheck owed since s39a (only the GEMM kernels instrumented, two cases), then second
# rounds of the points that were within 3 % in s39.
# (As committed after the run: the set-up lines moved to peers.sh, the same commands; 8d76f0c has the text as run.)
set -u; L=/tmp/s42a; DEADLINE=${DL:-480}; source .carry/gpu/common.sh
C=$(cat .carry/gpu/head)
env_record
source tests/results/h100-2026-12-07-s42/peers.sh
save(){ tar czf $OUT/s42a.tgz -C $L . ; }
step read_floor 60 python3 benchmarks/read_floor.py --out $L/read_floor --commit $C --backends cutlass,triton \
  --models qwen3-30b-a3b,llama4-scout,deepseek-v3 --tokens 1,4,16,64
save
every_peer
T=tests/test_cutlass_sm90.py::test_second_gemm_tail_split_within_bound_of_the_reference
step tail_racecheck 150 compute-sanitizer --tool racecheck --kernel-regex kns=gemm --error-exitcode=1 \
  python3 -m pytest -q -p no:cacheprovider "$T[1]" "$T[11]"
# If this compute-sanitizer does not know the kernel filter, the unfiltered check of one case instead.
grep -qi "unrecognized\|unknown option\|invalid option" $L/tail_racecheck.log && \
  step tail_racecheck_all 120 compute-sanitizer --tool racecheck --error-exitcode=1 \
  python3 -m pytest -q -p no:cacheprovider "$T[1]"
save
step llama_r2 40 $B --backends cutlass,triton --model llama4-scout --tokens 1,16,64 --name llama-r2
step deepseek_r2 40 $B --backends cutlass,triton --model deepseek-v3 --tokens 1,4,16 --name deepseek-r2
save
cat $L/steps.txt
for f in $L/res/*.md $L/read_floor/read_floor.md; do echo "== $f"; grep -E "^\| *[0-9]+ \| (cutlass|triton|marlin|humming|bf16)" $f | head -40; done
