# SPDX-License-Identifier: Apache-2.0
"""Raw safetensors files, well-formed or deliberately not: an 8-byte little-endian header length, a
JSON header, then the data section. Used by the CLI hardening tests and the fuzz campaign."""
import json
import struct

import numpy as np

DTYPES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
          np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}


def header_and_data(tensors):
    """{name: ndarray or (dtype string, shape, bytes)} -> (header dict, data bytes), back to back."""
    header, data = {}, b""
    for name, t in tensors.items():
        if isinstance(t, np.ndarray):
            dt, shape, raw = DTYPES[t.dtype], list(t.shape), np.ascontiguousarray(t).tobytes()
        else:
            dt, shape, raw = t
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    return header, data


def encode(header, data=b"", *, raw_header=None, trailing=b""):
    """The bytes of a file: header (a dict, or raw_header bytes as they are), data, trailing bytes."""
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data + trailing


def write(path, tensors, **kw):
    header, data = header_and_data(tensors)
    with open(path, "wb") as f:
        f.write(encode(header, data, **kw))
