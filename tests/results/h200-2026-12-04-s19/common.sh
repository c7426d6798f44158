# helpers for device calls (session 19): env_record, step NAME TIMEOUT CMD..., with_peers CALL
# (with_peers was moved here from the scripts of calls 4 and 5 after they ran: the same commands)
env_record() {
  { date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    nvcc --version | tail -1; } > $L/env.txt 2>&1
}
step() {
  local name=$1 t=$2; shift 2
  local s=$(date +%s.%N)
  PYTHONUNBUFFERED=1 timeout $t "$@" > $L/$name.log 2>&1
  local rc=$?
  printf "%-28s rc=%-4s %7.1fs  %s\n" "$name" "$rc" "$(python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" $s $(date +%s.%N))" "$*" >> $L/steps.txt
  return 0
}

# Call CALL's preamble with the peers: results in /tmp/CALL (as $L), the environment recorded, the
# session's library, the Humming wheel installed, and save() packing $L into $OUT/CALL.tgz.
with_peers() {
  L=/tmp/$1; mkdir -p $L/res
  env_record
  export MOE_FP4_LIB=$PWD/.carry/s19/libmoe_fp4_cuda.so
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peer/wheels/*.whl > $L/humming_install.log 2>&1
  export PYTHONPATH=.:/tmp/site
  eval "save() { tar czf \$OUT/$1.tgz -C \$L .; }"
}
