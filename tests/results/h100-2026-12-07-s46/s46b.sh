# s46b: the Triton values GEMM's launch table on the H100 where triton trails Marlin most (session 42, H100):
# DeepSeek-V3 M = 256 (8 rows per expert, 0.79x Marlin: its GEMMs read 2.05-2.26 TB/s on the table's 16x128x128
# five-stage tile, where M = 64's 16x64x256 decode tile read 2.68-2.91), M = 1024 (32 rows, 0.93x), Llama-4-Scout
# M = 256 (16 rows, 0.95x) and Qwen3 M = 16 / 64 (decode, 0.96x). sweep_triton_values.py per (layer, M), the table's
# tile first, each candidate pinned for both GEMMs and checked within one bf16 ulp of one-expert reference GEMMs,
# CUDA-graph replays, cold L2. The rows-per-expert bands' neighbours ride along (Qwen3 and Llama-4-Scout M = 128 at 8
# rows, Qwen3 M = 256 at 16, Llama-4-Scout and Qwen3 M = 1024 at 64). Between them the likeliest changes in the
# whole forward (fusion_ab.py --values-tile: the default plan against the same plan with one row of the values table
# changed, in turns, three rounds): 4-8 rows per expert on the decode tile (16x64x256, 3 stages), 25-96 rows on the
# 32x128x128 four-stage swap tile (the H200's best at DeepSeek-V3 M = 1024 in session 10, not taken then). No carry.
set -u; R=${RUN:-s46b}; L=/tmp/$R; DEADLINE=${DL:-540}; source tests/results/h100-2026-12-06-s39/common.sh
export PYTHONPATH=.
save(){ tar czf $OUT/$R.tgz -C $L . ; }
sw() { local n=$1 t=$2; shift 2; step $n $t python3 benchmarks/sweep_triton_values.py $L/$n.json --no-fused "$@"; save; }
env_record
# 8 rows per expert: the decode tile (16x64x256, 3 stages) and deeper or wider rings beside the table's 16x128x128x5
R8="16,64,256,T,4,3,0;16,64,256,T,4,4,0;16,128,256,T,4,3,0;16,64,128,T,4,6,0;16,128,128,T,8,4,0;16,64,128,T,4,4,0"
sw ds256 150 --models deepseek-v3 --tokens 256 --fields "$R8"
ab() { local n=$1 t=$2; shift 2; step $n $t python3 benchmarks/fusion_ab.py --variants split-in-gemm --rounds 3 \
  --out $L/$n.json "$@"; save; }
ab ab8-ds 90 --models deepseek-v3 --tokens 256 --values-tile 8:16,64,256,T,4,3,0
ab ab8 60 --models qwen3-30b-a3b,llama4-scout --tokens 128 --values-tile 8:16,64,256,T,4,3,0
sw r8 100 --models qwen3-30b-a3b,llama4-scout --tokens 128 --fields "$R8"
# 32 rows per expert (DeepSeek-V3 M = 1024): swap tiles of 32 and 64 tokens beside the table's 64x128 mma tile
R32="32,128,128,T,4,4,1;32,128,128,T,4,3,1;64,64,128,T,4,3,1;64,128,128,F,4,4,1;32,128,128,T,4,5,1;32,64,128,T,4,4,1"
sw ds1024 130 --models deepseek-v3 --tokens 1024 --fields "$R32"
ab ab96-ds 90 --models deepseek-v3 --tokens 1024 --values-tile 96:32,128,128,T,4,4,1
ab ab96 60 --models qwen3-30b-a3b,llama4-scout --tokens 512,1024 --values-tile 96:32,128,128,T,4,4,1
# 16 rows per expert (Llama-4-Scout and Qwen3 M = 256)
R16="32,64,128,T,4,4,1;32,128,128,T,4,4,1;32,64,256,T,4,3,1;32,64,128,T,4,6,1;32,128,128,T,8,4,1;32,64,128,T,4,4,0"
sw r16 100 --models llama4-scout,qwen3-30b-a3b --tokens 256 --fields "$R16"
# decode (Qwen3 M = 16 and 64)
RD="16,64,256,T,4,4,0;16,64,128,T,4,4,0;16,128,128,T,4,5,0;16,64,512,T,4,2,0;16,32,256,T,4,4,0;16,128,256,T,4,3,0"
sw qdec 80 --models qwen3-30b-a3b --tokens 16,64 --fields "$RD"
# 64 rows (Llama-4-Scout and Qwen3 M = 1024) on the 32-row list
sw r64 80 --models llama4-scout,qwen3-30b-a3b --tokens 1024 --fields "$R32"
cat $L/steps.txt
for f in $L/*.log; do echo "== $(basename $f)"; sed -n '/^best per/,$p' $f; grep -h "M=" $f | grep -v "^  " | grep "unfused"; done
