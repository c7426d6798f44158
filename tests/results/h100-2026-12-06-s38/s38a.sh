# s38a: session 37's tail split (T, T2) against the landed library (F): Llama-4-Scout and DeepSeek-V3 forwards
# (cutlass only), the tail path's new GPU tests (T2, T), Llama-4-Scout again, then the three cutlass test files
# on T2 as far as the deadline allows (DL: the little device time left this session)
NAME=s38a LIBS='F T T2' DL=${DL:-250}; source tests/results/h100-2026-12-06-s37/prelude.sh
B="python3 -m moe_fp4 bench --backends cutlass --no-overhead --budget-ms 20 --no-plot --out $L/res"
llama(){ step llama_$1_r$2 30 env MOE_FP4_LIB=$G/lib$1.so $B --model llama4-scout --tokens 4,16,24,32,64 --name llama-$1-r$2 --commit $C-$1; }
ds(){ step ds_$1_r$2 25 env MOE_FP4_LIB=$G/lib$1.so $B --model deepseek-v3 --tokens 1,2,4 --name ds-$1-r$2 --commit $C-$1; }
for v in F T T2; do llama $v 1; done; for v in F T2; do ds $v 1; done; save
step tail_T2 80 env MOE_FP4_LIB=$G/libT2.so python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py -k tail
save
for v in F T T2; do llama $v 2; done; save
step tail_T 80 env MOE_FP4_LIB=$G/libT.so python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py -k tail
step tests_T2 170 env MOE_FP4_LIB=$G/libT2.so python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py tests/test_cuda_pipeline.py tests/test_sm90_restore.py
save
cat $L/steps.txt
