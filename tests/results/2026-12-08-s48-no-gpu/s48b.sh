# s48b (prepared in session 48, which was lent no machine): every other GPU test file at this tree (s48a runs
# test_triton_values.py and test_triton_moe.py), through tests/run_gpu_tests.sh (one pytest per file, a summary with
# the GPU, versions and commit), the cutlass ones on the landed library (libL). Carry: .carry (libL, head).
set -u; R=${RUN:-s48b}; L=/tmp/$R
mkdir -p /tmp/gs && xz -dc .carry/gs/libL.so.xz > /tmp/gs/libmoe_fp4_cuda.so
export PYTHONPATH=. MOE_FP4_LIB=/tmp/gs/libmoe_fp4_cuda.so PYTHON=python3 GPU_TEST_DEADLINE=${DL:-585} \
  GPU_TEST_COMMIT=$(cat .carry/gpu/head) GPU_TEST_FILES="test_cutlass_sm90.py test_cuda_pipeline.py
  test_sm90_restore.py test_compile.py test_precision.py test_triton_w4a16.py test_triton_batch.py
  test_triton_stages.py test_triton_launch.py test_check_inputs.py test_properties.py test_concurrency.py
  test_huge_m.py test_resident_layout.py test_verify.py test_transformers_integration.py test_bench_gpu.py"
bash tests/run_gpu_tests.sh $L
tar czf $OUT/$R.tgz -C $L .
