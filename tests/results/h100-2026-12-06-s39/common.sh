# Device helpers sourced by this session's call scripts: env_record writes the machine, driver and versions to
# $L/env.txt (making $L first); step NAME TIMEOUT CMD... runs CMD with its output in $L/NAME.log and a line in
# $L/steps.txt, skipped once DEADLINE seconds have passed since this file was sourced, its timeout clamped to them.
T0=$(date +%s)
env_record() {
  mkdir -p $L
  { date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    nvcc --version | tail -1; } > $L/env.txt 2>&1
}
step() {
  local name=$1 t=$2; shift 2
  mkdir -p $L
  local now=$(date +%s); local left=$(( ${DEADLINE:-100000} - (now - T0) ))
  if [ $left -le 5 ]; then printf "%-28s SKIPPED (deadline)  %s\n" "$name" "$*" >> $L/steps.txt; return 0; fi
  [ $t -gt $left ] && t=$left
  local s=$(date +%s.%N)
  PYTHONUNBUFFERED=1 timeout $t "$@" > $L/$name.log 2>&1
  local rc=$?
  printf "%-28s rc=%-4s %7.1fs  %s\n" "$name" "$rc" "$(python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" $s $(date +%s.%N))" "$*" >> $L/steps.txt
  return 0
}
