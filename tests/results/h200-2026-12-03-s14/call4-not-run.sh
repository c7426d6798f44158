source .carry/gpu/common.sh
env_record
step t_stages 70 "python -m pytest -q -p no:cacheprovider -m gpu tests/test_cutlass_sm90.py tests/test_cuda_pipeline.py -k 'values_equal or routing or quantize or silu'"
QB="python -m moe_fp4 bench --backends cutlass --model qwen3-30b-a3b --tokens 1024,4096,16384 --budget-ms 20 --no-plot --no-overhead --out /tmp/res --commit WIP"
step qa_base 40 "MOE_FP4_LIB=.carry/lib_base/libmoe_fp4_cuda.so $QB --name qa_base"
step qa_new 40 "$QB --name qa_new"
step huge_m 40 "python -m pytest -q -p no:cacheprovider -m gpu tests/test_huge_m.py"
echo total $(( $(date +%s)-T0 )) s
