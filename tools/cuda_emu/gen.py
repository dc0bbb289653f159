# SPDX-License-Identifier: Apache-2.0
# Turns every .cu file under src/cuda into host C++ for the emulator (see run.sh: src/cuda/x/y.cu
# becomes OUT/emu_x_y.cpp), and the headers under src/cuda that declare shared memory into copies
# under OUT/cuda/ (same relative path), which the generated sources find first (a quoted include
# looks in the including file's directory before -I; so such a header must be included by the .cu
# files themselves, not through another header):
#   - `extern __shared__ [__align__(n)] TYPE name[];` becomes a pointer to the emulator's dynamic
#     shared-memory buffer, other `__shared__` variables become function statics (one block runs at
#     a time);
#   - every launch `kernel<<<grid, block[, smem[, stream]]>>>(args);` (any grid / block expression,
#     inside lambdas or guards) becomes emu::launch("kernel", kernel, dim3(grid), dim3(block), smem,
#     args) and HILA_LAUNCH runs grid-stride kernels sequentially (skipped in dry runs as on the GPU).
# Anything it cannot rewrite stops it with the file and line.
import pathlib
import re
import sys

root, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
HEAD = '''#include "cuda/runtime/runtime.cuh"
#undef HILA_LAUNCH
#define HILA_LAUNCH(kernel, n, s, ...)                                       \\
  do {                                                                       \\
    if (::hila::cuda::dry_run()) break;                                      \\
    emu::launch_seq(kernel, dim3(::hila::cuda::grid_for(n)), __VA_ARGS__);   \\
  } while (0)
'''
EXTERN = re.compile(r'extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([A-Za-z_][\w:]*(?:\s+[A-Za-z_][\w:]*)*)\s+(\w+)\s*\[\s*\]\s*;')
# kernel name: identifier or qualified id with optional template arguments, or a parenthesised expression
NAME = re.compile(r'(\([^;{}()]*\)|[A-Za-z_][\w:]*(?:<[^;{}()]*?>)?)\s*$')


def die(path, t, pos, msg):
    line = t.count('\n', 0, pos) + 1
    sys.exit(f'gen.py: {path}:{line}: {msg}')


def split_top(s):
    parts, depth, cur = [], 0, ''
    for c in s:
        if c in '([{':
            depth += 1
        elif c in ')]}':
            depth -= 1
        if c == ',' and depth == 0:
            parts.append(cur.strip())
            cur = ''
        else:
            cur += c
    parts.append(cur.strip())
    return parts


def balanced(t, i, path):  # t[i] == '(' -> index after the matching ')'
    depth = 0
    for j in range(i, len(t)):
        if t[j] == '(':
            depth += 1
        elif t[j] == ')':
            depth -= 1
            if depth == 0:
                return j + 1
    die(path, t, i, 'unbalanced parentheses in a launch')


def launches(t, path):
    res, i, n = [], 0, 0
    while (j := t.find('<<<', i)) >= 0:
        line_start = t.rfind('\n', 0, j) + 1
        m = NAME.search(t[line_start:j])
        if not m:
            die(path, t, j, 'cannot find the kernel name of a launch')
        kstart = line_start + m.start()
        kernel = m.group(1).strip()
        e = t.find('>>>', j)
        if e < 0:
            die(path, t, j, 'launch without >>>')
        cfg = split_top(t[j + 3:e])
        if not 2 <= len(cfg) <= 4 or not all(cfg):
            die(path, t, j, f'launch configuration <<<{t[j + 3:e]}>>> is not grid, block[, smem[, stream]]')
        p = e + 3
        while t[p].isspace():
            p += 1
        if t[p] != '(':
            die(path, t, p, 'launch arguments not found after >>>')
        q = balanced(t, p, path)
        args = t[p + 1:q - 1].strip()
        r = q
        while t[r].isspace():
            r += 1
        if t[r] != ';':
            die(path, t, r, 'a launch must be a statement of its own (kernel<<<...>>>(...);)')
        smem = cfg[2] if len(cfg) > 2 else '0'
        name = kernel.strip('()').split('<')[0].strip()
        call = f'emu::launch("{name}", {kernel}, dim3({cfg[0]}), dim3({cfg[1]}), size_t({smem})' + (f', {args}' if args else '') + ');'
        res.append(t[i:kstart] + call)
        i, n = r + 1, n + 1
    res.append(t[i:])
    return ''.join(res), n


def convert(path):
    t = path.read_text()
    t = EXTERN.sub(lambda m: f'{m.group(1)}* {m.group(2)} = reinterpret_cast<{m.group(1)}*>(::emu::dyn_smem);', t)
    if 'extern __shared__' in t or re.search(r'extern\s+__shared__', t):
        die(path, t, re.search(r'extern\s+__shared__', t).start(), 'dynamic shared memory declaration not of the form extern __shared__ [__align__(n)] TYPE name[];')
    t = re.sub(r'\b__shared__\b', 'static', t)
    t, n = launches(t, path)
    if '<<<' in t:
        die(path, t, t.index('<<<'), 'launch left unrewritten')
    return t, n


def emit(dst, text):
    if not dst.exists() or dst.read_text() != text:  # unchanged sources keep their objects (run.sh is incremental)
        dst.write_text(text)


src = root / 'src/cuda'
for cu in sorted(src.rglob('*.cu')):
    rel = cu.relative_to(src)
    body, n = convert(cu)
    emit(out / f"emu_{'_'.join(rel.with_suffix('').parts)}.cpp", HEAD + f'#line 1 "{cu}"\n' + body)
    print(f'gen.py: {cu.relative_to(root)}: {n} launches rewritten')
for h in sorted(src.rglob('*.cuh')):
    dst = out / 'cuda' / h.relative_to(src)
    if not re.search(r'\b__shared__\b', h.read_text()):
        dst.unlink(missing_ok=True)  # a stale copy would shadow the header
        continue
    body, n = convert(h)
    dst.parent.mkdir(parents=True, exist_ok=True)
    emit(dst, f'#line 1 "{h}"\n' + body)
    print(f'gen.py: {h.relative_to(root)}: {n} launches rewritten (header)')
# generated sources of .cu files that no longer exist would be compiled and linked: remove them
for old in out.glob('emu_*.cpp'):
    if not any(old.name == f"emu_{'_'.join(cu.relative_to(src).with_suffix('').parts)}.cpp" for cu in src.rglob('*.cu')):
        old.unlink()
