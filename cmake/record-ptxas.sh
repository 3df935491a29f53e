#!/bin/sh
# kvlens_cuda's CUDA compiler launcher (kernels/cuda/CMakeLists.txt):
#   record-ptxas.sh [ccache] nvcc … --resource-usage … -o OUT …
# runs the compile and keeps ptxas's report of each kernel (registers, stack frame,
# spills, static shared memory) in OUT.ptxas rather than in the build's log, for
# scripts/check-ptxas.sh. Everything else the compiler writes to stderr passes through,
# and its exit status is the launcher's. (ccache replays the report on a hit.)
set -u
out=
prev=
for a in "$@"; do
  if [ "$prev" = "-o" ]; then out=$a; fi
  prev=$a
done
if [ -z "$out" ]; then exec "$@"; fi
log="$out.stderr.$$"
"$@" 2>"$log"
status=$?
report='^ptxas info|^ +[0-9]+ bytes stack frame'
grep -E "$report" "$log" >"$out.ptxas"
grep -v -E "$report" "$log" >&2
rm -f "$log"
exit $status
