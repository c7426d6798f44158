# Sourced by the call scripts after common.sh (L, C set): the landed library from .carry as MOE_FP4_LIB, Humming's
# wheel on the path, $L/res for the tables, and P (the peer kit's arguments) and B (the benchmark command) for steps.
mkdir -p /tmp/gs $L/res
xz -dc .carry/gs/libL.so.xz > /tmp/gs/libmoe_fp4_cuda.so
export PYTHONPATH=.:/tmp/site MOE_FP4_LIB=/tmp/gs/libmoe_fp4_cuda.so
P="--peer-lib .peer/vllm026_moe_C_sm90only.so.xz --peer-kit .peer"
B="python3 -m moe_fp4 bench --no-overhead --budget-ms 20 --no-plot --out $L/res --commit $C"
step pip 30 pip install --no-deps --no-index .peer/wheels/humming_kernels-0.1.19-cp310-abi3-manylinux_2_28_x86_64.whl --target /tmp/site
# All three layers with every peer and the cutlass and triton rows, a tarball after each (save, the caller's).
every_peer() {
  local name model t tokens
  for spec in "qwen qwen3-30b-a3b 110 -" "llama llama4-scout 70 -" "deepseek deepseek-v3 70 1,4,16,64,256,1024,4096"; do
    read -r name model t tokens <<< "$spec"
    step $name $t $B --backends cutlass,triton --model $model --name $name $P $([ "$tokens" = - ] || echo --tokens $tokens)
    save
  done
}
