# SPDX-License-Identifier: Apache-2.0
# Turns src/cuda/*.cu into host C++ for the emulator (see run.sh): shared-memory declarations
# become static (one block runs at a time), kernel launches become emu::launch calls, and
# HILA_LAUNCH runs grid-stride kernels sequentially.
import pathlib
import re
import sys

root, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
HEAD = '''#include "cuda/runtime.cuh"
#undef HILA_LAUNCH
#define HILA_LAUNCH(kernel, n, s, ...) emu::launch_seq(kernel, dim3(grid_for(n)), __VA_ARGS__)
'''
SMEM = 'namespace hila::cuda { namespace { alignas(128) char smem[1 << 21]; } }\n'
LAUNCH = re.compile(r'([\w:]+(?:<[^;<>]*>)?)<<<(.*?),\s*256,\s*[^,]*,\s*stream>>>\((\w+)\);')


def kernels(path):
    t = path.read_text().replace('extern __shared__', 'extern').replace('__shared__', 'static')
    t = LAUNCH.sub(r'emu::launch(\1, dim3(\2), \3);', t)
    if '<<<' in t:
        sys.exit(f'gen.py: a launch in {path} does not have the form kernel<<<grid, 256, smem, stream>>>(args)')
    return t


for cu in sorted((root / 'src/cuda').glob('*.cu')):
    body = cu.read_text() if cu.name == 'backend.cu' else SMEM + kernels(cu)
    (out / f'emu_{cu.stem}.cpp').write_text(HEAD + body)
