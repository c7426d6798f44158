# Prepared in session 37 (not run: device time spent). Build on the CPU machine, from the tree at 472ce5d:
#   awk '/^diff --git a\/(tests|moe_fp4)/{skip=1} /^diff --git a\/csrc/{skip=0} !skip' T-gs-tail-split.diff > /tmp/T-csrc.diff
#   /tmp/var/build.sh F; /tmp/var/build.sh T /tmp/T-csrc.diff
#   cat /tmp/T-csrc.diff T2-on-top-of-T-fused-first-gemm-in-its-own-kernel.diff > /tmp/T2.diff; /tmp/var/build.sh T2 /tmp/T2.diff
# and apply the whole T diff to the tree carried (its tests and the stage calls' workspace in moe_fp4/backends/cutlass.py).
# Carry libF.so, libT.so, libT2.so and csrc/tests' sm90_gemm_check xz-compressed in .carry/gs, then on the GPU
# (DL: the call's seconds). Add DeepSeek-V3 M = 2 (its GEMM1 takes the tail split there) to a forward step.
# s37d: T (GS splits only the last round's tiles) and T2 against F
NAME=s37d LIBS='F T T2'; source tests/results/h100-2026-12-06-s37/prelude.sh
step check_T 80 env LD_LIBRARY_PATH=$G/T $G/sm90_gemm_check --no-bench
save
for v in F T; do step sweep_$v 60 env LD_LIBRARY_PATH=$G/$v $G/sm90_gemm_check --bench-only --sweep-splits --shapes llama --ms 16,64 --gs 4; done
save
for r in 1; do for v in F T T2; do
step llama_${v}_r$r 30 env MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model llama4-scout --tokens 4,16,24,32,64 --name llama-$v-r$r --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
done; save; done
step tests_T 170 env MOE_FP4_LIB=$G/libT.so python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py tests/test_cuda_pipeline.py tests/test_sm90_restore.py
save
for r in 2; do for v in F T T2; do
step llama_${v}_r$r 30 env MOE_FP4_LIB=$G/lib$v.so python3 -m moe_fp4 bench --backends cutlass --model llama4-scout --tokens 4,16,24,32,64 --name llama-$v-r$r --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-$v
done; save; done
step llama_T_triton 60 env MOE_FP4_LIB=$G/libT.so python3 -m moe_fp4 bench --backends cutlass,triton --model llama4-scout --tokens 16,64 --name llama-T-triton --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C-T
save
cat $L/steps.txt
