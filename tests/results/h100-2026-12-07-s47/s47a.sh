# s47a: the Triton values table's 9-24 and 25-96 rows per expert, where triton still trails Marlin (session 46, H100:
# Llama-4-Scout M = 256 at 0.95x, M = 512 at 0.96x, Qwen3 M = 128 at 0.97x). Session 46's sweep at 16 rows tried
# 32-token tiles only, and its gemm1 on the 32x128x128 tile read 1.9 TB/s (Llama-4-Scout M = 256: 401 us), where the
# 16x64x256 three-stage decode tile read 2.9 at 4 rows (M = 64: 258 us on nearly the same weights). At 16 rows per
# expert a 16-token tile reads an expert's weights twice where it has more than 16 rows, unless the second row tile
# finds them in the L2: measured here. sweep_triton_values.py at 16 rows (Llama-4-Scout, Qwen3 M = 256, DeepSeek-V3
# M = 512) and 32 rows (Llama-4-Scout, Qwen3 M = 512) with 16-token and 64-token tiles, then the whole forward in
# turns (fusion_ab.py --values-tile), then the Triton GPU tests session 46 owes (test_triton_moe.py, complete).
set -u; R=${RUN:-s47a}; L=/tmp/$R; DEADLINE=${DL:-560}; source tests/results/h100-2026-12-06-s39/common.sh
export PYTHONPATH=.
save(){ tar czf $OUT/$R.tgz -C $L . ; }
sw() { local n=$1 t=$2; shift 2; step $n $t python3 benchmarks/sweep_triton_values.py $L/$n.json --no-fused "$@"; save; }
ab() { local n=$1 t=$2; shift 2; step $n $t python3 benchmarks/fusion_ab.py --variants split-in-gemm --rounds 3 \
  --out $L/$n.json "$@"; save; }
env_record
R16="16,64,256,T,4,3,0;16,64,256,T,4,3,1;16,128,256,T,4,3,0;16,64,128,T,4,3,0;32,64,128,T,4,3,0;32,64,256,T,4,3,0"
sw r16 60 --models llama4-scout,qwen3-30b-a3b --tokens 256 --fields "$R16"
ab ab24 60 --models llama4-scout,qwen3-30b-a3b --tokens 256 --values-tile 24:16,64,256,T,4,3,0 \
  --values-tile 24:16,64,256,T,4,3,1
R32="16,64,256,T,4,3,0;16,64,256,T,4,3,1;64,128,128,T,4,3,1;64,64,256,T,4,3,1;32,64,256,T,4,3,1;32,128,256,T,4,3,1"
sw r32 60 --models llama4-scout,qwen3-30b-a3b --tokens 512 --fields "$R32"
ab ab96 60 --models llama4-scout,qwen3-30b-a3b --tokens 512 --values-tile 96:16,64,256,T,4,3,0 \
  --values-tile 96:64,128,128,T,4,3,1
sw ds16 60 --models deepseek-v3 --tokens 512 --fields "$R16"
ab ab24-ds 45 --models deepseek-v3 --tokens 512 --values-tile 24:16,64,256,T,4,3,0 --values-tile 24:16,64,256,T,4,3,1
step triton_moe 330 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs tests/test_triton_moe.py
save
cat $L/steps.txt; tail -2 $L/triton_moe.log
for f in $L/r16.log $L/r32.log $L/ds16.log; do echo "== $(basename $f)"; sed -n '/^best per/,$p' $f; grep -v "^best\|silu" $f | grep -o "M=[0-9]* gemm[12] [^ ]*.*us" ; done
for f in $L/ab*.log; do echo "== $(basename $f)"; grep -h "M=" $f | tail -12; done
