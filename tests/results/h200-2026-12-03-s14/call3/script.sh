source .carry/gpu/common.sh
env_record
humming_site
PL="--peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer"
step bench_dsl 250 "python -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --model deepseek-v3 --no-stages --no-overhead --tokens 1,4,16,64,256,1024,4096 --budget-ms 20 --no-plot $PL --out /tmp/res --name h200-2026-12-03-s14-deepseek-llama --commit 1bcf603"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu | tail -1)
SEC="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --section InstructionStats"
step ncu_qwen 130 "$NCU --nvtx --nvtx-include 'forward/' $SEC -o /tmp/res/ncu_qwen -f python benchmarks/ncu_forward.py --tokens 16,16384 && $NCU --import /tmp/res/ncu_qwen.ncu-rep --page details > /tmp/res/ncu_qwen.txt"
step suite_b 190 "python -m pytest -q -p no:cacheprovider -m gpu tests/test_compile.py tests/test_concurrency.py tests/test_properties.py tests/test_transformers_integration.py tests/test_triton_batch.py tests/test_triton_launch.py tests/test_triton_stages.py tests/test_verify.py tests/test_resident_layout.py tests/test_sm90_restore.py tests/test_bench_gpu.py tests/test_distributed.py tests/test_triton_moe.py tests/test_triton_values.py -k 'not issue_grid'"
echo total $(( $(date +%s)-T0 )) s
