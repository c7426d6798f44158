source .carry/gpu/common.sh
env_record
humming_site
LIB=.peer/vllm026_moe_C_sm90only.so.xz
step hum_llama_1024 90 "cd .peer && python humming_moe.py --lib vllm026_moe_C_sm90only.so.xz --E 16 --H 5120 --I 8192 --topk 1 --M 1024 --out /tmp/res/hum_llama_1024.json"
step hum_llama_4096 90 "cd .peer && python humming_moe.py --lib vllm026_moe_C_sm90only.so.xz --E 16 --H 5120 --I 8192 --topk 1 --M 4096 --out /tmp/res/hum_llama_4096.json"
step cutlass_grid_tail 60 "python -m pytest -q -p no:cacheprovider \$(cat .carry/gpu/cg_tail.txt)"
step codes_grid_tail 90 "python -m pytest -q -p no:cacheprovider \$(cat .carry/gpu/tg_tail.txt)"
step huge_m 150 "python -m pytest -q -p no:cacheprovider -m gpu tests/test_huge_m.py"
step suite_a 200 "python -m pytest -q -p no:cacheprovider -m gpu tests/test_cutlass_sm90.py tests/test_cuda_pipeline.py tests/test_precision.py tests/test_check_inputs.py -k 'not issue_grid'"
echo total $(( $(date +%s)-T0 )) s
