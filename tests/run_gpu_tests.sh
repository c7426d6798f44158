#!/usr/bin/env bash
# Every test file that has GPU-marked tests, run on a GPU one pytest process per file, so that a run cut short
# keeps each finished file's result and one file's crash does not hide the others.
#
#   PYTHONPATH=. bash tests/run_gpu_tests.sh OUTDIR      (from the repository root; python with torch + triton)
#
# Writes, in OUTDIR: <file>.log (pytest's output) and summary.txt (the GPU, driver, torch, triton, commit and date,
# then per file its exit status, seconds and pytest's last line). Exits 1 if a file failed, timed out or was not
# reached, 2 on bad usage.
#
# Environment: PYTHON (default: python), GPU_TEST_FILES (space-separated names such as test_compile.py, in the
# order to run; default: every tests/test_*.py with a gpu mark, by name), GPU_TEST_TIMEOUT (seconds per file,
# default 1800), GPU_TEST_DEADLINE (seconds for the whole run, default none: files past it are not run and count
# as not reached), PYTEST_ARGS (default: -m gpu; empty runs each file whole, its CPU-sized cases on the GPU too),
# GPU_TEST_COMMIT (the commit to record, default git's HEAD; a copy of the tree may carry stale git metadata: the
# device's copy reported 293be99 for a 0d38ce3 tree, tests/results/h100-2026-12-07-s43).
#
# Why: the GPU tests are skipped in CI (no GPU), and a file that no call ran can go stale unnoticed (the
# reduce-overhead compile test of the cutlass backend failed for three days: tests/results/h100-2026-12-07-s42/).
set -u -o pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: PYTHONPATH=. bash tests/run_gpu_tests.sh OUTDIR" >&2
  exit 2
fi
OUT=$1
PY=${PYTHON:-python}
TIMEOUT=${GPU_TEST_TIMEOUT:-1800}
DEADLINE=${GPU_TEST_DEADLINE:-}
ARGS=${PYTEST_ARGS--m gpu}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
if [[ -n "${GPU_TEST_FILES:-}" ]]; then
  read -r -d "" -a FILES <<< "$GPU_TEST_FILES" || true  # names split on any whitespace, newlines too
else
  mapfile -t FILES < <(cd "$HERE" && grep -l "pytest.mark.gpu" test_*.py | sort)
fi

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" 2>&1
  echo "commit ${GPU_TEST_COMMIT:-$(git -C "$HERE" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  echo "pytest args: ${ARGS:-(none)}; timeout ${TIMEOUT} s per file; deadline ${DEADLINE:-none}"
  printf "%-36s %-12s %8s  %s\n" file status seconds "pytest's last line"
} > "$OUT/summary.txt"

start=$(date +%s)
bad=0
for f in "${FILES[@]}"; do
  now=$(date +%s)
  if [[ -n "$DEADLINE" ]] && (( now - start >= DEADLINE )); then
    printf "%-36s %-12s %8s  %s\n" "$f" "not-reached" - - >> "$OUT/summary.txt"
    bad=1
    continue
  fi
  t=$TIMEOUT
  if [[ -n "$DEADLINE" ]] && (( DEADLINE - (now - start) < t )); then t=$(( DEADLINE - (now - start) )); fi
  # shellcheck disable=SC2086  # ARGS is a list of pytest arguments
  timeout "$t" "$PY" -m pytest -q -p no:cacheprovider -rfEs $ARGS "$HERE/$f" > "$OUT/${f%.py}.log" 2>&1
  rc=$?
  status=ok
  if (( rc == 124 )); then status=timed-out; elif (( rc == 5 )); then status=no-tests; elif (( rc != 0 )); then status="failed($rc)"; fi
  [[ $status == ok || $status == no-tests ]] || bad=1
  printf "%-36s %-12s %8s  %s\n" "$f" "$status" "$(( $(date +%s) - now ))" \
    "$(grep -E "passed|failed|error|skipped|deselected|no tests ran" "$OUT/${f%.py}.log" | tail -1)" >> "$OUT/summary.txt"
done
cat "$OUT/summary.txt"
exit $bad
