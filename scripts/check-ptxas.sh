#!/bin/sh
# scripts/check-ptxas.sh OBJECT_DIR SOURCE_DIR [MAX_SPILL_BYTES]: reads the report ptxas
# gave for every kernel of kvlens_cuda (OBJECT_DIR/*.ptxas, written at compile time by
# cmake/record-ptxas.sh), prints it as a table (registers, stack frame, spill stores
# and loads, static shared memory, kernel), and fails where a GPU would, or where a GPU
# session would find a kernel slow, that the CUDA emulator cannot see:
#   - a kernel without __launch_bounds__ (found in SOURCE_DIR's .cu files) using more
#     than 64 registers: a block of 1024 threads (RmsNormKernel's, LayerNormKernel's)
#     would not fit the SM's 65536 registers, and its launch fails. (A bounded kernel
#     gets ptxas's registers to fit its bound, and the emulator checks launches
#     against the bound.)
#   - a kernel spilling more than MAX_SPILL_BYTES (default 24, the most any kernel
#     spilled with nvcc 13.0 on 2026-12-07) of registers to local memory a thread.
# The numbers are this nvcc's for this build's architectures; a GPU machine's own nvcc
# (scripts/gpu-check.sh builds there) may allocate differently.
set -eu
objects=$1
sources=$2
max_spill=${3:-24}
reports=$(find "$objects" -name '*.ptxas' | sort)
if [ -z "$reports" ]; then
  echo "check-ptxas.sh: no *.ptxas reports under $objects (was kvlens_cuda built with cmake/record-ptxas.sh?)" >&2
  exit 1
fi
# Kernels declared with __launch_bounds__: the name after the bound's arguments.
bounded=$(for f in "$sources"/*.cu; do tr '\n' ' ' <"$f"; echo; done |
  grep -o -E '__global__ void __launch_bounds__\(([^()]|\(([^()]|\([^()]*\))*\))*\) *[A-Za-z_][A-Za-z0-9_]*\(' |
  sed -E 's/.*\) *([A-Za-z_][A-Za-z0-9_]*)\($/\1/' | sort -u | tr '\n' ' ')
if [ -z "$bounded" ]; then
  echo "check-ptxas.sh: found no __launch_bounds__ kernels in $sources" >&2
  exit 1
fi
# One line a kernel: registers stack spill-stores spill-loads static-smem mangled-name.
# shellcheck disable=SC2086
awk '
  /Compiling entry function/ { match($0, /\047[^\047]*\047/); k = substr($0, RSTART + 1, RLENGTH - 2) }
  /bytes stack frame/ && k != "" { stack = $1; stores = $5; loads = $9 }
  /Used [0-9]+ registers/ && k != "" {
    r = $0; sub(/.*Used /, "", r); sub(/ registers.*/, "", r)
    smem = 0
    if (match($0, /[0-9]+ bytes smem/)) { smem = substr($0, RSTART, RLENGTH); sub(/ .*/, "", smem) }
    print r, stack, stores, loads, smem, k
    k = ""
  }' $reports | c++filt | sed -E 's/kvlens::kernels::cuda::\(anonymous namespace\):://g' |
  awk -v bounded="$bounded" -v max_spill="$max_spill" '
    BEGIN {
      nb = split(bounded, b, " ")
      for (i = 1; i <= nb; ++i) is_bounded[b[i]] = 1
      printf "%5s %6s %7s %6s %6s  %s\n", "regs", "stack", "spill", "loads", "smem", "kernel"
    }
    {
      name = $6
      for (i = 7; i <= NF; ++i) name = name " " $i
      base = name
      sub(/^void /, "", base)
      sub(/[<(].*/, "", base)
      printf "%5d %6d %7d %6d %6d  %s\n", $1, $2, $3, $4, $5, name
      ++kernels
      if ($3 > 0) ++spilling
      if ($3 > max_spill) bad[++nbad] = sprintf("%s spills %d bytes a thread, more than %d", name, $3, max_spill)
      if (!(base in is_bounded) && $1 > 64) {
        bad[++nbad] = sprintf("%s has no __launch_bounds__ and uses %d registers: a block of 1024 threads would not launch (at most 64)", name, $1)
      }
      seen[base] = 1
    }
    END {
      for (k in is_bounded) if (!(k in seen)) bad[++nbad] = "no report for " k ", declared with __launch_bounds__"
      printf "%d kernels, %d spilling (at most %d bytes allowed)\n", kernels, spilling, max_spill
      for (i = 1; i <= nbad; ++i) print "check-ptxas.sh: " bad[i] > "/dev/stderr"
      exit (nbad > 0)
    }'
