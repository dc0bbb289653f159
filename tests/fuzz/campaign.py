# SPDX-License-Identifier: Apache-2.0
"""A generated campaign against the `hila` CLI and the Python package, as a hostile or careless user
would try them. Families: malformed safetensors files (mutated headers and offsets, duplicate
keys, gaps, trailing bytes), bad shapes, dtypes and options, NaN/Inf inputs, sizes that overflow
or exceed memory, non-regular and padded inputs, failing writes (file-size limit, --out = --in),
resets and huge negative gates (checked against the serial form), finite inputs that overflow,
every option combined on valid inputs (checked against the serial form), `demo` / `verify` / top
level arguments, environment knobs (HILA_MAX_MEMORY, OMP_NUM_THREADS) set to garbage; and for
Python: T = 0 arrays, bfloat16, wrong argument types, shared decode states, views across growth,
positions at the bound, then generated calls of the whole API (introspection, forward, backward,
step, step_, DecodeState methods, threads, hila.torch functions and layers) in batches.

Every case is classified: ok (exit 0 or a result), rejected (exit 2 / HilaError), or a finding:
crash (a signal), hang (timeout), internal (exit 3, another exit code, or an exception other than
HilaError), unnamed (a HilaError naming no argument), destroyed (a failed run changed an existing
output), nonfinite (a non-finite result, value checks on), inexact (a form off the serial form by
more than 1e-6 float32 / 1e-12 float64, lost decode steps, a failed check of verify / demo).
Prints one line per family and the findings; exits 1 if there is any. docs/DEVELOPING.md lists
the families with their case counts.

    python3 tests/fuzz/campaign.py --hila build/hila [--python python3] [--cases N] [--seed S]
        [--families fam_a,fam_b] [--save-findings findings.json]
"""
import argparse
import json
import os
import random
import resource
import struct
import subprocess
import sys
import tempfile
import textwrap
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
import stfile  # noqa: E402

OPS = ["gla", "hla2", "ahla", "hla3", "loglinear", "loglinear_hla2", "loglinear_ahla", "loglinear_hla3",
       "gdn", "loglinear_gdn"]
FORMS = ["naive", "serial", "chunk", "scan"]


