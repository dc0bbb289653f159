# SPDX-License-Identifier: Apache-2.0
"""hila.build_info(), hila.cuda_available() and hila.__version__ against the source tree."""
import re
from pathlib import Path

import hila
from hila import _C

REPO = Path(__file__).resolve().parents[2]


def test_version_is_the_cmake_project_version():
    m = re.search(r"project\(hila VERSION ([0-9]+\.[0-9]+\.[0-9]+)", (REPO / "CMakeLists.txt").read_text())
    assert m, "project(hila VERSION x.y.z) not found in CMakeLists.txt"
    assert hila.__version__ == m.group(1)
    assert hila.build_info()["version"] == m.group(1)


def test_build_info_reports_what_was_compiled():
    info = hila.build_info()
    assert set(info) == {"version", "cuda", "cuda_version", "cuda_archs", "cuda_gencode", "openmp",
                         "openmp_version", "compiler", "build_type"}
    assert isinstance(info["cuda"], bool) and isinstance(info["cuda_archs"], list)
    assert info["openmp"] is True and re.fullmatch(r"[0-9]+\.[0-9]+", info["openmp_version"])
    assert info["compiler"] and info["build_type"]
    if info["cuda"]:
        # every architecture is device code (sm_XX[a]) or PTX (compute_XX), and comes from the flags
        assert re.fullmatch(r"[0-9]+\.[0-9]+(\.[0-9]+)?", info["cuda_version"])
        assert info["cuda_archs"]
        for arch in info["cuda_archs"]:
            assert re.fullmatch(r"(sm|compute)_[0-9]+a?", arch), arch
            assert f"code={arch}" in info["cuda_gencode"], (arch, info["cuda_gencode"])
    else:
        assert info["cuda_version"] == "" and info["cuda_archs"] == [] and info["cuda_gencode"] == ""


def test_cuda_available_needs_the_backend_and_a_device():
    n, why = _C.cuda_device_count()
    assert isinstance(n, int) and n >= 0 and isinstance(why, str)
    assert hila.cuda_available() == (n > 0)
    if not hila.build_info()["cuda"]:
        assert n == 0 and "no CUDA backend" in why
    if n == 0:
        assert why, "a count of 0 comes with the CUDA runtime's reason"
    else:
        assert why == ""
