# SPDX-License-Identifier: Apache-2.0
"""`hila run` on hostile and careless input: never a crash, a hang, an unbounded read, an
"internal error" (exit 3) or a destroyed output; bad input is exit 2 with a message naming it."""
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import stfile

F32 = "F32"


def run(hila_bin, args, *, timeout=60, limit_fsize=None):
    """(returncode, stderr, max RSS in KiB of this run) of `hila run ARGS`."""
    def pre():
        if limit_fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_fsize, limit_fsize))
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([str(hila_bin), "run", *map(str, args)], stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=pre)
        deadline = time.time() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.time() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                pytest.fail(f"hila run {' '.join(map(str, args))} hung (> {timeout} s)")
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        return proc.returncode, err.read().decode(errors="replace"), usage.ru_maxrss


def expect_bad_input(hila_bin, args, *needles, **kw):
    rc, err, _ = run(hila_bin, args, **kw)
    assert rc == 2, f"expected exit 2 (bad input), got {rc}: {err}"
    for n in needles:
        assert n in err, f"'{n}' not in: {err}"
    return err


def empty(shape, dtype=F32):
    return (dtype, shape, b"")


def qkv(T=16, dk=4, dv=4, B=1, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {"q": rng.standard_normal((B, T, 1, dk)).astype(dtype),
            "k": rng.standard_normal((B, T, 1, dk)).astype(dtype),
            "v": rng.standard_normal((B, T, 1, dv)).astype(dtype)}


@pytest.fixture
def valid(tmp_path):
    path = tmp_path / "in.safetensors"
    stfile.write(path, qkv())
    return path


# ---- sizes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["gla", "loglinear", "hla2"])
def test_state_whose_size_wraps_is_rejected(hila_bin, tmp_path, op):
    """T = 0, q/k [1, 0, 1, 2^32], v [1, 0, 2^16, 2^16]: used to segfault in write_state."""
    t = {"q": empty([1, 0, 1, 2**32]), "k": empty([1, 0, 1, 2**32]), "v": empty([1, 0, 2**16, 2**16])}
    if op == "loglinear":
        t["lam"] = empty([1, 0, 2**16, 1])
    stfile.write(tmp_path / "in.st", t)
    expect_bad_input(hila_bin, ["--op", op, "--in", tmp_path / "in.st", "--out", tmp_path / "o.st"], "argument")


@pytest.mark.parametrize("B", [2**40, 2**61])
def test_huge_batch_at_t0_does_not_hang(hila_bin, tmp_path, B):
    t = {n: empty([B, 0, 1, 4]) for n in ("q", "k", "v")}
    stfile.write(tmp_path / "in.st", t)
    expect_bad_input(hila_bin, ["--op", "gla", "--in", tmp_path / "in.st", "--out", tmp_path / "o.st"], timeout=30)


def test_state_of_4_tib_is_a_named_error(hila_bin, tmp_path):
    t = {n: empty([1, 0, 1, 2**20]) for n in ("q", "k", "v")}
    stfile.write(tmp_path / "in.st", t)
    expect_bad_input(hila_bin, ["--op", "gla", "--in", tmp_path / "in.st", "--out", tmp_path / "o.st"],
                     "final_state.H", "bytes")


def test_hla2_with_dk_2_31_is_a_named_error(hila_bin, tmp_path):
    t = {"q": empty([1, 0, 1, 2**31]), "k": empty([1, 0, 1, 2**31]), "v": empty([1, 0, 1, 4])}
    stfile.write(tmp_path / "in.st", t)
    expect_bad_input(hila_bin, ["--op", "hla2", "--in", tmp_path / "in.st", "--out", tmp_path / "o.st"], "argument")


def test_many_empty_sequences_run_or_fail_by_name(hila_bin, tmp_path):
    t = {n: empty([1, 0, 1, 4]) for n in ("q", "k", "v")}
    t["cu_seqlens"] = np.zeros(2_000_001, np.int64)
    stfile.write(tmp_path / "in.st", t)
    args = ["--op", "gla", "--in", tmp_path / "in.st", "--out", tmp_path / "o.st"]
    expect_bad_input(hila_bin, args + ["--max-memory", "16M"], "final_state", "bytes")
    rc, err, _ = run(hila_bin, args)
    assert rc == 0, err


def test_naive_form_beyond_the_limit_fails_up_front(hila_bin, tmp_path):
    stfile.write(tmp_path / "in.st", qkv(T=32768))
    args = ["--op", "gla", "--form", "naive", "--in", tmp_path / "in.st", "--out", tmp_path / "o.st"]
    expect_bad_input(hila_bin, args + ["--max-memory", "4G"], "'form'", "naive")
    expect_bad_input(hila_bin, args + ["--max-memory", "lots"], "max-memory")


def test_zero_batch_output_is_loadable(hila_bin, tmp_path):
    """B = 0 with T = 2^40: every output numpy (and the safetensors package) can load."""
    from safetensors.numpy import load_file
    t = {n: empty([0, 2**40, 1, 4]) for n in ("q", "k", "v")}
    stfile.write(tmp_path / "in.st", t)
    rc, err, _ = run(hila_bin, ["--op", "gla", "--in", tmp_path / "in.st", "--out", tmp_path / "o.st"])
    assert rc == 0, err
    out = load_file(str(tmp_path / "o.st"))
    assert out["o"].shape == (0, 2**40, 1, 4)
    # a shape whose non-zero sizes pass 2^63 bytes is rejected when read
    t = {n: empty([0, 2**40, 1, 2**30]) for n in ("q", "k", "v")}
    stfile.write(tmp_path / "in2.st", t)
    expect_bad_input(hila_bin, ["--op", "gla", "--in", tmp_path / "in2.st", "--out", tmp_path / "o2.st"], "int64")


# ---- reading -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["directory", "dev_zero", "fifo"])
def test_non_regular_inputs_are_clear_errors(hila_bin, tmp_path, kind):
    path = {"directory": tmp_path, "dev_zero": Path("/dev/zero"), "fifo": tmp_path / "fifo"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    expect_bad_input(hila_bin, ["--op", "gla", "--in", path, "--out", tmp_path / "o.st"], "not a regular file",
                     timeout=20)


def test_padded_file_is_not_read_whole(hila_bin, tmp_path, valid):
    big = tmp_path / "padded.st"
    big.write_bytes(valid.read_bytes())
    os.truncate(big, 6 << 30)  # sparse: 6 GiB of zeros after the tensors
    t0 = time.time()
    rc, err, rss = run(hila_bin, ["--op", "gla", "--in", big, "--out", tmp_path / "o.st"])
    assert rc == 2 and "trailing bytes" in err, err
    assert time.time() - t0 < 20
    assert rss < 512 * 1024, f"max RSS {rss} KiB: the padding was read"


def test_header_defects_are_rejected(hila_bin, tmp_path):
    x = np.arange(16, dtype=np.float32).reshape(1, 4, 1, 4)
    base = {"q": {"dtype": F32, "shape": [1, 4, 1, 4], "data_offsets": [0, 64]},
            "k": {"dtype": F32, "shape": [1, 4, 1, 4], "data_offsets": [64, 128]},
            "v": {"dtype": F32, "shape": [1, 4, 1, 4], "data_offsets": [128, 192]}}
    data = x.tobytes() * 3
    args = lambda p: ["--op", "gla", "--in", p, "--out", tmp_path / "o.st"]  # noqa: E731
    cases = {
        "twice": stfile.encode(None, data, raw_header=(
            b'{"q":{"dtype":"F32","shape":[1,4,1,4],"data_offsets":[0,64]},'
            b'"q":{"dtype":"F32","shape":[1,4,1,4],"data_offsets":[64,128]},'
            b'"v":{"dtype":"F32","shape":[1,4,1,4],"data_offsets":[128,192]}}')),
        "trailing bytes": stfile.encode(base, data, trailing=b"\0" * 8),
        "overlap": stfile.encode({**base, "v": {**base["v"], "data_offsets": [64, 128]}}, data[:128]),
        "belong to no tensor": stfile.encode({**base, "v": {**base["v"], "data_offsets": [136, 200]}},
                                             data + b"\0" * 8),
        "nests deeper": stfile.encode(None, data, raw_header=b'{"a":' * 20 + b"1" + b"}" * 20),
    }
    for needle, raw in cases.items():
        p = tmp_path / "bad.st"
        p.write_bytes(raw)
        expect_bad_input(hila_bin, args(p), needle)


# ---- writing -------------------------------------------------------------------------------------

def test_failed_write_keeps_the_previous_output(hila_bin, tmp_path):
    stfile.write(tmp_path / "in.st", qkv(T=4096, dk=4, dv=16))  # o: 256 KiB
    out = tmp_path / "o.st"
    out.write_bytes(b"previous output")
    rc, err, _ = run(hila_bin, ["--op", "gla", "--in", tmp_path / "in.st", "--out", out], limit_fsize=64 << 10)
    assert rc == 2, f"exit {rc}: {err}"
    assert "write error" in err and "too large" in err.lower(), err
    assert out.read_bytes() == b"previous output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.st", "o.st"], "a temporary file was left behind"


def test_out_equal_to_in_is_an_error(hila_bin, tmp_path, valid):
    before = valid.read_bytes()
    (tmp_path / "link.st").symlink_to(valid)
    os.link(valid, tmp_path / "hard.st")
    for out in (valid, tmp_path / "link.st", tmp_path / "hard.st", tmp_path / "." / valid.name):
        expect_bad_input(hila_bin, ["--op", "gla", "--in", valid, "--out", out], "input file")
    assert valid.read_bytes() == before
    expect_bad_input(hila_bin, ["--op", "gla", "--in", valid, "--out", tmp_path], "directory")


def test_output_replaces_atomically(hila_bin, tmp_path, valid):
    out = tmp_path / "o.st"
    out.write_bytes(b"old")
    os.chmod(out, 0o640)
    rc, err, _ = run(hila_bin, ["--op", "gla", "--in", valid, "--out", out])
    assert rc == 0, err
    from safetensors.numpy import load_file
    assert load_file(str(out))["o"].shape == (1, 16, 1, 4)
    assert (os.stat(out).st_mode & 0o777) == 0o640, "permissions of the replaced file kept"


# ---- values --------------------------------------------------------------------------------------

def test_non_finite_outputs_are_named(hila_bin, tmp_path):
    t = qkv()
    T = 16
    cases = [
        ("gla", dict(t), ["--scale", "1e308"], "scale"),
        ("hla2", {**t, "q": np.full_like(t["q"], 1e20), "k": np.full_like(t["k"], 1e20)}, [], "float32"),
        ("gdn", {**t, "beta": np.full((1, T, 1), 1e30, np.float32)}, [], "delta rule"),
        ("hla2", {**t, "q": np.zeros_like(t["q"])}, ["--normalize", "--eps", "0"], "eps"),
    ]
    rng = np.random.default_rng(3)
    k = rng.standard_normal((1, 512, 1, 4)).astype(np.float32)
    k = 3 * k / np.linalg.norm(k, axis=-1, keepdims=True)
    cases.append(("gdn", {"q": rng.standard_normal((1, 512, 1, 4)).astype(np.float32), "k": k,
                          "v": rng.standard_normal((1, 512, 1, 4)).astype(np.float32),
                          "beta": np.ones((1, 512, 1), np.float32)}, [], "delta rule"))
    for op, tensors, opts, needle in cases:
        stfile.write(tmp_path / "in.st", tensors)
        expect_bad_input(hila_bin, ["--op", op, "--in", tmp_path / "in.st", "--out", tmp_path / "o.st", *opts],
                         needle)


@pytest.mark.parametrize("gval", [-6e36, -np.inf])
def test_reset_gates_give_finite_outputs(hila_bin, tmp_path, gval):
    from safetensors.numpy import load_file
    t = qkv()
    g = np.full((1, 16, 1), -0.1, np.float32)
    g[:, ::3] = gval
    stfile.write(tmp_path / "in.st", {**t, "g": g})
    outs = {}
    for form in ("serial", "chunk", "scan", "naive"):
        rc, err, _ = run(hila_bin, ["--op", "hla2", "--form", form, "--chunk", "4", "--in", tmp_path / "in.st",
                                    "--out", tmp_path / f"{form}.st"])
        assert rc == 0, err
        outs[form] = load_file(str(tmp_path / f"{form}.st"))["o"]
        assert np.isfinite(outs[form]).all()
    for form in ("chunk", "scan", "naive"):
        np.testing.assert_allclose(outs[form], outs["serial"], rtol=0, atol=1e-6 * np.abs(outs["serial"]).max())


@pytest.mark.parametrize("args, arg", [
    (["--T", str(2**63 - 1000), "--decode", "1000"], "decode"),  # T + decode wraps int64
    (["--T", "1", "--decode", str(2**63 - 1)], "decode"),
    (["--T", "0"], "T"),
])
def test_demo_sizes_that_wrap_are_named_errors(hila_bin, args, arg):
    r = subprocess.run([str(hila_bin), "demo", "--no-check", "--reps", "1", *args], capture_output=True,
                       timeout=60)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2, f"expected exit 2 (bad input), got {r.returncode}: {err}"
    assert f"argument '{arg}'" in err, err
