# s47b: (1) the values table's long-K rule (gemm.VALUES_LONG_K_MIN: at 9-24 rows per expert a GEMM with K >= 6144
# takes the decode row's 16x64x256 tile; from s47a's sweep) in the whole forward, the tree's plan against the same
# plan with the rule off (fusion_ab.py --values-long-k-min 1000000), at the 16- and 24-row points of the layers with
# such a K (DeepSeek-V3 M = 512, 768: gemm1 K = 7168; Llama-4-Scout M = 256, 384: gemm2 K = 8192) and one without
# (Qwen3 M = 256: nothing changes); (1b) the experiment VALUES_WIDE_ROWS (25-96 rows per expert on a 64-token swap
# tile where the grid is not small and K not short) against the tree's plan at Llama-4-Scout, Qwen3 M = 512, 1024
# and DeepSeek-V3 M = 1024; (2) the values GPU tests on the new rule; (3) the benchmark with every peer at DeepSeek-V3 M = 512
# and Llama-4-Scout M = 256; (4) session 46's s46c, cut to what decides it: L, LA5, T2 and T2A in turns, two
# rounds, on the cutlass forward at Qwen3 M = 16, 64 and Llama-4-Scout M = 1 (where T2 lost 1-2 % in s45a), then
# T2A's top-1 tests and fusion A/B if time is left. Carry: .carry (prepare-carry-t2a.sh: libL, LA5, T2, T2A;
# not its t2tree) and .peer.
set -u; R=${RUN:-s47b}; L=/tmp/$R; DEADLINE=${DL:-575}; source .carry/gpu/common.sh
C=$(cat .carry/gpu/head); export PYTHONPATH=.
save(){ tar czf $OUT/$R.tgz -C $L . ; }
env_record
ab() { local n=$1 t=$2; shift 2; step $n $t python3 benchmarks/fusion_ab.py --rounds 3 --out $L/$n.json "$@"; save; }
K="--variants split-in-gemm --values-long-k-min 1000000"
ab ab-ds 70 --models deepseek-v3 --tokens 512,768 $K
ab ab-lq 50 --models llama4-scout,qwen3-30b-a3b --tokens 256,384 $K
# (1b) the 25-96 rows' 64-token tile (gemm.VALUES_WIDE_ROWS, off in the tree), fusion_ab's wide-rows variant
W="--variants split-in-gemm,wide-rows"
ab ab-wide-ds 60 --models deepseek-v3 --tokens 1024 $W
ab ab-wide 50 --models llama4-scout,qwen3-30b-a3b --tokens 512,1024 $W
step triton_values 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs tests/test_triton_values.py
save
# (3) every peer
source tests/results/h100-2026-12-07-s42/peers.sh
step p-deepseek 70 $B --backends cutlass,triton --model deepseek-v3 --name deepseek $P --tokens 512
save
step p-llama 50 $B --backends cutlass,triton --model llama4-scout --name llama $P --tokens 256
save
# The T2 tree (T2's Python, ABI 12) made here from this tree, to stay within the carry limit: T2's diff without its
# fusion_ab.py and test_bench.py parts (they conflict with this tree's; s46c's last step, which needs the former, goes)
mkdir -p /tmp/t2 && tar cf - --exclude=./tests/results --exclude=./benchmarks/results --exclude=./.carry \
  --exclude=./.peer --exclude=./.git . | tar x -C /tmp/t2 && git -C /tmp/t2 apply --exclude=benchmarks/fusion_ab.py \
  --exclude=tests/test_bench.py $PWD/tests/results/h100-2026-12-07-s46/experiments/T2-top1-reduce-on-e244d15.diff \
  > $L/t2tree.log 2>&1
# (4) s46c, cut (its own tarball, s47b-c.tgz): L, LA5, T2, T2A in turns, then T2A's tests and fusion A/B
RUN=s47b-c DL=$(( DEADLINE - ($(date +%s) - T0) )) SPECS="qwen qwen3-30b-a3b 16,64;llama llama4-scout 1" ROUNDS=2 \
  bash tests/results/h100-2026-12-07-s46/s46c.sh > $L/s46c.out 2>&1
cat $L/steps.txt; grep -h "passed\|failed" $L/triton_values.log | tail -1; cat $L/s46c.out
for f in $L/ab-*.log; do grep -h "M=" $f; done
for f in $L/res/deepseek.md $L/res/llama.md; do grep -E "^\| [0-9]+ \| (triton|cutlass|marlin|humming|bf16) \|" $f | awk -F'|' '{print $2, $3, $4, $8}'; done
