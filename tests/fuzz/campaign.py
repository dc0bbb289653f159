# SPDX-License-Identifier: Apache-2.0
"""A generated campaign against `hila run` and the Python package, as a hostile or careless user
would try them. Families: malformed safetensors files (mutated headers and offsets, duplicate
keys, gaps, trailing bytes), bad shapes, dtypes and options, NaN/Inf inputs, sizes that overflow
or exceed memory, non-regular and padded inputs, failing writes (file-size limit, --out = --in),
resets and huge negative gates (checked against the serial form), finite inputs that overflow,
and for Python: T = 0 arrays, bfloat16, wrong argument types, shared decode states, views across
growth, positions at the bound.

Every case is classified: ok (exit 0 or a result), rejected (exit 2 / HilaError), or a finding:
crash (a signal), hang (timeout), internal (exit 3 or another exception), destroyed (a failed run
changed an existing output), nonfinite (exit 0 with a non-finite output, value checks on),
inexact (a reset form off the serial form by more than 1e-6 float32 / 1e-12 float64, or lost
decode steps). Prints one line per family and the findings; exits 1 if there is any.

    python3 tests/fuzz/campaign.py --hila build/hila [--python python3] [--cases N] [--seed S]
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
        self.n = 0

    def pick(self, seq):
        """One element of seq (any mix of types, unlike Generator.choice)."""
        seq = list(seq)
        return seq[int(self.rng.integers(len(seq)))]

    # ---- running --------------------------------------------------------------------------------
    def cli(self, family, tensors_or_bytes, args, *, fsize=None, out=None, keep_out=False, expect_out=None):
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
            r = subprocess.run(cmd, capture_output=True, timeout=self.timeout, preexec_fn=pre)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hila", default=str(Path(__file__).resolve().parents[2] / "build" / "hila"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--cases", type=int, default=200, help="cases per random family")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        c = Campaign(a.hila, a.python, d, np.random.default_rng(a.seed), a.timeout)
        for fam, k in ((fam_malformed, a.cases), (fam_bad_args, a.cases), (fam_nonfinite_inputs, a.cases // 2),
                       (fam_sizes, a.cases // 4), (fam_files, a.cases // 10), (fam_resets, a.cases // 2),
                       (fam_overflow, a.cases // 4), (fam_python, max(1, a.cases // 40))):
            fam(c, k)
        os.chmod(Path(d) / "ro", 0o700)
    total = Counter()
    for fam, cnt in c.counts.items():
        total.update(cnt)
        print(f"{fam:32s} " + ", ".join(f"{k} {v}" for k, v in sorted(cnt.items())))
    print(f"{'total':32s} " + ", ".join(f"{k} {v}" for k, v in sorted(total.items())) + f"  ({sum(total.values())} cases)")
    for f in c.findings:
        print("FINDING", *f, sep=" | ")
    return 1 if c.findings else 0


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
