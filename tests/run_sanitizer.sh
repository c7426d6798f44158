#!/usr/bin/env bash
# tests/sanitizer_workload.py under compute-sanitizer's memcheck, initcheck, racecheck and synccheck.
#
#   PYTHONPATH=. bash tests/run_sanitizer.sh OUTDIR      (from the repository root; python with torch + triton)
#
# Writes, in OUTDIR:
#   plain.log      the workload without a sanitizer (its checks must pass; it also fills the Triton
#                  kernel cache OUTDIR/triton-cache, so the sanitized runs load kernels, not compile them)
#   <tool>.log     the workload under each tool: the tool's report and the workload's own lines
#   summary.txt    per run: exit status, the error count of the tool's summary line, the workload's
#                  check line; and the GPU, driver, compute-sanitizer, commit and date
# Exits 1 if the plain run failed, or a tool reported errors, exited non-zero or left no summary line
# (it did not finish); 2 on bad usage.
#
# Environment: PYTHON (default: python), COMPUTE_SANITIZER (default: on PATH, else the newest
# /usr/local/cuda*/bin/compute-sanitizer), SANITIZER_TOOLS (default: all four), SANITIZER_TIMEOUT
# (seconds per run, default 1800).
#
# Options, and why:
# * PYTORCH_NO_CUDA_MEMORY_CACHING=1 in every run: each tensor is its own cudaMalloc. Otherwise torch's
#   caching allocator carves tensors out of large blocks, so memcheck cannot see an access past the
#   end of a tensor that stays inside its block, and initcheck takes the bytes an earlier tensor left
#   in a reused block for initialized data.
# Every option is given as --name=value (a value-optional option would take a separate word for the
# program to run).
# * --error-exitcode=1; --show-backtrace=device (host backtraces of a Python process are libpython frames).
# * memcheck: --padding=4096 (a guard after each allocation, so that an access just past one tensor does
#   not land in the next one, where it would look valid); --leak-check=no (torch keeps allocations).
# * initcheck: no options (unused-memory tracking is off by default; compute-sanitizer 2025.3 takes
#   --track-unused-memory as a bare flag that turns it on and refuses "=no").
# * racecheck: --racecheck-report=analysis (the default, one report per hazard found); errors counted.
# * synccheck: no options.
# No kernel filter: every kernel of the process is checked (torch's too; the workload computes its
# references on the CPU, so the GPU runs little else), so nothing of moe_fp4's is silently left out.
set -u -o pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: PYTHONPATH=. bash tests/run_sanitizer.sh OUTDIR" >&2
  exit 2
fi
OUT=$1
mkdir -p "$OUT" || exit 2
PY=${PYTHON:-python}
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | sort -V | tail -1)}
TOOLS=${SANITIZER_TOOLS:-memcheck initcheck racecheck synccheck}
LIMIT=${SANITIZER_TIMEOUT:-1800}
WORKLOAD=tests/sanitizer_workload.py
if [[ ! -f $WORKLOAD ]]; then
  echo "run_sanitizer.sh: run it from the repository root ($WORKLOAD not found)" >&2
  exit 2
fi
if [[ -z $SAN || ! -x $SAN ]]; then
  echo "run_sanitizer.sh: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
  exit 2
fi
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$OUT/triton-cache}

SUMMARY=$OUT/summary.txt
{
  echo "compute-sanitizer run of $WORKLOAD, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "sanitizer: $SAN ($("$SAN" --version 2>/dev/null | grep -i version | head -1))"
  echo "env: PYTORCH_NO_CUDA_MEMORY_CACHING=1 TRITON_CACHE_DIR=$TRITON_CACHE_DIR"
  printf '%-10s %-5s %-8s %s\n' run exit errors workload
} >"$SUMMARY"

# The workload's closing line: "<N> checks, <F> failed, <L> left out".
checks_line() { grep -E '^[0-9]+ checks, [0-9]+ failed' "$1" | tail -1; }

failed=0
t0=$SECONDS
timeout "$LIMIT" "$PY" "$WORKLOAD" >"$OUT/plain.log" 2>&1
rc=$?
line=$(checks_line "$OUT/plain.log")
printf '%-10s %-5s %-8s %s\n' plain "$rc" - "${line:-no check line (the workload did not finish)}" >>"$SUMMARY"
echo "plain: exit $rc, ${line:-no check line} ($((SECONDS - t0)) s)"
if [[ $rc -ne 0 ]]; then
  failed=1
fi

for tool in $TOOLS; do
  case $tool in
    memcheck) opts=(--padding=4096 --leak-check=no) ;;
    initcheck) opts=() ;;
    racecheck) opts=(--racecheck-report=analysis) ;;
    synccheck) opts=() ;;
    *)
      echo "run_sanitizer.sh: unknown tool $tool" >&2
      exit 2
      ;;
  esac
  log=$OUT/$tool.log
  t0=$SECONDS
  timeout "$LIMIT" "$SAN" --tool="$tool" --error-exitcode=1 --show-backtrace=device ${opts[@]+"${opts[@]}"} \
    "$PY" "$WORKLOAD" >"$log" 2>&1
  rc=$?
  # memcheck, initcheck, synccheck: "========= ERROR SUMMARY: N errors";
  # racecheck: "========= RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)".
  if [[ $tool == racecheck ]]; then
    errors=$(grep -oE 'RACECHECK SUMMARY: .*\(([0-9]+) errors?' "$log" | grep -oE '\(([0-9]+)' | tr -d '(' | tail -1)
  else
    errors=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1)
  fi
  line=$(checks_line "$log")
  printf '%-10s %-5s %-8s %s\n' "$tool" "$rc" "${errors:-none}" "${line:-no check line (the workload did not finish)}" \
    >>"$SUMMARY"
  echo "$tool: exit $rc, errors ${errors:-none (no summary line)}, ${line:-no check line} ($((SECONDS - t0)) s)"
  if [[ $rc -ne 0 || -z ${errors:-} || ${errors:-1} -ne 0 ]]; then
    failed=1
  fi
done

echo "result: $([[ $failed -eq 0 ]] && echo clean || echo 'ERRORS (see the logs)')" >>"$SUMMARY"
cat "$SUMMARY"
exit $failed
