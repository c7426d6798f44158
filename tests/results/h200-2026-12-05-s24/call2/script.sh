#!/bin/bash
# session 24, call 2: the new fusions' GPU tests, the fused top-k reduce under memcheck, session 23's whole-block tests
source .carry/gpu/common.sh
L=/tmp/s24c2; mkdir -p $L/res; env_record
export PYTHONPATH=.
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so
echo "commit ${COMMIT:-unknown}" >> $L/env.txt
step fusions 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_stages.py tests/test_host_path.py tests/test_triton_values.py -k "topk_reduce or k_ranges or fuse_silu_split or plan_fuses or pinned_gemm_config or triton_plan_equals" --durations=5
step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 7 python3 -m pytest -q -p no:cacheprovider tests/test_triton_stages.py -k "topk_reduce and codes and bf16"
step whole 180 python3 -m pytest -q -p no:cacheprovider tests/test_triton_values.py tests/test_triton_numerics.py -k "halves or configs or whole or e2m1" --durations=5
tar czf $OUT/s24c2.tgz -C $L .
cat $L/steps.txt
for f in fusions memcheck whole; do echo "== $f"; tail -4 $L/$f.log; done
