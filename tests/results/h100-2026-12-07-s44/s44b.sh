# s44b (run, 2026-12-07): the top-1 reduce in the second GEMM's epilogue (moe_fp4_sm90_gemm_top1, ABI 12) on its
# first GPU. It ran on the tree of 8e62d75 with experiments/T2-...diff applied and csrc/gemm_sm90.cu as
# experiments/T1-first-form-gemm_sm90.cu.diff has it (the first form), that csrc built as libT1: its tests (bit for bit against the GEMM and moe_fp4_moe_reduce), the whole forward with
# and without it (benchmarks/fusion_ab.py --backend cutlass: variants fused / top1 / unfused in one process, in
# turns, outputs compared bit for bit), the new kernels' code against L's where nothing fuses (moe-fp4 bench, L
# from session 44's first commit's tree, ABI 11, in turns), and memcheck on its small cases.
# Carry: .carry (bash tests/results/h100-2026-12-07-s44/prepare-carry.sh).
# RUN=s44c DS=1: s44c's call (s44c.sh): its own names, and DeepSeek-V3 M = 1 and 4 in the rounds.
set -u; R=${RUN:-s44b}; L=/tmp/$R; DEADLINE=${DL:-520}; source .carry/gpu/common.sh
C=$(cat .carry/gpu/head)
G=/tmp/gs; mkdir -p $G /tmp/m; for v in L T1; do xz -dc .carry/gs/lib$v.so.xz > $G/lib$v.so; done
xz -dc .carry/gpu/base.tar.xz | tar x -C /tmp/m  # the Python of the L library (ABI 11)
export PYTHONPATH=. MOE_FP4_LIB=$G/libT1.so
save(){ tar czf $OUT/$R.tgz -C $L . ; }
env_record
step tests_top1 200 python3 -m pytest -q -p no:cacheprovider tests/test_cutlass_sm90.py -k "gemm_top1 or top1_reduce or issue_grid_top1"
save
step ab_llama 150 python3 benchmarks/fusion_ab.py --backend cutlass --models llama4-scout --tokens 1,4,16,64 \
  --rounds 3 --timeline --out $L/ab_llama.json
save
bench() {  # bench NAME LIB DIR BENCH-ARGS...: the cutlass forward, default plans, in DIR's Python on LIB
  local name=$1 lib=$2 dir=$3; shift 3
  step $name 60 env -C $dir MOE_FP4_LIB=$G/lib$lib.so PYTHONPATH=$dir python3 -m moe_fp4 bench --backends cutlass \
    --no-overhead --budget-ms 20 --no-plot --out $L/res --name $name --commit $C-$lib "$@"
}
mkdir -p $L/res
for r in 1 2; do
  bench qwen-L-r$r L /tmp/m --model qwen3-30b-a3b --tokens 1,16,64,1024
  bench qwen-T1-r$r T1 $PWD --model qwen3-30b-a3b --tokens 1,16,64,1024
  bench llama-L-r$r L /tmp/m --model llama4-scout --tokens 1,4,64
  bench llama-T1-r$r T1 $PWD --model llama4-scout --tokens 1,4,64
  if [ -n "${DS:-}" ]; then
    bench ds-L-r$r L /tmp/m --model deepseek-v3 --tokens 1,4
    bench ds-T1-r$r T1 $PWD --model deepseek-v3 --tokens 1,4
  fi
  save
done
step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q -p no:cacheprovider \
  tests/test_cutlass_sm90.py -k "gemm_top1 and (m3- or m5- or m9- or served)"
save
cat $L/steps.txt; tail -3 $L/tests_top1.log; grep -h "M=" $L/ab_llama.log
for f in $L/res/*.md; do echo "$(basename $f)"; grep -h "cutlass |" $f | awk -F'|' '{print $2, $4}' | tr '\n' ' '; echo; done
tail -4 $L/memcheck.log
