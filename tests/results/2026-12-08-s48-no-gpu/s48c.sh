# s48c (prepared in session 48, which was lent no machine): two-warpgroup (8-warp) programs for the Triton values
# GEMM's middle rows, where triton still trails or barely passes Marlin (H100, sessions 46-47: Llama-4-Scout M = 128,
# 256, 512 at 1.01 / 0.98 / 1.01x; Qwen3 M = 128 at 0.97x; DeepSeek-V3 M = 256, 512 at 0.99 / 1.03x). No 8-warp
# variant of the 32- and 64-token swap tiles was ever swept. On sm_90 (probe_tiles.py, CPU) the 8-warp 32x128x128
# tile takes 75 registers a thread against 104 and a 296-instruction K loop a thread against 487 (its two
# warpgroups dequantize 64 weight rows each): 3 programs (24 warps) an SM against 4 (16 warps). The sweep first
# (each GEMM alone, both pinned, cold L2, one-ulp check), then the whole forward in turns for the rows a candidate
# could replace (fusion_ab.py --values-tile: every output compared with the unfused plan's). Beside them, the table's
# 32x128x128 tile capped at 96 registers (GemmConfig.maxnreg, new): no spills, 5 programs an SM against 4.
# Carry: .carry (common.sh).
set -u; R=${RUN:-s48c}; L=/tmp/$R; DEADLINE=${DL:-450}; source .carry/gpu/common.sh
export PYTHONPATH=.
R96=32,128,128,T,4,3,1,bits,0,96  # the table's 9-96 rows tile at most 96 registers a thread
SW="python3 benchmarks/sweep_triton_values.py --no-fused"  # then OUT.json --models --tokens --fields
AB="python3 benchmarks/fusion_ab.py --variants split-in-gemm --rounds 3"  # then --out OUT.json ...
env_record
step r8 50 $SW $L/r8.json --models qwen3-30b-a3b,llama4-scout --tokens 128 \
  --fields "16,64,256,T,4,3,0;16,128,256,T,8,3,0;16,128,128,T,8,4,0;16,128,128,T,8,3,0;32,128,128,T,8,3,1"
step r16 50 $SW $L/r16.json --models llama4-scout,qwen3-30b-a3b --tokens 256 \
  --fields "32,128,128,T,4,3,1;32,128,128,T,8,3,1;32,128,128,T,8,4,1;16,128,256,T,8,3,0;$R96"
step r32 50 $SW $L/r32.json --models llama4-scout,qwen3-30b-a3b --tokens 512 \
  --fields "64,128,128,T,4,3,1;64,128,128,T,8,3,1;32,128,128,T,8,3,1;32,128,128,T,4,3,1;$R96"
step ds 60 $SW $L/ds.json --models deepseek-v3 --tokens 256,512 \
  --fields "16,64,256,T,4,3,0;32,128,128,T,4,3,1;32,128,128,T,8,3,1;16,128,256,T,8,3,0;$R96"
tar czf $OUT/$R.tgz -C $L .
# The rows a candidate would replace (the 9-24 rows' long-K and narrow alternatives and the 25-96 rows' 64-token
# one still apply first, so these change Llama-4-Scout gemm1 and both of Qwen3's GEMMs at M = 256, and the
# GEMMs those alternatives leave to the row at M = 512).
step ab16 60 $AB --out $L/ab16.json --models llama4-scout,qwen3-30b-a3b --tokens 256 \
  --values-tile 24:32,128,128,T,8,3,1 --values-tile 24:$R96
step ab32 60 $AB --out $L/ab32.json --models llama4-scout,qwen3-30b-a3b --tokens 512 \
  --values-tile 96:32,128,128,T,8,3,1 --values-tile 96:$R96
step ab8 50 $AB --out $L/ab8.json --models qwen3-30b-a3b,llama4-scout --tokens 128 --values-tile 8:16,128,128,T,8,4,0
tar czf $OUT/$R.tgz -C $L .
cat $L/steps.txt
for f in $L/r*.log $L/ds.log; do echo "== $(basename $f)"; sed -n '/^best per/,$p' $f; done
for f in $L/ab*.log; do echo "== $(basename $f)"; grep -h "M=" $f | tail -8; done
