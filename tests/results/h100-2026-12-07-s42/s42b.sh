# s42b: the GPU-marked tests at HEAD ($(cat .carry/gpu/head)) on the landed library (libL, csrc as at 69e799f), one
# pytest process per file so that a run cut by the deadline keeps each finished file's result. The files that had
# not run on a GPU for longest first; the three cutlass files (run in s41a/s40c on M3, in s39a on ba25f14) last.
# test_distributed.py needs two GPUs and is left out.
set -u; L=/tmp/s42b; DEADLINE=${DL:-430}; source .carry/gpu/common.sh
G=/tmp/gs; mkdir -p $G; xz -dc .carry/gs/libL.so.xz > $G/libmoe_fp4_cuda.so
export PYTHONPATH=. MOE_FP4_LIB=$G/libmoe_fp4_cuda.so
env_record
for f in triton_moe triton_values triton_w4a16 triton_batch triton_stages triton_launch compile precision properties \
         check_inputs concurrency huge_m resident_layout verify bench_gpu sm90_restore cuda_pipeline cutlass_sm90; do
  step $f 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs tests/test_$f.py
  tar czf $OUT/s42b.tgz -C $L .
done
cat $L/steps.txt; grep -h "passed\|failed\|error" $L/*.log | grep -v "^E " | tail -40
