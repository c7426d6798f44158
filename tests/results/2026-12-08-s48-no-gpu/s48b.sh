# s48b (prepared in session 48, which was lent no machine): every other GPU test file at this tree (s48a runs
# test_triton_values.py and test_triton_moe.py), one pytest per file, the cutlass ones on the landed library (libL).
# Carry: .carry (libL, common.sh, head).
set -u; R=${RUN:-s48b}; L=/tmp/$R; DEADLINE=${DL:-585}; source .carry/gpu/common.sh
save(){ tar czf $OUT/$R.tgz -C $L . ; }
env_record
mkdir -p /tmp/gs && xz -dc .carry/gs/libL.so.xz > /tmp/gs/libmoe_fp4_cuda.so
export PYTHONPATH=. MOE_FP4_LIB=/tmp/gs/libmoe_fp4_cuda.so
for f in cutlass_sm90:150 cuda_pipeline:60 sm90_restore:60 compile:90 precision:90 triton_w4a16:80 triton_batch:60 \
    triton_stages:40 triton_launch:30 check_inputs:60 properties:90 concurrency:60 huge_m:60 resident_layout:60 \
    verify:60 transformers_integration:60 bench_gpu:60 native:30 scripts:40 bench:30 bench_ep:30 distributed:30; do
  step ${f%:*} ${f#*:} python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs tests/test_${f%:*}.py
  save
done
cat $L/steps.txt; for f in $L/*.log; do echo "$(basename $f): $(grep -E "passed|failed|error|no tests ran" $f | tail -1)"; done
