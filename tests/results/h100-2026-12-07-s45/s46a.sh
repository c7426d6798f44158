# s46a (prepared in session 45, not run): does where a small tile's main loop starts change its speed?
# Experiment T2 (the top-1 reduce in the second GEMM's epilogue) cost plans that do not fuse 1-2 % (s45a) with their
# main loops the same instructions as L's; what it did change is where each small-tile kernel's loop starts (the
# 8-token persistent kernel's first HGMMA at 0x48d0 instead of 0x4980: 80 bytes into a 128-byte block instead of
# on one). LA<i> moves the same loops by 16 <i> bytes with nothing else changed (loop_offsets.py). The cutlass
# forward on L and LA1..LA7 in turns: Qwen3 M = 16 and 64 (the 8-token persistent kernel for both GEMMs), two
# rounds; then L against LA5 (T2's alignment for that kernel) on Llama-4-Scout M = 1, 4, 64 and DeepSeek-V3 M = 1, 4.
# If LA5 loses what T2 lost, the alignment is the cause, and T2 (or any change to these kernels) can be landed with
# its loops moved back. Carry: .carry (prepare-carry-la.sh).
set -u; R=${RUN:-s46a}; L=/tmp/$R; DEADLINE=${DL:-420}; source .carry/gpu/common.sh
C=$(cat .carry/gpu/head)
G=/tmp/gs; mkdir -p $G; for v in L LA1 LA2 LA3 LA4 LA5 LA6 LA7; do xz -dc .carry/gs/lib$v.so.xz > $G/lib$v.so; done
export PYTHONPATH=.
save(){ tar czf $OUT/$R.tgz -C $L . ; }
bench() {  # bench NAME LIB BENCH-ARGS...: the cutlass forward, default plans, on LIB
  local name=$1 lib=$2; shift 2
  step $name 60 env MOE_FP4_LIB=$G/lib$lib.so python3 -m moe_fp4 bench --backends cutlass --no-overhead \
    --budget-ms 20 --no-plot --out $L/res --name $name --commit $C-$lib "$@"
}
env_record; mkdir -p $L/res
for r in 1 2; do
  for v in L LA1 LA2 LA3 LA4 LA5 LA6 LA7; do bench qwen-$v-r$r $v --model qwen3-30b-a3b --tokens 16,64; done
  save
done
for r in 1 2; do
  for v in L LA5; do
    bench llama-$v-r$r $v --model llama4-scout --tokens 1,4,64
    bench ds-$v-r$r $v --model deepseek-v3 --tokens 1,4
  done
  save
done
cat $L/steps.txt
for f in $L/res/*.md; do echo "$(basename $f)"; grep -h "cutlass |" $f | awk -F'|' '{print $2, $4}' | tr '\n' ' '; echo; done
