# s39d: where Qwen3's M = 1 GEMMs wait: Nsight Compute's per-instruction stall sampling (SourceCounters) on L
# built with line tables (LI: -DMOE_FP4_LINEINFO=ON, prepare-carry.sh), the source page as SASS with its CUDA lines.
set -u; L=/tmp/s39d; DEADLINE=${DL:-80}; source .carry/gpu/common.sh
G=/tmp/gs; mkdir -p $G; xz -dc .carry/gs/libLI.so.xz > $G/libmoe_fp4_cuda.so
export PYTHONPATH=. MOE_FP4_LIB=$G/libmoe_fp4_cuda.so
env_record
step ncu 50 /usr/local/cuda/bin/ncu --nvtx --nvtx-include forward/ -k regex:gemm_kernel --section SourceCounters --section WarpStateStats --import-source yes -o $L/ncu -f python3 benchmarks/kernel_breakdown.py --ncu --backend cutlass --model qwen3-30b-a3b --tokens 1
step source 20 bash -c "/usr/local/cuda/bin/ncu --import $L/ncu.ncu-rep --page source --csv --print-source cuda,sass > $L/source.csv; /usr/local/cuda/bin/ncu --import $L/ncu.ncu-rep --page details > $L/details.txt"
xz -T4 $L/source.csv; tar czf $OUT/s39d.tgz -C $L .; cat $L/steps.txt
