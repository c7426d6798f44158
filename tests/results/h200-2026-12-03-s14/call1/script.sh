source .carry/gpu/common.sh
env_record
humming_site
step build_chk 60 "bash csrc/tests/run_sm90_check.sh --lib moe_fp4/_lib --out /tmp/chk --build-only"
step chk 60 "/tmp/chk/sm90_gemm_check --no-bench"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer | tail -1)
step race 40 "$CS --tool racecheck --error-exitcode=1 /tmp/chk/sm90_gemm_check --small"
step mem 40 "$CS --tool memcheck --error-exitcode=1 /tmp/chk/sm90_gemm_check --small"
PL="--peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer"
step bench_qwen 150 "python -m moe_fp4 bench --backends cutlass,triton --model qwen3-30b-a3b --budget-ms 20 --no-plot $PL --out /tmp/res --name h200-2026-12-03-s14-qwen --commit 02a082d"
step cutlass_grid 110 "python -m pytest -q tests/test_cutlass_sm90.py -m gpu -k issue_grid -p no:cacheprovider"
step bench_dsl 100 "python -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --model deepseek-v3 --no-stages --no-overhead --tokens 1,4,16,64,256,1024,4096 --budget-ms 20 --no-plot $PL --out /tmp/res --name h200-2026-12-03-s14-deepseek-llama --commit 02a082d"
step codes_grid 150 "python -m pytest -q tests/test_triton_moe.py -m gpu -k issue_grid_gpu -p no:cacheprovider"
echo total $(( $(date +%s)-T0 )) s
