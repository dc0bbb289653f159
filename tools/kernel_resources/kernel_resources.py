#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Registers, spills and static shared memory of every CUDA kernel, from ptxas, without a GPU.

Compiles each .cu file under src/cuda for one target (default sm_90a, the Hopper path) with `-Xptxas -v` and
prints one line per kernel instance: registers, spill stores / loads (bytes), static shared memory.
Occupancy follows from the registers (65536 per SM) and the dynamic shared memory the launches ask
for; a change that adds registers or spills shows here before it runs on a GPU.

  python3 tools/kernel_resources/kernel_resources.py [--arch sm_90a] [--filter bfloat16] [--wide] [file.cu ...]
"""
import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def demangle(names):
    tool = shutil.which("c++filt")
    if not tool or not names:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names


def short(name):
    name = name.replace("(anonymous namespace)::", "").replace("hila::cuda::", "")
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # drop the argument list: the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0:
            cut = i
            break
    return name[:cut].replace("void ", "", 1)


def resources(src, arch, nvcc):
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-DHILA_WITH_CUDA=1", f"-I{ROOT}/include", f"-I{ROOT}/src", "-O3", "-DNDEBUG",
               f"-gencode=arch=compute_{arch[3:]},code={arch}", "-std=c++17", "--expt-relaxed-constexpr",
               "-Xptxas", "-v", "-c", src, "-o", os.path.join(tmp, "k.o")]
        p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"nvcc failed on {src}:\n{p.stderr[-4000:]}")
    rows, name, spill, smem = [], None, (0, 0), 0
    for line in p.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)'", line):
            name = m.group(1)
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spill = (int(m.group(1)), int(m.group(2)))
        elif m := re.search(r"Used (\d+) registers", line):
            s = re.search(r"(\d+) bytes smem", line)
            smem = int(s.group(1)) if s else 0
            rows.append([name, int(m.group(1)), spill, smem])
    for r, d in zip(rows, demangle([r[0] for r in rows])):
        r[0] = short(d)
    return os.path.relpath(src, os.path.join(ROOT, "src/cuda")), rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="sources (default: every .cu file under src/cuda)")
    ap.add_argument("--arch", default="sm_90a", help="sm_90a (default) or sm_80")
    ap.add_argument("--filter", default="", help="only kernels whose name contains this (e.g. bfloat16)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--wide", action="store_true", help="full kernel names, tab-separated (for diffs)")
    a = ap.parse_args()
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        sys.exit("kernel_resources: nvcc not found (PATH or /usr/local/cuda/bin)")
    srcs = a.files or sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, "src/cuda")) for f in fs
                             if f.endswith(".cu"))
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as ex:
        results = list(ex.map(lambda s: resources(s, a.arch, nvcc), srcs))
    if not a.wide:
        print(f"{'file':26s} {'kernel':72s} {'regs':>4s} {'spill st/ld':>12s} {'smem':>6s}")
    for fname, rows in results:
        for name, regs, (st, ld), smem in rows:
            if a.filter not in name:
                continue
            if a.wide:
                print(f"{fname}\t{name}\t{regs}\t{st}/{ld}\t{smem}")
            else:
                print(f"{fname:26s} {name[:72]:72s} {regs:4d} {f'{st}/{ld}':>12s} {smem:6d}")


if __name__ == "__main__":
    main()
