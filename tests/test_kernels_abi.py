"""The kernels library against onnxruntime's C ABI (csrc/ort_abi.h): its declarations agree with the live runtime,
registration refuses a runtime too old for it, and the Python side says why whenever the library is unusable."""

from __future__ import annotations

import ctypes

import pytest

from edgedecode import kernels

PATH = kernels._HERE / kernels.LIBRARY_NAME
BASE, NO_RUNTIME = kernels.onnxruntime_api_base()
pytestmark = pytest.mark.skipif(
    not PATH.is_file() or BASE is None, reason=f"library not built ({PATH}) or {NO_RUNTIME or 'no onnxruntime'}"
)
VoidFunction = ctypes.CFUNCTYPE(ctypes.c_void_p)
GetApi = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)


class FakeApiBase(ctypes.Structure):
    """OrtApiBase's layout with entries written in Python (the version string returned as an address)."""

    _fields_ = [("GetApi", GetApi), ("GetVersionString", VoidFunction)]


@pytest.fixture
def fresh_load():
    """kernels.load() recomputed inside the test and again after it (it is cached per process)."""
    kernels.load.cache_clear()
    yield kernels.load
    kernels.load.cache_clear()


def real_table(version: int) -> ctypes.Array:
    """The live runtime's OrtApi of `version`, as an array of its slots."""
    base = ctypes.cast(BASE, ctypes.POINTER(kernels._OrtApiBase)).contents
    table = base.GetApi(version)
    assert table, f"the installed onnxruntime offers no API version {version}"
    return ctypes.cast(table, ctypes.POINTER(ctypes.c_void_p * 300)).contents


def fake_runtime(offered: int, version: bytes) -> tuple[FakeApiBase, tuple]:
    """An OrtApiBase that hands out the real tables up to `offered` only, as an older onnxruntime would; the second
    item keeps the callbacks and the version string alive."""
    real = ctypes.cast(BASE, ctypes.POINTER(kernels._OrtApiBase)).contents
    text = ctypes.create_string_buffer(version)

    def get_api(requested: int) -> int:
        return (real.GetApi(requested) or 0) if requested <= offered else 0

    callbacks = (GetApi(get_api), VoidFunction(lambda: ctypes.addressof(text)), text)
    return FakeApiBase(callbacks[0], callbacks[1]), callbacks


def test_the_declared_entries_behave_as_declared_on_the_installed_runtime():
    library = kernels.open_library(PATH)
    message = ctypes.create_string_buffer(256)
    assert library.edgedecode_kernels_abi_selftest(BASE, message, len(message)) == 0, message.value.decode()
    assert library.edgedecode_kernels_required_api() == 17


def test_registration_is_refused_by_a_runtime_older_than_the_api_the_ops_need():
    library = kernels.open_library(PATH)
    base, _alive = fake_runtime(16, b"1.16.3")
    status = library.RegisterCustomOps(None, ctypes.byref(base))
    assert status, "an older runtime must get a status, not a registration"
    table = real_table(16)  # slots 2 and 93 (GetErrorMessage, ReleaseStatus) have been there since version 1
    message = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(table[2])(status).decode()
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(table[93])(status)
    assert "need onnxruntime C API version >= 17" in message
    assert "this onnxruntime (1.16.3) offers API versions up to 16" in message


def test_a_runtime_offering_no_api_at_all_gets_nothing_registered():
    library = kernels.open_library(PATH)
    base, _alive = fake_runtime(0, b"0.0.0")
    assert not library.RegisterCustomOps(None, ctypes.byref(base))  # no table: no status can be made
    assert "offers API versions up to 0" in library.edgedecode_kernels_last_refusal().decode()


def test_load_says_the_library_is_disabled(monkeypatch, fresh_load):
    monkeypatch.setenv("EDGEDECODE_KERNELS", "off")
    library = fresh_load()
    assert not library.available and library.path is None
    assert library.reason == "disabled by EDGEDECODE_KERNELS=off"


def test_load_says_the_library_was_not_built(monkeypatch, tmp_path, fresh_load):
    monkeypatch.setattr(kernels, "_HERE", tmp_path)
    library = fresh_load()
    assert not library.available and library.reason.startswith("not built:")


def test_load_says_a_broken_library_cannot_be_loaded(monkeypatch, tmp_path, fresh_load):
    (tmp_path / kernels.LIBRARY_NAME).write_bytes(b"not an ELF file")
    monkeypatch.setattr(kernels, "_HERE", tmp_path)
    library = fresh_load()
    assert not library.available and "could not be loaded" in library.reason


def test_register_falls_back_without_touching_the_options(monkeypatch, fresh_load):
    ort = pytest.importorskip("onnxruntime")
    monkeypatch.setenv("EDGEDECODE_KERNELS", "off")
    fresh_load()

    class Options(ort.SessionOptions):
        def register_custom_ops_library(self, path):  # pragma: no cover - must not be called
            raise AssertionError("registered a disabled library")

    assert kernels.register(Options()) is False
    assert not kernels.supports(2, "cpu")


def test_an_available_library_names_its_cpu_path_and_types(fresh_load):
    library = fresh_load()
    assert library.available, library.reason
    assert library.cpu_isa in kernels.open_library(PATH).edgedecode_kernels_cpu_isas().decode().split(",")
    assert all(kernels.supports(t, "cpu") for t in (2, 3, 6, 7, 8, 12, 13, 14))
    assert not kernels.supports(1, "cpu")  # float16 tensors are not block types
    assert kernels.supports(2, "cuda") == library.cuda
