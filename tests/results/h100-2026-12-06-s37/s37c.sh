# s37c: s37b.sh without its test and memcheck steps, run again with .peer carried (s37b's benchmark steps found no peer kit)
sed -e 's#/tmp/s37b#/tmp/s37c#; s#s37b.tgz#s37c.tgz#' -e '/^step cutlass/d; /^step memcheck/d' tests/results/h100-2026-12-06-s37/s37b.sh | V=F bash
