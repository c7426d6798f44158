#!/bin/bash
# session 21 call 4: the landed build of 99a49e6 (GS in place of clusters of 2 to 4 CTAs): the GEMM check
# (random cases incl. GS), compute-sanitizer memcheck and racecheck on --small (GS cases included), the GPU
# tests of the cutlass backend (the grid, the CUDA pipeline, determinism / batch invariance), the benchmark of
# the three layers with every peer.
source .carry/gpu/common.sh
with_peers s21c4
export MOE_FP4_LIB=$PWD/.carry/gs/libmoe_fp4_cuda.so
B=.carry/gs/sm90_gemm_check; chmod +x $B
step chk 150 $B --no-bench
step san_memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B --small
step san_racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 9 $B --small
save
step pytest 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cutlass_sm90.py tests/test_cuda_pipeline.py
step pytest_props 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_properties.py -k "cutlass"
save
step bench_dsl 150 python3 -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --model deepseek-v3 --no-overhead --tokens 1,4,16,64,256,1024,4096 --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name dsl --commit 99a49e6
save
step bench_qwen 150 python3 -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --budget-ms 20 --no-plot --peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer --out $L/res --name qwen --commit 99a49e6
save
cat $L/steps.txt
tail -2 $L/chk.log; grep -c "^FAIL" $L/chk.log
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|small cases" $L/san_*.log
tail -3 $L/pytest.log; tail -3 $L/pytest_props.log
for f in $L/res/*.md; do echo "## $f"; grep -E "^\| [0-9]+ \| [0-9]+ \|" $f; done
