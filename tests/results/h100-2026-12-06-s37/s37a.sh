# s37a: the new GPU test on F, then session 36's prepared DG steps (its script's lines from check_DG to the
# Llama-4-Scout loop: DG's correctness, the sweep F / DG, the forward F / DG4; its tests_DG4 step left out)
NAME=s37a LIBS='F DG DG4'; source tests/results/h100-2026-12-06-s37/prelude.sh
step newtest_F 60 env MOE_FP4_LIB=$G/libF.so python3 -m pytest -q -x tests/test_cutlass_sm90.py -k "second_gemm_split or second_gemm_splits"
sed -n '/^step check_DG/,/^done; save; done/p' tests/results/h100-2026-12-06-s36/experiments/DG-prepared-run.sh > /tmp/s37a-steps.sh
source /tmp/s37a-steps.sh
cat $L/steps.txt
