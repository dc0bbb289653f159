# SPDX-License-Identifier: Apache-2.0
"""CLI round trip: write inputs as safetensors, run `hila run`, read the outputs back."""
import itertools
import shlex
import subprocess
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file


class HilaError(AssertionError):
    """`hila run` exited non-zero; the message carries the command line and its stderr."""


class Outputs(dict):
    """The tensors hila wrote, plus the command line that produced them (for failure messages)."""

    def __init__(self, tensors, cmd):
        super().__init__(tensors)
        self.cmd = cmd


class Hila:
    def __init__(self, binary, workdir, timeout=120):
        self.binary = str(binary)
        self.workdir = Path(workdir)
        self.timeout = timeout
        self._ids = itertools.count()

    def command(self, op, form, in_path, out_path, *, backward=False, chunk=None, options=()):
        cmd = [self.binary, "run", "--op", op, "--form", form, "--in", str(in_path), "--out", str(out_path)]
        if backward:
            cmd.append("--backward")
        if chunk is not None:
            cmd += ["--chunk", str(chunk)]
        return cmd + [str(x) for x in options]

    def run(self, op, form, inputs, *, backward=False, chunk=None, options=()):
        """Run one op; returns {name: ndarray} of everything hila wrote."""
        n = next(self._ids)
        in_path = self.workdir / f"in{n}.safetensors"
        out_path = self.workdir / f"out{n}.safetensors"
        save_file({k: np.ascontiguousarray(v) for k, v in inputs.items()}, str(in_path))
        cmd = self.command(op, form, in_path, out_path, backward=backward, chunk=chunk, options=options)
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired as exc:
            raise HilaError(f"timeout after {self.timeout}s: {shlex.join(cmd)}") from exc
        if res.returncode != 0:
            raise HilaError(f"hila exited {res.returncode}: {shlex.join(cmd)}\n"
                            f"stderr: {res.stderr.strip()[-4000:]}\nstdout: {res.stdout.strip()[-2000:]}")
        if not out_path.exists():
            raise HilaError(f"hila wrote no output file: {shlex.join(cmd)}")
        return Outputs(load_file(str(out_path)), shlex.join(cmd))
