# s44c (prepared, not run: the device had no time left; RUN=s44c DS=1 of s44b.sh): run on 8e62d75's tree with
# experiments/T2-top1-reduce-in-the-second-gemm-epilogue.diff applied (git apply), after prepare-carry.sh on that
# tree. s44b again on the second form of the top-1 reduce (its loads in the epilogue after the K splits' sums,
# the zeros after the tiles, read from shared memory where every token is served), whose plain kernels' main
# loops are the L kernels' instruction for instruction where the persistent 8- and 16-token tiles run (s44b's
# first form cost the plain Qwen3 forward 1-2 % at M = 16 and 64). Also DeepSeek-V3 M = 1 and 4.
# s44b's text follows. The top-1 reduce in the second GEMM's epilogue (moe_fp4_sm90_gemm_top1, ABI 12; the tree's csrc, built as
# libT1) on its first GPU: its tests (bit for bit against the GEMM and moe_fp4_moe_reduce), the whole forward with
# and without it (benchmarks/fusion_ab.py --backend cutlass: variants fused / top1 / unfused in one process, in
# turns, outputs compared bit for bit), the new kernels' code against L's where nothing fuses (moe-fp4 bench, L
# from session 44's first commit's tree, ABI 11, in turns), and memcheck on its small cases.
# Carry: .carry (bash tests/results/h100-2026-12-07-s44/prepare-carry.sh).
RUN=s44c DS=1 exec bash "$(dirname "$0")/s44b.sh"
