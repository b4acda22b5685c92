"""The CUDA kernels compile with NVRTC for every architecture edgedecode targets, and the cubin cache works.

NVRTC runs on the CPU, so this needs no GPU, only NVRTC: onnxruntime-gpu's CUDA extra installs it
(nvidia-cuda-nvrtc), or EDGEDECODE_NVRTC points at a libnvrtc.so. Skipped where neither is present (CI).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgedecode.kernels import nvrtc

NVRTC_PATH = nvrtc.find_nvrtc()
pytestmark = pytest.mark.skipif(NVRTC_PATH is None, reason="needs NVRTC (nvidia-cuda-nvrtc, or EDGEDECODE_NVRTC)")
ARCHES = (80, 87, 90)  # A100 and the sm_80 floor, Jetson Orin, H100/H200
DRIVER_SOURCE = Path(nvrtc.__file__).resolve().parent / "csrc" / "cuda_driver.c"


def _entry_points() -> list[str]:
    """The kernel names the library looks up in every module (ED_KERNEL_NAMES in cuda_driver.c)."""
    table = re.search(r"ED_KERNEL_NAMES\[ED_KERNEL_COUNT\] = \{(.*?)\};", DRIVER_SOURCE.read_text(), re.S)
    assert table
    return re.findall(r'"(ed_\w+)"', table.group(1))


@pytest.fixture(scope="module")
def compiler() -> nvrtc.Nvrtc:
    assert NVRTC_PATH is not None
    return nvrtc.Nvrtc(NVRTC_PATH)


@pytest.mark.parametrize("arch", ARCHES, ids=lambda arch: f"sm_{arch}")
def test_kernels_compile_and_are_cached(compiler, arch, tmp_path):
    first = nvrtc.cubin(arch, tmp_path, compiler)
    assert first.compiled and first.path.is_file()
    image = first.path.read_bytes()
    assert image[:4] == b"\x7fELF"  # a cubin (SASS for sm_XY), not PTX
    names = _entry_points()
    assert len(names) == 11
    for name in names:
        assert name.encode() + b"\0" in image, f"{name} missing from the sm_{arch} cubin"
    again = nvrtc.cubin(arch, tmp_path, compiler)
    assert not again.compiled and again.path == first.path
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no temporary file left behind


@pytest.mark.parametrize("arch", ARCHES, ids=lambda arch: f"sm_{arch}")
def test_no_kernel_spills_registers(compiler, arch):
    """Spilled registers would put the decode GEMV's inner loop on local memory: ptxas says so per kernel."""
    texts = nvrtc.sources()
    main = texts.pop(nvrtc.MAIN_SOURCE)
    _, log = compiler.compile(main, nvrtc.MAIN_SOURCE, texts, [*nvrtc.compile_options(arch), "--ptxas-options=-v"])
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(spills) == len(_entry_points())
    assert all(stores == "0" and loads == "0" for stores, loads in spills), log


def test_a_source_change_changes_the_cache_key(compiler, monkeypatch):
    key = nvrtc.cache_key(90, compiler.version())
    texts = nvrtc.sources()
    monkeypatch.setattr(nvrtc, "sources", lambda: {**texts, "gemv.cuh": texts["gemv.cuh"] + "\n// changed\n"})
    assert nvrtc.cache_key(90, compiler.version()) != key
    assert nvrtc.cache_key(87, compiler.version()) != key


def test_a_compile_error_carries_nvrtcs_log(compiler):
    with pytest.raises(nvrtc.KernelBuildError, match=r"(?s)could not compile broken.cu.*undeclared.* is undefined"):
        compiler.compile('extern "C" __global__ void k() { undeclared(); }', "broken.cu", {}, ["-arch=sm_90"])
