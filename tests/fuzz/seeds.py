# SPDX-License-Identifier: Apache-2.0
"""Seed corpora of the libFuzzer targets: valid `hila run` inputs for every operator (small), and a
few malformed files. Usage: python3 tests/fuzz/seeds.py OUT_DIR (writes OUT_DIR/safetensors and
OUT_DIR/run; a fuzz_run input is one selector byte followed by the file)."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
import stfile  # noqa: E402

OPS = ["gla", "hla2", "ahla", "hla3", "loglinear", "loglinear_hla2", "loglinear_ahla", "loglinear_hla3",
       "gdn", "loglinear_gdn"]


def inputs(op_index, T=5, dk=2, dv=2, seed=0):
    rng = np.random.default_rng(seed)
    t = {"q": rng.standard_normal((1, T, 1, dk)).astype(np.float32),
         "k": rng.standard_normal((1, T, 1, dk)).astype(np.float32),
         "v": rng.standard_normal((1, T, 1, dv)).astype(np.float32),
         "g": rng.uniform(-0.5, 0, (1, T, 1)).astype(np.float32),
         "do": rng.standard_normal((1, T, 1, dv)).astype(np.float32)}
    op = OPS[op_index]
    if op.startswith("loglinear"):
        t["lam"] = np.ones((1, T, 1, 4), np.float32)
    if op.endswith("gdn"):
        t["beta"] = np.full((1, T, 1), 0.5, np.float32)
    return t


def main(out):
    out = Path(out)
    (out / "safetensors").mkdir(parents=True, exist_ok=True)
    (out / "run").mkdir(parents=True, exist_ok=True)
    for i in range(len(OPS)):
        header, data = stfile.header_and_data(inputs(i))
        raw = stfile.encode(header, data)
        (out / "safetensors" / f"valid_{OPS[i]}").write_bytes(raw)
        for form in range(4):
            for bwd in (0, 1):
                sel = i + 10 * form + 40 * bwd
                (out / "run" / f"{OPS[i]}_{form}_{bwd}").write_bytes(bytes([sel]) + raw)
    t = inputs(0)
    t["cu_seqlens"] = np.array([0, 2, 5], np.int64)
    t["h0.pos"] = np.array([3, 0], np.int64)
    t["h0.H"] = np.zeros((2, 1, 2, 2), np.float32)
    header, data = stfile.header_and_data(t)
    (out / "run" / "varlen_init").write_bytes(bytes([0]) + stfile.encode(header, data))
    (out / "safetensors" / "trailing").write_bytes(stfile.encode(header, data, trailing=b"xx"))
    (out / "safetensors" / "short").write_bytes(b"\x10\0\0\0\0\0\0\0{}")


if __name__ == "__main__":
    main(sys.argv[1])
