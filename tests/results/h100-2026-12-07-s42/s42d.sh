# s42d (prepared in session 42, not run): where cutlass trails triton or Humming at decode, the GEMM plans the
# library can run, each GEMM alone (csrc/tests/sm90_gemm_check --sweep-splits: token tile x slices per CTA x CTAs
# per cluster, and K splits through the workspace; cold, the L2 flushed before each launch). The question: does a
# plan other than the heuristic's run Llama-4-Scout's second GEMM at M = 32-96 (160 us at M = 64 against triton's
# 145, which runs 64-row tiles) or Qwen3's second GEMM at M = 1-64 (14.0 us at M = 1 against triton's 12.8) faster?
# Carry: .carry: libL as in s42c, and the check binary built against HEAD's header (on a fresh machine, after
# ../h100-2026-12-07-s40/prepare-carry.sh: xz -dc .carry/gs/libL.so.xz > /tmp/chk/libmoe_fp4_cuda.so;
# bash csrc/tests/run_sm90_check.sh --lib /tmp/chk --out /tmp/chk --build-only;
# xz -c /tmp/chk/sm90_gemm_check > .carry/gs/sm90_gemm_check.xz).
set -u; L=/tmp/s42d; DEADLINE=${DL:-300}; source .carry/gpu/common.sh
G=/tmp/gs; mkdir -p $G; xz -dc .carry/gs/libL.so.xz > $G/libmoe_fp4_cuda.so
xz -dc .carry/gs/sm90_gemm_check.xz > $G/sm90_gemm_check && chmod +x $G/sm90_gemm_check
env_record
step sweep_llama 150 $G/sm90_gemm_check --bench-only --sweep-splits --shapes llama --ms 16,32,48,64,96
tar czf $OUT/s42d.tgz -C $L .
step sweep_qwen 120 $G/sm90_gemm_check --bench-only --sweep-splits --shapes qwen --ms 1,4,16,64
tar czf $OUT/s42d.tgz -C $L .
cat $L/steps.txt; cat $L/sweep_llama.log $L/sweep_qwen.log | cut -c1-400