class Campaign:
    def __init__(self, hila, python, workdir, rng, timeout):
        self.hila, self.python, self.dir, self.rng, self.timeout = hila, python, Path(workdir), rng, timeout
        self.counts = defaultdict(Counter)
        self.findings = []
        self.reproducers = []  # full commands / snippets of the findings (--save-findings)
        self.n = 0

    def pick(self, seq):
        """One element of seq (any mix of types, unlike Generator.choice)."""
        seq = list(seq)
        return seq[int(self.rng.integers(len(seq)))]

    # ---- running --------------------------------------------------------------------------------
    def cli(self, family, tensors_or_bytes, args, *, fsize=None, out=None, keep_out=False, env=None):
        """Runs `hila run`; classifies; returns (rc, out path)."""
        self.n += 1
        inp = self.dir / f"in{self.n}.st"
        if isinstance(tensors_or_bytes, (bytes, bytearray)):
            inp.write_bytes(tensors_or_bytes)
        elif isinstance(tensors_or_bytes, Path):
            inp = tensors_or_bytes
        else:
            stfile.write(inp, tensors_or_bytes)
        out = out or self.dir / f"out{self.n}.st"
        before = out.read_bytes() if out.exists() and out.is_file() else None
        cmd = [self.hila, "run", "--in", str(inp), "--out", str(out), *map(str, args)]

        def pre():
            resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))
            if fsize is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        try:
            r = subprocess.run(cmd, capture_output=True, timeout=self.timeout, preexec_fn=pre,
                               env=None if env is None else {**os.environ, **env})
        except subprocess.TimeoutExpired:
            return self.finding(family, "hang", cmd), out
        err = r.stderr.decode(errors="replace")[-300:]
        if r.returncode < 0:
            return self.finding(family, "crash", cmd, f"signal {-r.returncode}: {err}"), out
        if r.returncode == 3 or (r.returncode not in (0, 2)):
            return self.finding(family, "internal", cmd, f"exit {r.returncode}: {err}"), out
        if r.returncode == 2 and before is not None and (not out.exists() or out.read_bytes() != before):
            return self.finding(family, "destroyed", cmd, err), out
        if r.returncode == 0 and "--no-check-values" not in args:
            bad = nonfinite_tensor(out)
            if bad:
                return self.finding(family, "nonfinite", cmd, bad), out
        self.counts[family]["ok" if r.returncode == 0 else "rejected"] += 1
        if not keep_out and r.returncode == 0 and out.exists() and out.stat().st_size > (1 << 20):
            out.unlink()
        return r.returncode, out

    def py(self, family, code):
        self.n += 1
        prog = "import numpy as np, hila, threading\n" + textwrap.dedent(code)
        try:
            r = subprocess.run([self.python, "-c", prog], capture_output=True, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            return self.finding(family, "hang", ["python", code[:80]])
        err = r.stderr.decode(errors="replace")[-400:]
        if r.returncode < 0:
            return self.finding(family, "crash", ["python", code[:80]], f"signal {-r.returncode}: {err}")
        out = r.stdout.decode()
        if r.returncode != 0:
            kind = "nonfinite" if "NONFINITE" in err else "inexact" if "INEXACT" in err else "internal"
            return self.finding(family, kind, ["python", code[:120]], err)
        self.counts[family]["rejected" if "REJECTED" in out else "ok"] += 1
        return 0

    def finding(self, family, kind, cmd, detail=""):
        self.counts[family][kind] += 1
        self.findings.append((family, kind, " ".join(map(str, cmd))[:300], detail))
        self.reproducers.append({"family": family, "kind": kind, "cmd": list(map(str, cmd)), "detail": detail})
        return kind

    # ---- inputs ---------------------------------------------------------------------------------
    def inputs(self, op, B=1, T=8, G=1, H=1, dk=4, dv=4, dtype=np.float32, gates=True):
        r = self.rng
        t = {"q": (r.standard_normal((B, T, G, dk)) / np.sqrt(dk)).astype(dtype),
             "k": (r.standard_normal((B, T, G, dk)) / np.sqrt(dk)).astype(dtype),
             "v": r.standard_normal((B, T, H, dv)).astype(dtype)}
        if gates:
            t["g"] = r.uniform(np.log(0.7), 0, (B, T, H)).astype(np.float64 if dtype == np.float64 else np.float32)
        if op.startswith("loglinear"):
            t["lam"] = r.uniform(0.2, 1.2, (B, T, H, max(1, int(T).bit_length() + 1))).astype(dtype)
        if op.endswith("gdn"):
            t["beta"] = r.uniform(0, 1, (B, T, H)).astype(dtype)
        return t


def nonfinite_tensor(path):
    """Name of the first tensor of a hila output file with a non-finite float, or None."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    for name, e in header.items():
        if name == "__metadata__" or e["dtype"] not in ("F32", "F64"):
            continue
        a, b = e["data_offsets"]
        if b - a > (64 << 20):
            continue
        x = np.frombuffer(raw[base + a:base + b], np.float32 if e["dtype"] == "F32" else np.float64)
        if not np.isfinite(x).all():
            return name
    return None


# ---- families -------------------------------------------------------------------------------------

def fam_malformed(c, n):
    for _ in range(n):
        op = c.pick(OPS)
        header, data = stfile.header_and_data(c.inputs(op))
        raw = bytearray(stfile.encode(header, data))
        kind = c.rng.integers(6)
        if kind == 0:  # random byte flips anywhere
            for _ in range(c.rng.integers(1, 8)):
                raw[c.rng.integers(len(raw))] = c.rng.integers(256)
        elif kind == 1:  # header length field
            raw[:8] = struct.pack("<Q", int(c.pick([0, 1, 7, len(raw), 2**63, 2**64 - 1, 100 << 20, 101 << 20])))
        elif kind == 2:  # offsets / shapes / dtypes rewritten in the JSON
            name = c.pick([k for k in header])
            field = c.pick(["data_offsets", "shape", "dtype"])
            header[name][field] = c.pick([[0, 0], [-1, 4], [2**64, 2**64 + 4], [0, 2**63], "F8", "U8", 7,
                                                [1, 2**62, 1, 4], [2**32, 0, 2**32, 2], [0], [], [1] * 8])
            raw = bytearray(stfile.encode(header, data))
        elif kind == 3:  # truncation / trailing bytes / gaps
            cut = int(c.rng.integers(8, len(raw)))
            raw = raw[:cut] if c.rng.random() < 0.5 else raw + bytes(int(c.rng.integers(1, 64)))
        elif kind == 4:  # duplicate keys, deep nesting, junk JSON
            body = c.pick([b'{"q":1,"q":2}', b'[' * 5000 + b']' * 5000, b'{"a":' * 50 + b'1' + b'}' * 50,
                                 b'{"__metadata__":{"x":1}}', b'\xff\xfe', b'{"q":{"dtype":"F32","shape":[1],'
                                 b'"data_offsets":[0,4]},"q":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'])
            raw = bytearray(stfile.encode(None, bytes(8), raw_header=bytes(body)))
        else:  # overlapping tensors
            names = list(header)
            header[names[-1]]["data_offsets"] = header[names[0]]["data_offsets"]
            raw = bytearray(stfile.encode(header, data))
        c.cli("malformed file", bytes(raw), ["--op", op])


def fam_bad_args(c, n):
    for _ in range(n):
        op = c.pick(OPS)
        t = c.inputs(op, B=int(c.rng.integers(1, 3)), T=int(c.rng.integers(0, 9)))
        choice = c.rng.integers(8)
        args = ["--op", op, "--form", c.pick(FORMS + ["bogus"])]
        if choice == 0:
            name = c.pick(list(t))
            t[name] = t[name].reshape(-1)[: max(1, t[name].size - 1)]
        elif choice == 1:
            name = c.pick(list(t))
            t[name] = t[name].astype(c.pick([np.float64, np.float16, np.int32, np.int64]))
        elif choice == 2:
            args += ["--chunk", c.pick([0, -1, 3, 6, 2**40, 1])]
        elif choice == 3:
            args += c.pick([["--normalize"], ["--gates", "untied"], ["--ridge", "1"], ["--qk-l2norm"],
                                  ["--eps", "-1"], ["--scale", "nan"], ["--scale", "inf"], ["--backward"]])
        elif choice == 4:
            t["cu_seqlens"] = c.pick([np.array([0, 3, 1], np.int64), np.array([1, 8], np.int64),
                                            np.array([0], np.int64), np.array([0, 2**62, 8], np.int64),
                                            np.array([0, -2**63, 8], np.int64)])
        elif choice == 5:
            t["h0.pos"] = np.array([c.pick([-1, 2**62, 2**63 - 1, 3])] * t["q"].shape[0], np.int64)
        elif choice == 6:
            t["extra"] = np.zeros(3, np.float32)
        else:
            args += ["--backward"]
            t["do"] = np.zeros_like(t["v"])
        c.cli("bad shapes/dtypes/options", t, args)


def fam_nonfinite_inputs(c, n):
    for _ in range(n):
        op = c.pick(OPS)
        t = c.inputs(op)
        name = c.pick(list(t))
        flat = t[name].reshape(-1)
        flat[c.rng.integers(flat.size)] = c.pick([np.nan, np.inf, -np.inf, 1.0])
        c.cli("NaN/Inf inputs", t, ["--op", op, "--form", c.pick(FORMS)])


def empty(shape, dt="F32"):
    return (dt, shape, b"")


def fam_sizes(c, n):
    cases = []
    for op in ("gla", "loglinear", "hla2", "gdn"):
        extra = {"lam": empty([1, 0, 2**16, 1])} if op == "loglinear" else {}
        extra.update({"beta": empty([1, 0, 2**16])} if op == "gdn" else {})
        cases.append(({"q": empty([1, 0, 1, 2**32]), "k": empty([1, 0, 1, 2**32]), "v": empty([1, 0, 2**16, 2**16]),
                       **extra}, ["--op", op]))
    for B in (2**28, 2**40, 2**61, 2**62):
        cases.append(({x: empty([B, 0, 1, 4]) for x in "qkv"}, ["--op", "gla", "--max-memory", "1G"]))
    cases.append(({x: empty([1, 0, 1, 2**20]) for x in "qkv"}, ["--op", "gla"]))
    cases.append(({"q": empty([1, 0, 1, 2**31]), "k": empty([1, 0, 1, 2**31]), "v": empty([1, 0, 1, 4])},
                  ["--op", "hla2"]))
    cases.append(({**{x: empty([1, 0, 1, 4]) for x in "qkv"}, "cu_seqlens": np.zeros(2_000_001, np.int64)},
                  ["--op", "gla", "--max-memory", "64M"]))
    cases.append(({x: empty([0, 2**40, 1, 4]) for x in "qkv"}, ["--op", "gla"]))
    cases.append(({x: empty([0, 2**40, 2**12, 2**20]) for x in "qkv"}, ["--op", "gla"]))
    big = c.inputs("gla", T=32768, gates=False)
    cases.append((big, ["--op", "gla", "--form", "naive", "--max-memory", "2G"]))
    for _ in range(n):
        dims = [int(c.pick([0, 1, 3, 2**20, 2**31, 2**40, 2**62])) for _ in range(4)]
        cases.append(({"q": empty(dims), "k": empty(dims), "v": empty([dims[0], dims[1], 1, 4])},
                      ["--op", c.pick(OPS), "--max-memory", "1G"]))
    for t, args in cases:
        c.cli("sizes", t, args)


def fam_files(c, n):
    fifo = c.dir / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    valid = c.dir / "valid.st"
    stfile.write(valid, c.inputs("gla"))
    padded = c.dir / "padded.st"
    padded.write_bytes(valid.read_bytes())
    os.truncate(padded, 6 << 30)
    for p in (c.dir, Path("/dev/zero"), Path("/dev/null"), fifo, padded, c.dir / "missing.st"):
        c.cli("non-regular / padded inputs", p, ["--op", "gla"])
    for _ in range(n):
        # failing writes over an existing output: file-size limit
        t = c.inputs("gla", T=int(c.rng.integers(64, 4096)), dv=16)
        out = c.dir / "keep.st"
        out.write_bytes(b"previous output " * int(c.rng.integers(1, 100)))
        c.cli("failed writes", t, ["--op", "gla"], fsize=int(c.rng.integers(64, 32768)), out=out)
    # --out = --in by several paths
    link = c.dir / "link.st"
    if not link.exists():
        link.symlink_to(valid)
    for out in (valid, link, c.dir / "." / "valid.st", c.dir):
        c.cli("failed writes", valid, ["--op", "gla"], out=out)
    ro = c.dir / "ro"
    ro.mkdir(exist_ok=True)
    os.chmod(ro, 0o500)
    c.cli("failed writes", valid, ["--op", "gla"], out=ro / "o.st")


def fam_resets(c, n):
    """Reset tokens (-inf, <= -1e30, large finite negatives) against the serial form."""
    from safetensors.numpy import load_file
    for _ in range(n):
        op = c.pick(OPS)
        dtype = c.pick([np.float32, np.float64])
        T = int(c.rng.integers(4, 40))
        t = c.inputs(op, T=T, dtype=dtype)
        for _ in range(int(c.rng.integers(1, 4))):
            t["g"][0, int(c.rng.integers(T)), :] = c.pick([-np.inf, -1e30, -6e36, -1e20, -1e12, -1e9, -1e6])
        chunk = int(c.pick([1, 2, 4, 8, 16]))
        rc, ref_path = c.cli("resets vs serial", t, ["--op", op, "--form", "serial"], keep_out=True)
        if rc != 0:
            continue
        ref = load_file(str(ref_path))["o"].astype(np.float64)
        for form in ("naive", "chunk", "scan"):
            rc, p = c.cli("resets vs serial", t, ["--op", op, "--form", form, "--chunk", chunk], keep_out=True)
            if rc != 0:
                c.finding("resets vs serial", "internal", [op, form], "a reset input was rejected")
                continue
            got = load_file(str(p))["o"].astype(np.float64)
            tol = 1e-12 if dtype == np.float64 else 1e-6
            err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-300)
            if err > tol:
                c.finding("resets vs serial", "inexact", [op, form, dtype.__name__, f"chunk {chunk}"], f"err {err:.3g}")


def fam_overflow(c, n):
    t = c.inputs("gla", T=16)
    cases = [("gla", {**t, "g": np.full((1, 16, 1), -6e36, np.float32)}, []),
             ("gla", t, ["--scale", "1e308"]),
             ("hla2", {**t, "q": np.full_like(t["q"], 1e20), "k": np.full_like(t["k"], 1e20)}, []),
             ("hla2", {**t, "q": np.zeros_like(t["q"])}, ["--normalize", "--eps", "0"]),
             ("gdn", {**c.inputs("gdn", T=16), "beta": np.full((1, 16, 1), 1e30, np.float32)}, [])]
    k = c.rng.standard_normal((1, 512, 1, 4)).astype(np.float32)
    cases.append(("gdn", {**c.inputs("gdn", T=512), "k": 3 * k / np.linalg.norm(k, axis=-1, keepdims=True),
                          "beta": np.ones((1, 512, 1), np.float32)}, []))
    for _ in range(n):
        op = c.pick(OPS)
        tt = c.inputs(op, T=int(c.rng.integers(1, 64)))
        for name in c.rng.choice(list(tt), size=int(c.rng.integers(1, 3))):
            if name == "g":
                tt[name][...] = c.pick([-1e38, -3e38, -1e30])
            else:
                tt[name] = (tt[name] * c.pick([1e10, 1e19, 1e30, 1e38])).astype(tt[name].dtype)
        cases.append((op, tt, c.pick([[], ["--scale", "1e30"], ["--form", "naive"], ["--form", "scan"]])))
    for op, tt, args in cases:
        c.cli("finite inputs that overflow", tt, ["--op", op, *args])


PY_CASES = {
    "python T = 0 / bf16 / types": [
        "q = np.zeros((1,0,1,4), np.float32); o, f = hila.forward('hla2', q, q, q, output_final_state=True)",
        "q = np.zeros((2,0,1,4), np.float64); g = hila.backward('gla', q, q, q, do=q)",
        "import ml_dtypes\nq = np.ones((1,4,1,4), ml_dtypes.bfloat16); o, _ = hila.forward('gla', q, q, q)\n"
        "assert o.dtype == ml_dtypes.bfloat16",
        "try: hila.forward('gla', np.zeros((1,2,1,2),np.float32), 'x', None)\n"
        "except hila.HilaError: print('REJECTED')",
        "try: hila.forward('gla', *[np.zeros((1,2,1,2),np.float32)]*3, chunk='x')\nexcept hila.HilaError: print('REJECTED')",
        "try: hila.DecodeState('gla', '1', 1, 2, 2)\nexcept hila.HilaError: print('REJECTED')",
        "try: hila.DecodeState('gla', 1, 1, 2, 2).reserve(-1)\nexcept hila.HilaError: print('REJECTED')",
        "try: hila.DecodeState('gla', 1, 1, 2**31, 2**31)\nexcept hila.HilaError: print('REJECTED')",
    ],
    "python shared decode states": [
        """
        st = hila.DecodeState('{op}', 1, 1, 4, 4)
        x = np.ones((1,1,4), np.float32) * 0.1
        kw = {{}}
        if hila.op_traits('{op}')['loglinear']: kw['lam'] = np.ones((1,1,12), np.float32)
        if hila.op_traits('{op}')['delta']: kw['beta'] = np.full((1,1), .5, np.float32)
        def run():
            for i in range(100): st.step(x, x, x, np.full((1,1), -0.1, np.float32), **kw)
        ts = [threading.Thread(target=run) for _ in range(8)]
        [t.start() for t in ts]; [t.join() for t in ts]
        import sys
        if st.position(0) != 800: sys.exit('INEXACT lost steps: %d' % st.position(0))
        """,
        """
        st = hila.State(np.zeros(1, np.int64), None, None, np.zeros((1,1,4,4), np.float32))
        x = np.ones((1,1,4), np.float32) * 0.1
        def run():
            for i in range(125): hila.step_('gla', x, x, x, state=st)
        ts = [threading.Thread(target=run) for _ in range(8)]
        [t.start() for t in ts]; [t.join() for t in ts]
        import sys
        if st.pos[0] != 1000: sys.exit('INEXACT lost steps: %d' % st.pos[0])
        """,
        """
        st = hila.DecodeState('{op}', 1, 1, 4, 4)
        x = np.ones((1,1,4), np.float32) * 0.1
        kw = {{}}
        if hila.op_traits('{op}')['loglinear']: kw['lam'] = np.ones((1,1,12), np.float32)
        if hila.op_traits('{op}')['delta']: kw['beta'] = np.full((1,1), .5, np.float32)
        st.step(x, x, x, **kw); v = st.view()
        for i in range(600): st.step(x, x, x, **kw)
        s = float(v.H.sum()); v.H[...] = 5.0; v.pos[...] = 3
        assert st.position(0) == 601
        """,
        """
        H = np.zeros((1,1,4,4), np.float32); st = hila.DecodeState('gla', 1, 1, 4, 4)
        try: st.load(hila.State(np.array([{pos}], np.int64), None, None, H)); st.step(*[np.ones((1,1,4), np.float32)]*3)
        except hila.HilaError: print('REJECTED')
        """,
    ],
}


def fam_python(c, n):
    for code in PY_CASES["python T = 0 / bf16 / types"]:
        c.py("python T = 0 / bf16 / types", code)
    for _ in range(max(1, n)):
        for code in PY_CASES["python shared decode states"]:
            c.py("python shared decode states",
                 code.format(op=c.pick(OPS), pos=int(c.pick([2**62, 2**62 - 1, 2**63 - 1, -1, 0]))))


# ---- Python API surfaces beyond forward: generated calls run in batches in one interpreter ------

# Run by the child interpreter: exec each generated snippet (it binds `r`), classify, one JSON line each.
PY_CHILD = r'''
import json, sys, math, threading
import numpy as np, hila
try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None
def nonfinite(x, depth=0):
    if depth > 4 or x is None:
        return False
    if isinstance(x, (tuple, list)):
        return any(nonfinite(y, depth + 1) for y in x)
    if isinstance(x, dict):
        return any(nonfinite(y, depth + 1) for y in x.values())
    if hasattr(x, "detach") and hasattr(x, "is_floating_point"):
        return bool(x.is_floating_point() and x.device.type == "cpu" and not x.detach().float().isfinite().all())
    if isinstance(x, np.ndarray) and x.dtype.kind == "f" or (ml_dtypes and isinstance(x, np.ndarray) and x.dtype.name == "bfloat16"):
        return not np.isfinite(x.astype(np.float64)).all()
    if isinstance(x, float):
        return not math.isfinite(x)
    return False
def attempt(rejected):
    """_t(f): f(), or None when it raises HilaError (kept in `rejected`): a sequence of calls goes on
    past a rejected one."""
    def _t(f):
        try:
            return f()
        except hila.HilaError as e:
            rejected.append(e)
    return _t
for code in json.loads(sys.stdin.read()):
    rejected = []
    ns = {"np": np, "hila": hila, "threading": threading, "ml_dtypes": ml_dtypes, "r": None, "_t": attempt(rejected)}
    try:
        exec(code, ns)
        unnamed = [e for e in rejected if not e.argument]
        # a step that failed its output check has advanced the state (documented): its values are the ones
        # the error named, so the state is not checked after one
        overflowed = any("from finite inputs" in str(e) for e in rejected)
        kind = ("unnamed" if unnamed else "nonfinite" if "# no-value-checks" not in code and not overflowed and
                nonfinite(ns["r"]) else "rejected" if rejected else "ok")
        detail = str(unnamed[0])[:200] if unnamed else ""
    except hila.HilaError as e:
        kind = "rejected" if e.argument else "unnamed"
        detail = str(e)[:200]
    except Exception as e:
        kind, detail = "internal", f"{type(e).__name__}: {str(e)[:200]}"
    print(json.dumps([kind, detail]), flush=True)
'''


def py_batch(c, family, codes, env=None):
    """Runs generated snippets in one interpreter; a crash or hang is pinned on the snippet that was
    running, and the rest run again in a fresh interpreter."""
    # hila's memory limit at 4 GiB (the checks come before any allocation near it) and an address
    # space limit as the CLI's: a case that slips past the checks fails instead of swapping the machine
    e = {**os.environ, "HILA_MAX_MEMORY": "4G", **(env or {})}
    while codes:
        c.n += len(codes)
        try:
            r = subprocess.run([c.python, "-c", PY_CHILD], input=json.dumps(codes).encode(), capture_output=True,
                               timeout=c.timeout, env=e,
                               preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30)))
            lines, rc, hang = r.stdout.decode().splitlines(), r.returncode, False
            err = r.stderr.decode(errors="replace")[-300:]
        except subprocess.TimeoutExpired as t:
            lines, rc, hang, err = (t.stdout or b"").decode().splitlines(), 0, True, ""
        for code, line in zip(codes, lines):
            kind, detail = json.loads(line)
            if kind in ("ok", "rejected"):
                c.counts[family][kind] += 1
            else:
                c.finding(family, kind, ["python", code], detail)
        done = len(lines)
        if done == len(codes):
            if rc != 0:  # an exit-time failure (leak check, abort) after the last snippet
                c.finding(family, "crash" if rc < 0 else "internal", ["python", codes[-1]], f"exit {rc}: {err}")
            return
        c.finding(family, "hang" if hang else "crash" if rc < 0 else "internal", ["python", codes[done]],
                  f"exit {rc}: {err}")
        codes = codes[done + 1:]


class Gen:
    """Random argument values, as source text, for generated Python calls."""

    def __init__(self, c):
        self.c = c
        self.clean = False  # a clean snippet: contiguous arrays of ordinary values, valid options

    def pick(self, seq):
        return self.c.pick(seq)

    def hostile(self, p=1.0):
        """Whether to draw a hostile variant here (never in a clean snippet)."""
        return not self.clean and self.c.rng.random() < p

    def int_(self):
        return self.pick(["0", "1", "-1", "3", "64", "2**31", "2**62", "2**62-1", "2**63-1", "2**63", "2**64",
                          "-2**63", "True", "1.5", "'3'", "None", "float('nan')", "np.int64(4)", "np.int32(-7)"])

    def small(self):
        return self.pick(["1", "2", "3", "4"])

    def float_(self):
        return self.pick(["None", "0.0", "1.0", "-1.0", "1e-30", "1e30", "1e308", "float('nan')", "float('inf')",
                          "-float('inf')", "'0.5'", "True", "np.float32(2)", "[1.0]", "1+2j", "2**1100"])

    def bool_(self):
        return self.pick(["True", "False", "1", "0", "None", "'yes'", "np.bool_(True)", "[]"])

    def op(self):
        return self.pick([repr(o) for o in OPS] * 3 + ["'bogus'", "''", "3", "None", "'GLA'", "b'gla'"])

    def form(self):
        return self.pick([repr(f) for f in FORMS] * 3 + ["'bogus'", "3", "None"])

    def arr(self, shape, dtype="np.float32", values="normal"):
        """An array expression of `shape` with a random layout: contiguous, strided, reversed,
        broadcast (stride 0), Fortran order, big-endian, bfloat16, a list, or read-only."""
        sh = "(" + ",".join(map(str, shape)) + ",)"
        base = {"normal": f"np.random.default_rng({int(self.c.rng.integers(1 << 30))}).standard_normal({sh})",
                "gate": f"-np.random.default_rng({int(self.c.rng.integers(1 << 30))}).uniform(0, 1, {sh})",
                "unit": f"np.random.default_rng({int(self.c.rng.integers(1 << 30))}).uniform(0, 1, {sh})",
                "huge": f"np.full({sh}, {self.pick(['1e20', '1e30', '3e38', '-1e38', '6e4'])})",
                "bad": f"np.full({sh}, {self.pick(['np.nan', 'np.inf', '-np.inf'])})",
                "reset": f"np.full({sh}, {self.pick(['-np.inf', '-1e30', '-6e36'])})"}[values]
        x = f"({base}).astype({dtype})"
        layout = self.c.rng.integers(24) if self.hostile() else 99  # hostile: two in three contiguous
        if layout == 0 and shape:
            x = f"np.repeat({x}, 2, axis=-1)[..., ::2]"
        elif layout == 1 and shape:
            x = f"{x}[..., ::-1]"
        elif layout == 2 and shape:
            x = f"np.broadcast_to({x}[..., :1], {sh})"
        elif layout == 3:
            x = f"np.asfortranarray({x})"
        elif layout == 4:
            x = f"(lambda a: a.astype(a.dtype.newbyteorder('>')))({x})"
        elif layout == 5:
            x = f"{x}.astype(ml_dtypes.bfloat16)"
        elif layout == 6:
            x = f"{x}.tolist()"
        elif layout == 7:
            x = f"(lambda a: (a.setflags(write=False), a)[1])({x})"
        return x


def gen_introspection(g):
    p = g.pick
    return p([
        lambda: f"r = hila.state_slots({g.int_()})",
        lambda: f"r = hila.levels_needed({g.int_()}, {g.int_()})",
        lambda: f"r = hila.state_shape({g.op()}, {g.int_()}, {g.int_()}, {g.int_()}, {g.int_()}, {g.int_()}, "
                f"normalize={g.bool_()})",
        lambda: f"r = hila.state_part_shapes({g.op()}, {g.int_()}, {g.int_()}, {g.int_()}, {g.int_()}, "
                f"slots={g.int_()})",
        lambda: f"r = hila.supports({g.op()}, {g.form()}, {g.bool_()})",
        lambda: f"r = hila.op_traits({g.op()})",
        lambda: f"r = hila.config({g.op()}, scale={g.float_()}, normalize={g.bool_()}, eps={g.float_()}, "
                f"ridge={g.float_()}, qk_l2norm={g.bool_()}, check_values={g.bool_()})",
        lambda: f"r = hila.use_framework_workspace({g.bool_()}); hila.use_framework_workspace(False)",
    ])()


def _op_inputs(g, op, lead, G, H, dk, dv, dtype, values):
    """Source text of the q, k, v, g, lam, beta keyword arguments of a call with leading dims `lead`."""
    tr_log, tr_delta = op.startswith("loglinear"), op.endswith("gdn")
    a = {"q": g.arr(lead + [G, dk], dtype, values), "k": g.arr(lead + [G, dk], dtype, values),
         "v": g.arr(lead + [H, dv], dtype, values)}
    if g.c.rng.random() < 0.8:
        a["g"] = g.arr(lead + [H], g.pick([dtype, "np.float32", "np.float64"]),
                       g.pick(["gate", "gate", "reset", values] if g.hostile() else ["gate", "gate", "reset"]))
    if tr_log or g.hostile(0.05):
        a["lam"] = g.arr(lead + [H, int(g.pick([0, 1, 3, 8, 70]) if g.hostile() else 70)], dtype,
                         g.pick(["unit", "unit", values]))
    if tr_delta or g.hostile(0.05):
        a["beta"] = g.arr(lead + [H], dtype, g.pick(["unit", "unit", values]))
    return a


def _state_expr(g, op, N, H, dk, dv, slots, dtype, pos):
    t = {"S": op.replace("loglinear_", "") in ("hla2", "hla3"),
         "P": op.replace("loglinear_", "") in ("ahla", "hla3")}
    Hs = [N, H, slots, dk, dv] if op.startswith("loglinear") else [N, H, dk, dv]
    S = g.arr([N, H, dk * (dk + 1) // 2], dtype, "normal") if t["S"] else "None"
    P = g.arr([N, H, dk, dv], dtype, "normal") if t["P"] else "None"
    return f"hila.State(np.array([{pos}] * {N}, np.int64), {S}, {P}, np.zeros({tuple(Hs)}, {dtype}))"


CLEAN_OPTIONS = {"scale": ["0.5", "2.0"], "eps": ["1e-3", "1.0"], "ridge": ["0.0", "0.5"], "normalize": ["False"],
                 "qk_l2norm": ["True", "False"], "chunk": ["1", "4", "16"], "form": [repr(f) for f in FORMS]}


def gen_calls(g):
    """forward / backward / step / step_ with random layouts, dtypes, options and states."""
    rng, p = g.c.rng, g.pick
    op = p(OPS)
    B, T, G = int(p([1, 2])), int(p([0, 1, 3, 9])), int(p([1, 2]))
    H, dk, dv = G * int(p([1, 2])), int(p([1, 2, 4])), int(p([1, 3, 4]))
    dtype = p(["np.float32"] * 3 + ["np.float64", "np.float16"])
    dtype = "np.float32" if g.clean and dtype == "np.float16" else dtype
    values = p(["normal"] * 6 + ["huge", "bad"]) if g.hostile() else "normal"
    opts = []
    for name, val in (("scale", g.float_), ("eps", g.float_), ("ridge", g.float_), ("normalize", g.bool_),
                      ("qk_l2norm", g.bool_), ("chunk", g.int_), ("form", g.form)):
        if g.hostile(0.15):
            opts.append(f"{name}={val()}")
        elif g.clean and rng.random() < 0.15 and not (name == "ridge" and op not in ("hla2", "loglinear_hla2")
                                                      or name == "qk_l2norm" and not op.endswith("gdn")):
            opts.append(f"{name}={p(CLEAN_OPTIONS[name])}")
    what = rng.integers(4)
    pos = p(["0", "5", "2**62-1", "2**62", "2**63-1", "-1"] if g.hostile() else ["0", "5", "1000"])
    if what <= 1:  # forward / backward over whole sequences
        a = _op_inputs(g, op, [B, T], G, H, dk, dv, dtype, values)
        if g.hostile(0.2):
            opts.append("cu_seqlens=" + p([f"np.array([0, {T}], np.int64)", f"np.array([0, 1, {T}], np.int32)",
                                           "[0, 2**70]", "np.array([], np.int64)", f"np.array([[0, {T}]])",
                                           "np.array([0.0, 1.0])"]))
        if rng.random() < 0.3:
            sdt = p(["np.float32", "np.float64"]) if g.hostile() else "np.float64" if dtype == "np.float64" else "np.float32"
            slots = int(p([1, 3, 64])) if g.hostile() else 64
            opts.append(f"initial_state={_state_expr(g, op, B, H, dk, dv, slots, sdt, pos)}")
        if what == 0:
            if rng.random() < 0.5:
                opts.append("output_final_state=True")
            if g.hostile(0.3):
                opts.append(f"final_slots={g.int_()}")
            call = "hila.forward"
        else:
            opts.append(f"do={g.arr([B, T, H, dv], dtype, values)}")
            call = "hila.backward"
        args = ", ".join([f"{k}={v}" for k, v in a.items()] + opts)
        return f"r = {call}({op!r}, {args})"
    a = _op_inputs(g, op, [B], G, H, dk, dv, dtype, values)
    sdt = p(["np.float32", "np.float64"]) if g.hostile() else ("np.float64" if dtype == "np.float64" else "np.float32")
    st = _state_expr(g, op, B, H, dk, dv, int(p([1, 3, 64])) if g.hostile() else 64, sdt, pos)
    args = ", ".join(f"{k}={v}" for k, v in a.items())
    if what == 2:
        if op.startswith("loglinear") and g.hostile(0.4):
            opts.append(f"out_slots={g.int_()}")
        return f"r = hila.step({op!r}, {args}, state={st}, {', '.join(o for o in opts if not o.startswith(('chunk', 'form')))})"
    alias = g.hostile(0.3)  # q aliasing the state being written
    o2 = ", ".join(o for o in opts if not o.startswith(("chunk", "form")))
    if alias and op in ("gla", "gdn") and dtype == "np.float32":
        return (f"st = {st}\nx = dict({args})\nx['q'] = st.H.reshape(-1)[:{B * G * dk}].reshape({B}, {G}, {dk})\n"
                f"r = hila.step_({op!r}, **x, state=st, {o2}), st")
    return f"st = {st}\nr = hila.step_({op!r}, {args}, state=st, {o2}), st"


def gen_decode_state(g):
    """A DecodeState (or from_state) driven through a random sequence of method calls; every call
    that raises must raise HilaError naming its argument, and the state at the end must be finite."""
    rng, p, h = g.c.rng, g.pick, g.hostile
    op = p(OPS)
    N, G = int(p([1, 2])), int(p([1, 2]))
    H, dk, dv = G * int(p([1, 2])), int(p([1, 4])), int(p([1, 4]))
    dt = p(["'float32'", "'float64'"])
    npdt = "np.float64" if dt == "'float64'" else "np.float32"
    ctor = [f"st = hila.DecodeState({op!r}, {N}, {H}, {dk}, {dv}, dtype={dt})",
            f"st = hila.DecodeState.from_state({op!r}, {_state_expr(g, op, N, H, dk, dv, 64, npdt, p(['0', '7', '1000']))})"]
    if h(0.3):
        ctor = [f"st = hila.DecodeState({op!r}, {g.int_()}, {H}, {dk}, {g.int_()}, dtype={p([dt, repr('float16'), 'None', 'np.float64'])})",
                f"st = hila.DecodeState.from_state({op!r}, {_state_expr(g, op, N, H, dk, dv, int(p([1, 4, 64])), npdt, p(['0', '7', '2**62-1', '2**62']))})",
                f"st = hila.DecodeState.from_state({op!r}, {p(['None', '(1, 2)', 'np.zeros(3)', 'hila.State(None, None, None, None)'])})"]
    lines = [p(ctor), "v0 = st.view()"]
    for _ in range(int(rng.integers(1, 8))):
        a = _op_inputs(g, op, [N], G, H, dk, dv, p([npdt, npdt, "np.float32", "np.float64"]) if h() else npdt,
                       p(["normal"] * 5 + ["huge", "bad"]) if h() else "normal")
        if op.startswith("loglinear"):
            a["lam"] = g.arr([N, H, 64], npdt, "unit")
        args = ", ".join(f"{k}={v}" for k, v in a.items())
        gen_state = _state_expr(g, op, N, H, dk, dv, int(p([1, 4, 64])) if h() else 64, npdt,
                                p(["0", "3", "2**62", "-1"]) if h() else "3")
        calls = [f"r = _t(lambda: st.step({args}))"] * 4 + [
            "r = st.positions", "r = st.state()", "st.load(st.state())", "st.load(st.view())", "_t(lambda: st.load(v0))",
            f"_t(lambda: st.reserve({g.int_() if h() else p(['0', '100', '2**20'])}))",
            f"_t(lambda: st.position({g.int_() if h() else '0'}))",
            f"_t(lambda: st.load({gen_state}))",
            "r = repr(st), st.slots, st.bytes_per_sequence, st.device, st.dtype"]
        if h(0.3):
            calls.append(f"r = _t(lambda: st.step({args}, stream={g.int_()}))")
        lines.append(p(calls))
    lines.append("r = (r, st.state())  # the state after every step: finite (value checks are on)")
    return "\n".join(lines)


def gen_threads(g):
    """Threads sharing one DecodeState: steps, reserve, load and view racing each other."""
    op = g.pick(OPS)
    lam = "lam=np.ones((1, 1, 64), np.float32), " if op.startswith("loglinear") else ""
    beta = "beta=np.full((1, 1), .5, np.float32), " if op.endswith("gdn") else ""
    other = g.pick(["st.reserve(i * 1000)", "st.view()", "st.load(st.state())", "st.position(0)", "st.state()"])
    n = int(g.pick([2, 4, 8]))
    return textwrap.dedent(f"""
        st = hila.DecodeState({op!r}, 1, 1, 4, 4)
        x = np.ones((1, 1, 4), np.float32) * 0.1
        def run(i):
            for _ in range(50):
                st.step(x, x, x, np.full((1, 1), -0.1, np.float32), {lam}{beta})
                {other}
        ts = [threading.Thread(target=run, args=(i,)) for i in range({n})]
        [t.start() for t in ts]; [t.join() for t in ts]
        r = st.state()
        """)


def gen_torch(g):
    """hila.torch functions and layers: wrong devices, dtypes, requires_grad mixes, odd shapes."""
    rng, p = g.c.rng, g.pick
    op = p(OPS)
    pre = "import torch, hila.torch as ht\n"
    B, T, G = int(p([1, 2])), int(p([0, 1, 5])), 1
    H, dk, dv = int(p([1, 2])), int(p([2, 4])), int(p([2, 4]))
    h = g.hostile
    dt = p(["torch.float32", "torch.float64", "torch.bfloat16", "torch.float16", "torch.int64"] if h() else
           ["torch.float32", "torch.float64"])
    dev = p(["'cpu'"] * 6 + ["'meta'"])  # (a CUDA tensor cannot be made on a machine without a GPU)

    def t(shape, kind="randn", grad=None):
        grad = p(["False", "False", "True"]) if grad is None else grad
        x = (f"torch.randn({tuple(shape)}, dtype=torch.float64).to({dt})" if kind == "randn" else
             f"(-torch.rand({tuple(shape)}, dtype=torch.float64)).to({dt})" if kind == "gate" else
             f"torch.rand({tuple(shape)}, dtype=torch.float64).to({dt})")
        if h(0.15):
            x += f".to({dev})"
        if h(0.1):
            x = f"{x}.transpose(-1, -2).contiguous().transpose(-1, -2)"
        if dt in ("torch.float32", "torch.float64") and grad == "True":
            x += ".requires_grad_()"
        return x
    what = rng.integers(5)
    if what <= 1:
        kw = {"q": t([B, T, G, dk]), "k": t([B, T, G, dk]), "v": t([B, T, H, dv]), "g": t([B, T, H], "gate")}
        if op.startswith("loglinear"):
            kw["lam"] = t([B, T, H, int(p([1, 4, 8]))], "unit")
        if op.endswith("gdn"):
            kw["beta"] = t([B, T, H], "unit")
        sdt = dt if dt == "torch.float64" else "torch.float32"
        extra = p(["", "output_final_state=True", f"form={p(FORMS)!r}", f"chunk={p([1, 4, 16])}",
                   f"initial_state=ht.zero_state({op!r}, {B}, {H}, {dk}, {dv}, max_len=64, dtype={sdt})"]) if not h() else \
            p(["", "output_final_state=True", f"form={g.form()}", f"chunk={g.int_()}",
                   f"initial_state=ht.zero_state({op!r}, {B}, {H}, {dk}, {dv}, max_len=64)",
                   f"initial_state=ht.zero_state({op!r}, {B}, {H}, {dk}, {dv}, max_len=64, dtype=torch.float64)",
                   f"initial_state=ht.zero_state({op!r}, {B}, {H}, {dk}, {dv}, device='meta')",
                   f"final_slots={g.int_()}, output_final_state=True"])
        args = ", ".join([f"{k}={v}" for k, v in kw.items()] + ([extra] if extra else []))
        body = f"o, fin = ht.forward({op!r}, {args})\n"
        body += "if o.requires_grad: o.float().sum().backward()\nr = o.detach()\n"
        return pre + body
    if what == 2:
        kw = {"q": t([B, G, dk], grad="False"), "k": t([B, G, dk], grad="False"), "v": t([B, H, dv], grad="False"),
              "g": t([B, H], "gate", grad="False")}
        if op.startswith("loglinear"):
            kw["lam"] = t([B, H, 8], "unit", grad="False")
        if op.endswith("gdn"):
            kw["beta"] = t([B, H], "unit", grad="False")
        args = ", ".join(f"{k}={v}" for k, v in kw.items())
        if h():
            zs = (f"ht.zero_state({g.op()}, {p([str(B), g.int_()])}, {p([str(H), g.int_()])}, {dk}, {dv}, "
                  f"max_len={p(['64', g.int_()])}, dtype={p(['torch.float32', 'torch.float64', 'torch.float16', 'None'])}, "
                  f"device={p(['None', dev])})")
        else:
            zs = (f"ht.zero_state({op!r}, {B}, {H}, {dk}, {dv}, max_len=64, "
                  f"dtype={dt if dt == 'torch.float64' else 'torch.float32'})")
        fn = p(["ht.step", "ht.step_"])
        return pre + f"st = {zs}\nr = {fn}({op!r}, {args}, state=st)\n"
    def size(good):  # a constructor size: mostly good, else a careless value (huge ones are torch's
        return p([good] * 3 + ["0", "-1", "3", "1.5", "'8'", "None", "True"]) if h(0.3) else good  # allocator's)
    hla_op = p(["hla2", "ahla", "hla3", "loglinear_hla2"] + (["gla"] if h() else []))
    max_len = p(["64", "None", size("64")]) if h() else "64"
    gates, mode = p(["tied", "untied"] + (["x"] if h() else [])), p(["chunk", "recurrent"] + (["x"] if h() else []))
    layer = p([
        f"ht.HLAAttention({size('16')}, {size('2')}, head_dim={size('4')}, op={hla_op!r}, max_len={max_len}, "
        f"gates={gates!r}, chunk_size={size('16')}, mode={mode!r})",
        f"ht.LogLinearMamba2({size('16')}, max_len={size('64')}, state_size={size('4')}, head_dim={size('8')}, expand={size('2')})",
        f"ht.LogLinearGatedDeltaNet({size('16')}, max_len={size('64')}, num_heads={size('2')}, head_dim={size('4')}, op={p(['gdn', 'loglinear_gdn'])!r})",
    ])
    Bx = int(p([1, 2]))
    x = p([f"torch.randn({Bx}, 5, 16)", f"torch.randn({Bx}, 1, 16)", f"torch.randn({Bx}, 0, 16)", f"torch.randn({Bx}, 30, 16)"])
    if h(0.5):
        x = p(["torch.randn(5, 16)", "torch.randn(1, 5, 15)", "torch.randn(1, 5, 16, dtype=torch.float64)",
               "torch.randn(1, 5, 16).half()", "torch.randn(2, 3, 5, 16)", "torch.randn(1, 100, 16)",
               "torch.full((1, 5, 16), float('nan'))", "torch.randn(1, 5, 16, device='meta')",
               "torch.randint(0, 5, (1, 5, 16))"])
    body = f"m = {layer}\ny, cache = m({x}, use_cache=True)\n"
    if rng.random() < 0.6:  # go on from the cache: decode steps, a chunked prefill
        nxt = p([f"torch.randn({Bx}, 1, 16)", f"torch.randn({Bx}, 3, 16)"] if not h() else
                ["torch.randn(1, 1, 16)", "torch.randn(2, 1, 16)", "torch.randn(1, 3, 16)", x])
        body += f"for _ in range({p([1, 3])}):\n    y, cache = m({nxt}, cache, use_cache=True)\n"
    return pre + body + "r = y.detach()\n"


def gen_sizes(g):
    """Python calls whose outputs would not fit in memory: T = 0 with huge B, H, dk, dv (the final
    state is the big part), millions of empty sequences, huge decode states; numpy and torch."""
    p = g.pick
    op = p(OPS)
    B, G, dk, dv = (int(p(x)) for x in ([1, 2**10, 2**20, 2**31], [1, 2**8], [4, 2**10, 2**16], [4, 2**12]))
    H = G * int(p([1, 4]))
    extra = ""
    if op.startswith("loglinear"):
        extra += f", lam=X.zeros(({B}, 0, {H}, 1), dtype=X.float32)"
    if op.endswith("gdn"):
        extra += f", beta=X.zeros(({B}, 0, {H}), dtype=X.float32)"
    if g.c.rng.random() < 0.3:  # packed: B = 1, many empty sequences
        extra = extra.replace(f"({B}, 0", "(1, 0") + f", cu_seqlens=X.zeros({int(p([2, 10**5, 2 * 10**6]))}, dtype=X.int64)"
        B = 1
    lib = p(["np", "torch"])
    q, v = f"X.zeros(({B}, 0, {G}, {dk}), dtype=X.float32)", f"X.zeros(({B}, 0, {H}, {dv}), dtype=X.float32)"
    what = g.c.rng.integers(3)
    if what == 0:
        call = f"hila.forward({op!r}, {q}, {q}, {v}{extra}, output_final_state=True)"
        if lib == "torch":
            call = "ht.forward" + call[len("hila.forward"):]
    elif what == 1:
        call = f"hila.DecodeState({op!r}, {B}, {H}, {dk}, {dv}).reserve({p([0, 2**20, 2**62])})"
    else:
        call = f"ht.zero_state({op!r}, {B}, {H}, {dk}, {dv}, max_len={p([1, 2**20, 2**62])})"
    pre = "import torch, hila.torch as ht\n" if "ht." in call or lib == "torch" else ""
    return f"{pre}r = {call}".replace("X.", f"{lib}.")


FLA_CALLS = {  # fla function -> its positional tensors after q, k, v ('g', 'beta', 'lam')
    "chunk_simple_gla": ("g",), "fused_recurrent_simple_gla": ("g",),
    "chunk_gated_delta_rule": ("g", "beta"), "fused_recurrent_gated_delta_rule": ("g", "beta"),
    "chunk_log_linear_attn": ("g", "lam"), "fused_recurrent_log_linear_attn": ("g", "lam"),
    "chunk_log_linear_gated_delta_rule": ("g", "beta", "lam"),
    "fused_recurrent_log_linear_gated_delta_rule": ("g", "beta", "lam"),
    "chunk_hla2": ("g",), "fused_recurrent_ahla": ("g",), "chunk_hla3": ("g",),
    "chunk_log_linear_hla2": ("g", "lam"),
}


def gen_fla(g):
    """hila.torch.fla functions (fla's names and conventions) with careless tensors and options."""
    rng, p, h = g.c.rng, g.pick, g.hostile
    name = p(list(FLA_CALLS))
    B, T, H, dk, dv = int(p([1, 2])), int(p([0, 1, 7])), int(p([1, 2])), int(p([2, 4])), int(p([2, 4]))
    dt = p(["torch.float32", "torch.float64", "torch.bfloat16", "torch.float16"]) if h() else "torch.float32"
    shapes = {"q": (B, T, H, dk), "k": (B, T, H, dk), "v": (B, T, H, dv), "g": (B, T, H), "beta": (B, T, H),
              "lam": (B, T, H, 8)}
    if h(0.3):  # a careless shape
        key = p(list(shapes))
        shapes[key] = shapes[key][:-1] if rng.random() < 0.5 else shapes[key] + (2,)
    fill = {"q": "torch.randn", "k": "torch.randn", "v": "torch.randn", "g": "-torch.rand", "beta": "torch.rand",
            "lam": "torch.rand"}
    args = [f"{fill[x]}({shapes[x]}, dtype=torch.float64).to({dt})" for x in ("q", "k", "v") + FLA_CALLS[name]]
    kw = []
    if h(0.4):
        kw.append(p([f"scale={g.float_()}", f"output_final_state={g.bool_()}", "initial_state=torch.zeros(3)",
                     "cu_seqlens=torch.tensor([0, 1])", "head_first=True", "bogus=1", "use_qk_l2norm_in_kernel=1"]))
    elif rng.random() < 0.5:
        kw.append("output_final_state=True")
    return (f"import torch, hila.torch.fla as fla\n"
            f"o, fin = fla.{name}({', '.join(args + kw)})\nr = o")


def gen_models(g):
    """HilaLM and (when transformers is installed) hila.hf: careless configurations and token ids."""
    p, h = g.pick, g.hostile
    cfg = dict(vocab_size="32", hidden_size="16", num_layers="1",
               mixer=p(["'hla'", "'loglinear_mamba2'", "'loglinear_gdn'"]), max_len="64")
    kw = {"'hla'": "{'num_heads': 2, 'head_dim': 8}", "'loglinear_mamba2'": "{'head_dim': 8, 'state_size': 4}",
          "'loglinear_gdn'": "{'num_heads': 2, 'head_dim': 4}"}[cfg["mixer"]]
    if h(0.6):
        key = p(list(cfg) + ["mixer_kwargs"])
        if key == "mixer_kwargs":
            kw = p(["[1]", "{'bogus': 1}", "{'num_heads': 0}", "None"])
        else:
            cfg[key] = p(["0", "-1", "1.5", "'x'", "None"])
    ids = p(["torch.randint(0, 32, (2, 5))", "torch.randint(0, 32, (1, 1))", "torch.zeros(1, 0, dtype=torch.long)"])
    if h(0.5):
        ids = p(["torch.tensor([[0, 32]])", "torch.tensor([[-1, 3]])", "torch.rand(1, 5)", "torch.tensor([1, 2])",
                 "[[1, 2]]", "torch.randint(0, 32, (1, 2, 3))"])
    args = ", ".join(f"{k}={v}" for k, v in cfg.items())
    if g.c.rng.random() < 0.5:
        return (f"import torch, hila.torch as ht\nm = ht.HilaLM(ht.HilaLMConfig({args}, mixer_kwargs={kw}))\n"
                f"out = m({ids}, use_cache=True)\nr = out.logits.detach()")
    hf_args = args.replace("num_layers", "num_hidden_layers")
    return (f"import torch\ntry:\n    import hila.hf as hh\nexcept ImportError:  # no transformers here\n"
            f"    hh = None\nif hh is not None:\n"
            f"    m = hh.HilaForCausalLM(hh.HilaConfig({hf_args}, mixer_kwargs={kw}))\n"
            f"    r = m(input_ids={ids}).logits.detach()")


def fam_python_api(c, n):
    g = Gen(c)
    for family, gen, k in (("python introspection", gen_introspection, n),
                           ("python forward/backward/step", gen_calls, 2 * n),
                           ("python DecodeState methods", gen_decode_state, n),
                           ("python shared DecodeState threads", gen_threads, max(1, n // 10)),
                           ("hila.torch functions/layers", gen_torch, n),
                           ("hila.torch.fla functions", gen_fla, max(1, n // 2)),
                           ("HilaLM / hila.hf models", gen_models, max(1, n // 2)),
                           ("python sizes beyond memory", gen_sizes, max(1, n // 4))):
        codes = []
        for _ in range(k):
            g.clean = c.rng.random() < 0.5
            codes.append(gen(g))
        for i in range(0, len(codes), 100):
            py_batch(c, family, codes[i:i + 100])
    # environment knobs read by the Python package, set to garbage
    for v in ("1", "yes", "", "\x7f", "2", "-1"):
        codes = []
        for _ in range(max(1, n // 20)):
            g.clean = c.rng.random() < 0.5
            codes.append(gen_calls(g))
        py_batch(c, "python environment knobs", codes, env={"HILA_POISON_OUTPUTS": v, "HILA_FRAMEWORK_WORKSPACE": v})


# ---- CLI subcommands other than `run`, option combinations, environment knobs -------------------

def cli_plain(c, family, argv, env=None):
    """Runs `hila ARGV` (no files): 0, 2 (and 1 from a failed check of verify / demo) are the
    expected exits."""
    c.n += 1
    cmd = [c.hila, *map(str, argv)]
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=c.timeout, env=None if env is None else {**os.environ, **env},
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30)))
    except subprocess.TimeoutExpired:
        return c.finding(family, "hang", cmd)
    err = (r.stderr + r.stdout).decode(errors="replace")[-300:]
    if r.returncode < 0:
        return c.finding(family, "crash", cmd, f"signal {-r.returncode}: {err}")
    if r.returncode == 1:
        return c.finding(family, "inexact", cmd, err)
    if r.returncode not in (0, 2):
        return c.finding(family, "internal", cmd, f"exit {r.returncode}: {err}")
    c.counts[family]["ok" if r.returncode == 0 else "rejected"] += 1
    return r.returncode


def fam_subcommands(c, n):
    p = c.pick
    ints = ["0", "1", "-1", "3", "2**31", "2**62", "2**63-1", "-2**63", "2**64", "abc", "1.5", "", "1e3"]

    def num():
        x = p(ints)
        return str(eval(x)) if x and x[0].isdigit() or x.startswith("-") and "*" in x else x
    for _ in range(n):
        kind = c.rng.integers(4)
        if kind <= 1:  # demo: small sizes unless a huge one is picked on purpose
            argv = ["demo", "--no-check", "--reps", "1"]
            for name, small in (("--T", "8"), ("--decode", "2"), ("--heads", "1"), ("--dk", "2"), ("--dv", "2"),
                                ("--chunk", "4"), ("--reps", "1"), ("--seed", "1")):
                argv += [name, num() if c.rng.random() < 0.35 else small]
            if c.rng.random() < 0.5:
                argv += ["--op", p(OPS + ["bogus", ""])]
            if c.rng.random() < 0.2:
                argv += ["--device", p(["cpu", "auto", "cuda", "cuda:7", "cuda:-1", "x", ""])]
            if c.rng.random() < 0.3:
                argv.remove("--no-check")
        elif kind == 2:  # verify: one operator (the whole set takes seconds)
            argv = ["verify", "--op", p(OPS + ["bogus", "", "GLA"]), "--seed", num()]
        else:  # top level garbage
            argv = p([[], ["bogus"], ["run"], ["--help"], ["run", "--op"], ["verify", "--op"], ["demo", "--T"],
                      ["run", "--in"], ["--", "run"], ["run", "--op", "gla", "--in", "/nonexistent", "--out", "/tmp"],
                      ["demo", "--T", "1", "--T", "2"], ["verify", "extra"], ["\xff"]])
        cli_plain(c, "subcommands (demo/verify/top level)", argv)


def fam_option_combos(c, n):
    """Valid inputs (cu_seqlens, initial states, untied gates, resets) under random combinations of
    every option; with resets in float64/float32 every form must match the serial form."""
    from safetensors.numpy import load_file
    for _ in range(n):
        op = c.pick(OPS)
        dtype = c.pick([np.float32, np.float64])
        T, G = int(c.rng.integers(1, 40)), int(c.pick([1, 2]))
        H = G * int(c.pick([1, 2]))
        t = c.inputs(op, T=T, G=G, H=H, dk=int(c.pick([1, 2, 4])), dv=int(c.pick([1, 3, 4])), dtype=dtype)
        args = ["--op", op]
        hla = op.replace("loglinear_", "") in ("hla2", "ahla", "hla3")
        if hla and c.rng.random() < 0.3:
            P = {"hla2": 2, "ahla": 2, "hla3": 3}[op.replace("loglinear_", "")]  # primitives of each
            args += ["--gates", "untied"]
            t["g"] = np.repeat(t["g"][..., None], P, axis=-1).copy()
        for _ in range(int(c.rng.integers(0, 3))):
            t["g"][0, int(c.rng.integers(T))] = c.pick([-np.inf, -1e30, -1e6])
        if c.rng.random() < 0.3:
            cuts = sorted(set(int(x) for x in c.rng.integers(0, T + 1, int(c.rng.integers(0, 4)))) | {0, T})
            t["cu_seqlens"] = np.array(cuts, c.pick([np.int32, np.int64]))
        N = len(t["cu_seqlens"]) - 1 if "cu_seqlens" in t else 1
        norm = hla and c.rng.random() < 0.3  # the state then carries dv + 1 columns
        if c.rng.random() < 0.3:
            t["h0.pos"] = np.array([int(c.pick([0, 1, 7, 1000]))] * N, np.int64)
            sp = hila_state_shapes(op, N, H, t["q"].shape[-1], t["v"].shape[-1] + norm, int(t["h0.pos"].max()) + T)
            for part, shape in sp.items():  # a log-linear H must be canonical: zeros are
                t["h0." + part] = (0.1 * c.rng.standard_normal(shape) * (len(shape) < 5)).astype(dtype)
            if op.startswith("loglinear"):
                t["lam"] = c.rng.uniform(0.2, 1.2, t["lam"].shape[:3] + (sp["H"][2],)).astype(dtype)
        if norm:
            args += ["--normalize", "--eps", c.pick(["1e-6", "1"])]
        if op in ("hla2", "loglinear_hla2") and c.rng.random() < 0.3:
            args += ["--ridge", c.pick(["0.5", "-1", "1e30"])]
        if op.endswith("gdn") and c.rng.random() < 0.5:
            args += ["--qk-l2norm"]
        if c.rng.random() < 0.3:
            args += ["--scale", c.pick(["1", "-2", "1e-30", "1e10"])]
        exact = "--normalize" not in args and "--ridge" not in args and "--scale" not in args
        chunk = int(c.pick([1, 2, 4, 8, 16, 64]))
        rc, ref_path = c.cli("option combos vs serial", t, args + ["--form", "serial"], keep_out=True)
        if rc != 0:
            continue
        ref = load_file(str(ref_path))["o"].astype(np.float64)
        for form in ("naive", "chunk", "scan"):
            rc, path = c.cli("option combos vs serial", t, args + ["--form", form, "--chunk", chunk], keep_out=True)
            if rc != 0:
                c.finding("option combos vs serial", "internal", [op, form, *args], "rejected where serial ran")
                continue
            if not exact:
                continue
            got = load_file(str(path))["o"].astype(np.float64)
            tol = 1e-12 if dtype == np.float64 else 1e-5
            err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-300)
            if err > tol:
                c.finding("option combos vs serial", "inexact", [op, form, dtype.__name__, f"chunk {chunk}", *args],
                          f"err {err:.3g}")


def hila_state_shapes(op, N, H, dk, dv, max_pos):
    base = op.replace("loglinear_", "")
    out = {"H": [N, H, max(1, int(max_pos).bit_length() + 1), dk, dv] if op.startswith("loglinear") else [N, H, dk, dv]}
    if base in ("hla2", "hla3"):
        out["S"] = [N, H, dk * (dk + 1) // 2]
    if base in ("ahla", "hla3"):
        out["P"] = [N, H, dk, dv]
    return out


def fam_env(c, n):
    """HILA_MAX_MEMORY and OMP_NUM_THREADS set to generated garbage."""
    valid = c.dir / "env_valid.st"
    stfile.write(valid, c.inputs("hla3", T=16))
    for _ in range(n):
        r = c.rng
        num = c.pick(["0", "1", "-1", "1.5", "1e400", "nan", "inf", "0x10", "99999999999999999999",
                      "9223372036854775807", str(int(r.integers(1, 1 << 40))), "", " ", "1e-300", "٣"])
        mem = num + c.pick(["", "K", "M", "G", "T", "P", "g", "GiB", "GB", " G", "G ", "\t", "KK", "B"])
        env = {"HILA_MAX_MEMORY": mem}
        if r.random() < 0.5:
            env["OMP_NUM_THREADS"] = c.pick(["0", "-1", "abc", "100000", "4,4", "1000000000", ""])
        args = ["--op", c.pick(OPS[:4]), "--form", c.pick(FORMS)]
        if r.random() < 0.3:
            args += ["--max-memory", mem]
        c.cli("environment knobs", valid, args, env=env)


FAMILIES = ((fam_malformed, 1.0), (fam_bad_args, 1.0), (fam_nonfinite_inputs, 0.5), (fam_sizes, 0.25),
            (fam_files, 0.1), (fam_resets, 0.5), (fam_overflow, 0.25), (fam_python, 1 / 40),
            (fam_python_api, 0.25), (fam_subcommands, 0.25), (fam_option_combos, 0.25), (fam_env, 0.1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hila", default=str(Path(__file__).resolve().parents[2] / "build" / "hila"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--cases", type=int, default=200, help="cases per random family")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--families", default="", help="comma-separated family functions to run (default: all), "
                    "e.g. fam_python_api,fam_env")
    ap.add_argument("--save-findings", help="write the findings with their full commands or Python "
                    "snippets (reproducers) to this JSON file")
    a = ap.parse_args()
    only = set(filter(None, a.families.split(",")))
    with tempfile.TemporaryDirectory() as d:
        c = Campaign(a.hila, a.python, d, np.random.default_rng(a.seed), a.timeout)
        for fam, share in FAMILIES:
            if not only or fam.__name__ in only:
                fam(c, max(1, int(a.cases * share)))
        if (Path(d) / "ro").exists():
            os.chmod(Path(d) / "ro", 0o700)
    total = Counter()
    for fam, cnt in c.counts.items():
        total.update(cnt)
        print(f"{fam:32s} " + ", ".join(f"{k} {v}" for k, v in sorted(cnt.items())))
    print(f"{'total':32s} " + ", ".join(f"{k} {v}" for k, v in sorted(total.items())) + f"  ({sum(total.values())} cases)")
    for f in c.findings:
        print("FINDING", *f, sep=" | ")
    if a.save_findings:
        Path(a.save_findings).write_text(json.dumps(c.reproducers, indent=1))
    return 1 if c.findings else 0


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
