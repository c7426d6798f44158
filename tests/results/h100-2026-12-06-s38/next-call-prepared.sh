# Prepared for the next session (not run: this session's device time was spent). Build the landed library on the
# CPU machine (/tmp/var/build.sh L, as in ../h100-2026-12-06-s37/experiments/T-prepared-run.sh, from the tree at
# the landed commit), carry it xz-compressed as .carry/gs/libL.so.xz with .carry/gpu/common.sh, the commit in
# .carry/gpu/commit and the peer kit in .peer (carry [".carry", ".peer"]). Then on the GPU:
# 1. s37b's steps on L with every peer (all three layers; the cutlass test files and memcheck of the sanitizer
#    workload included): the committed run that decides whether `auto` may prefer cutlass on 9.x;
# 2. memcheck and racecheck on the tail split's GPU tests (the sanitizer workload's GEMMs never reach the tail).
sed -e 's#/tmp/s37b#/tmp/s39a#; s#s37b.tgz#s39a.tgz#' tests/results/h100-2026-12-06-s37/s37b.sh | V=L DL=450 bash
L=/tmp/s39a; source .carry/gpu/common.sh; export PYTHONPATH=. MOE_FP4_LIB=/tmp/gs/libmoe_fp4_cuda.so
for tool in memcheck racecheck; do
  step tail_$tool 60 compute-sanitizer --tool $tool --error-exitcode=1 python3 -m pytest -q -p no:cacheprovider \
    tests/test_cutlass_sm90.py -k "tail_split_within and (11 or 13)"
done
tar czf $OUT/s39a.tgz -C $L .; cat $L/steps.txt
