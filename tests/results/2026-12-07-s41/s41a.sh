# s41a (prepared in session 41, not run: the device lent no machine that session). First the read floor of the
# decode weights (benchmarks/read_floor.py: a plain cold read of exactly the bytes of the touched experts, in one
# launch and in two dependent launches, beside the cutlass forward on the same routing, Qwen3 / Llama-4-Scout /
# DeepSeek-V3 at M = 1, 4, 16, 64), then session 40's prepared s40c (M3 against L at Qwen3 M = 1, the cutlass test
# files and memcheck on M3, the tail racecheck owed since s39a) with DL40C seconds (default 390).
# Carry: .carry, from tests/results/h100-2026-12-07-s40/prepare-carry.sh (libL is HEAD's csrc: unchanged since 69e799f).
set -u; L=/tmp/s41a; DEADLINE=${DL:-170}; source .carry/gpu/common.sh
export PYTHONPATH=.
env_record
mkdir -p /tmp/gs && xz -dc .carry/gs/libL.so.xz > /tmp/gs/libL.so
step read_floor 160 env MOE_FP4_LIB=/tmp/gs/libL.so python3 benchmarks/read_floor.py --out $L/read_floor \
  --commit $(cat .carry/gpu/commit)-L --backends cutlass --models qwen3-30b-a3b,llama4-scout,deepseek-v3 --tokens 1,4,16,64
tar czf $OUT/s41a.tgz -C $L .
cat $L/steps.txt; cat $L/read_floor/read_floor.md
DL=${DL40C:-390} bash tests/results/h100-2026-12-07-s40/s40c.sh
