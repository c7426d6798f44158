# Sourced by this session's device scripts (NAME: the call, LIBS: the libraries to unpack from .carry/gs, each
# also as $G/<lib>/libmoe_fp4_cuda.so for LD_LIBRARY_PATH): the step runner of .carry/gpu/common.sh, a deadline
# of DL seconds, save() to bring the logs back.
set -u; source .carry/gpu/common.sh; L=/tmp/$NAME; DEADLINE=${DL:-560}
C=$(cat .carry/gpu/commit); export PYTHONPATH=.
G=/tmp/gs; mkdir -p $G; for f in .carry/gs/*.xz; do xz -dc $f > $G/$(basename $f .xz); done; chmod +x $G/sm90_gemm_check
for v in $LIBS; do mkdir -p $G/$v && cp $G/lib$v.so $G/$v/libmoe_fp4_cuda.so; done
save(){ tar czf $OUT/$NAME.tgz -C $L . ; }
env_record; mkdir -p $L/res
