#!/usr/bin/python3
"""Prints each kernel's SASS instruction count in a cubin, or in a .cu file compiled to one.

    scripts/kernel-sizes.py kernels/cuda/flash_prefill_bf16.cu     # nvcc -arch=sm_90 -cubin
    scripts/kernel-sizes.py build/x.cubin
    scripts/kernel-sizes.py --arch sm_90 A.cu B.cu
    scripts/kernel-sizes.py /tmp/other-worktree/kernels/cuda/attention.cu   # its own includes

Without a GPU or a disassembler (this machine's CUDA has nvcc and ptxas, not cuobjdump),
a kernel's .text section is what ptxas made of it: on sm_70 and later every instruction is
16 bytes, so its size counts instructions. Compare two builds of one file to see what a
change adds or removes: a loop's body appears once unless ptxas duplicates it, so an
instruction taken out of an unrolled loop shows up as many times as the loop unrolls it.
Rows: instructions, then the kernel's demangled name (kvlens's namespaces left out).
"""
import argparse
import os
import struct
import subprocess
import sys
import tempfile


def text_sections(path):
    """(name, bytes) of each .text.<symbol> section of the ELF file at path."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise SystemExit(f"{path}: not a 64-bit ELF file (a cubin)")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]  # the section-name table's file offset
    for h in headers:
        start = names + h[0]
        name = data[start : data.index(b"\0", start)].decode()
        if name.startswith(".text."):
            yield name[len(".text.") :], h[5]


def demangle(symbols):
    out = subprocess.run(["c++filt"], input="\n".join(symbols), capture_output=True, text=True)
    names = out.stdout.splitlines() if out.returncode == 0 else symbols
    short = []
    for n in names:
        n = n.replace("kvlens::kernels::cuda::", "").replace("(anonymous namespace)::", "")
        short.append(n.split("(")[0].removeprefix("void "))
    return short


def repo_root(source):
    """The checkout holding source (its includes are relative to it), else this script's."""
    top = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(source)), "rev-parse",
                          "--show-toplevel"], capture_output=True, text=True)
    if top.returncode == 0:
        return top.stdout.strip()
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cubin_of(source, arch, workdir):
    root = repo_root(source)
    out = os.path.join(workdir, os.path.basename(source) + ".cubin")
    cmd = ["nvcc", "-std=c++17", f"-arch={arch}", "-O3", "-cubin", "-I", root, "-o", out, source]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"nvcc failed on {source}")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help=".cu sources (compiled with nvcc) or cubins")
    parser.add_argument("--arch", default="sm_90", help="nvcc -arch for .cu files (sm_90)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.files:
            cubin = cubin_of(path, args.arch, tmp) if path.endswith(".cu") else path
            sections = sorted(text_sections(cubin))
            for (_, size), name in zip(sections, demangle([s for s, _ in sections])):
                print(f"{size // 16:7d}  {name}")


if __name__ == "__main__":
    sys.exit(main())
