#!/bin/sh
# translate_cu.sh IN OUT: rewrites the two CUDA constructs that are not C++ so that g++
# can compile a kernels/cuda/*.cu file, or a .cuh header, against the emulator
# (emu_device.h):
#   kernel<<<grid, block, shared, stream>>>(args)
#     -> ::kvlens_emu::Launch(kernel, "kernel", grid, block, shared, stream)(args)
#   extern __shared__ __align__(N) T name[];
#     -> T* name = static_cast<T*>(::kvlens_emu::DynamicShared());
# and two that the emulator's launch checks must see: a kernel's static shared memory
# (which StaticShared also fills with NaN at each block's first declaration),
#   __shared__ T name[N];
#     -> __shared__ T name[N]; ::kvlens_emu::StaticShared(&name, sizeof name);
# and its __launch_bounds__, moved into its body (launch_bounds.awk, next to this script).
# Lines keep their numbers (and #line names the original), so diagnostics point at IN.
# Fails if a launch or an extern __shared__ survives the rewrite outside a // comment.
set -eu
in=$1
out=$2
{
  printf '#line 1 "%s"\n' "$in"
  sed -E \
    -e 's/extern __shared__ (__align__\([0-9]+\) )?([A-Za-z_][A-Za-z0-9_ ]*[A-Za-z0-9_]) ([A-Za-z_][A-Za-z0-9_]*)\[\];/\2* \3 = static_cast<\2*>(::kvlens_emu::DynamicShared());/' \
    -e 's/([A-Za-z_][A-Za-z0-9_:]*(<[^<>]*>)?)<<<([^;]*)>>>/::kvlens_emu::Launch(\1, "\1", \3)/g' \
    -e 's/^([[:space:]]*)__shared__ (.*[^A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)((\[[^];]*\])*);(.*)$/\1__shared__ \2\3\4; ::kvlens_emu::StaticShared(\&\3, sizeof \3);\6/' \
    "$in" | awk -f "$(dirname "$0")/launch_bounds.awk"
} >"$out.tmp"
if sed 's://.*$::' "$out.tmp" | grep -n -E '<<<|>>>|extern __shared__' >&2; then
  echo "translate_cu.sh: $in has a construct the emulator cannot rewrite (above)" >&2
  rm -f "$out.tmp"
  exit 1
fi
mv "$out.tmp" "$out"
