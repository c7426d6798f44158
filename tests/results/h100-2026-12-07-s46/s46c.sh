# s46c (prepared in session 46, not run): does T2 (the top-1 reduce in the second GEMM's epilogue) cost plans that do
# not fuse only where their main loops start? s45a found T2's library 0.5-2 % slower on plans that do not fuse (Qwen3
# M = 16 and 64, Llama-4-Scout and DeepSeek-V3 M = 1), with the persistent small tiles' loops L's instructions (other
# register names) but starting elsewhere in a 128-byte block. Four libraries in turns, two rounds, the cutlass forward
# (default plans: nothing fuses the top-1 reduce) on Qwen3 M = 16, 64, Llama-4-Scout M = 1, 4, 64 and DeepSeek-V3
# M = 1, 4: L (the tree's csrc), LA5 (L's loops moved as T2 moved the 8-token persistent kernel's, nothing else),
# T2, and T2A (T2 with every small-tile loop moved back to L's place: t2a_offsets.log). L and LA5 run in the tree's
# Python (ABI 11), T2 and T2A in the T2 tree's (ABI 12). Then T2A's top-1 tests and its fusion in the forward
# (fusion_ab.py --backend cutlass, fused against top1, Llama-4-Scout). If LA5 loses what T2 loses and T2A does not,
# T2A can land (FUSE_TOP1_REDUCE on, after its own tests and memcheck); if T2A loses as T2 does, the start is not
# the cause. Carry: .carry (prepare-carry-t2a.sh). SPECS ("name model tokens" triples, ';' between) and ROUNDS
# (added in session 47, which ran it cut: s47b.sh) narrow the turns.
set -u; R=${RUN:-s46c}; L=/tmp/$R; DEADLINE=${DL:-520}; source .carry/gpu/common.sh
C=$(cat .carry/gpu/head)
G=/tmp/gs; mkdir -p $G /tmp/t2; for v in L LA5 T2 T2A; do xz -dc .carry/gs/lib$v.so.xz > $G/lib$v.so; done
[ -f .carry/gpu/t2tree.tar.xz ] && xz -dc .carry/gpu/t2tree.tar.xz | tar x -C /tmp/t2  # (else the caller made /tmp/t2)
save(){ tar czf $OUT/$R.tgz -C $L . ; }
bench() {  # bench NAME LIB DIR BENCH-ARGS...: the cutlass forward, default plans, in DIR's Python on LIB
  local name=$1 lib=$2 dir=$3; shift 3
  step $name 60 env -C $dir MOE_FP4_LIB=$G/lib$lib.so PYTHONPATH=$dir python3 -m moe_fp4 bench --backends cutlass \
    --no-overhead --budget-ms 20 --no-plot --out $L/res --name $name --commit $C-$lib "$@"
}
env_record; mkdir -p $L/res
IFS=';' read -ra specs <<< "${SPECS:-qwen qwen3-30b-a3b 16,64;llama llama4-scout 1,4,64;ds deepseek-v3 1,4}"
for r in $(seq ${ROUNDS:-2}); do
  for m in "${specs[@]}"; do
    read -r n model tokens <<< "$m"
    for v in L LA5 T2 T2A; do
      dir=$PWD; [ ${v:0:2} = T2 ] && dir=/tmp/t2
      bench $n-$v-r$r $v $dir --model $model --tokens $tokens
    done
  done
  save
done
step tests_top1 120 env -C /tmp/t2 MOE_FP4_LIB=$G/libT2A.so PYTHONPATH=/tmp/t2 python3 -m pytest -q -p no:cacheprovider \
  tests/test_cutlass_sm90.py -k "gemm_top1 or top1_reduce or issue_grid_top1"
step ab_llama 90 env -C /tmp/t2 MOE_FP4_LIB=$G/libT2A.so PYTHONPATH=/tmp/t2 python3 benchmarks/fusion_ab.py \
  --backend cutlass --models llama4-scout --tokens 1,4,16,64 --rounds 3 --variants fused,top1 --out $L/ab_llama.json
save
cat $L/steps.txt; tail -3 $L/tests_top1.log; grep -h "M=" $L/ab_llama.log
for f in $L/res/*.md; do echo "$(basename $f)"; grep -h "cutlass |" $f | awk -F'|' '{print $2, $4}' | tr '\n' ' '; echo; done
