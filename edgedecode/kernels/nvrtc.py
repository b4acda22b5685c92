"""The CUDA ops' kernels: compiled from ``kernels/cuda/*.cu`` by NVRTC for the device at hand, cached on disk,
and handed to the kernels library before a session is created.

Why Python does this, not the library: NVRTC is a large shared library (the ``nvidia-cuda-nvrtc`` wheel that
onnxruntime-gpu's ``[cuda]`` extra installs, or a system CUDA's), found through the installed package's files; the
cubin cache lives beside the models; and a compile error is best shown with NVRTC's log as an exception. The C
side then only loads a ready image (``cuModuleLoadData``) when onnxruntime creates the first CUDA op's kernel, so
nothing is compiled or loaded while a run is captured into a CUDA graph.

The cache key is the sources' hash, the options, the device architecture and the NVRTC version, so a second start
compiles nothing and a changed kernel or toolkit recompiles. Images are SASS for the device's own ``sm_XY`` (no
PTX): a cubin from a newer NVRTC runs on an older driver of the same CUDA major version, PTX would not.

Standard library only (ctypes), like the rest of ``edgedecode.kernels``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import importlib.metadata
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from edgedecode.errors import EdgeDecodeError

SOURCE_DIR = Path(__file__).resolve().parent / "cuda"
MAIN_SOURCE = "kernels.cu"
# Subnormals must survive (the GEMV multiplies codes as subnormal floats, gemv.cuh): no -ftz, IEEE division and
# square root. No -use_fast_math.
OPTIONS = ("-std=c++17", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=true")
NVRTC_DISTRIBUTIONS = ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu13", "nvidia-cuda-nvrtc-cu12")
_LIBRARY_NAME = re.compile(r"libnvrtc\.so(\.\d+)*$")
_BUILTINS_PATTERN = "libnvrtc-builtins.so.*"  # not the .alt. variant, which NVRTC's own name does not match
# CUDA driver device attributes (documented enum values)
_COMPUTE_CAPABILITY_MAJOR, _COMPUTE_CAPABILITY_MINOR = 75, 76


class KernelBuildError(EdgeDecodeError):
    """The CUDA kernels cannot be compiled or handed to the library: no NVRTC, no device, or a compile error."""


def find_nvrtc() -> Path | None:
    """NVRTC's shared library: $EDGEDECODE_NVRTC, else an installed ``nvidia-cuda-nvrtc*`` wheel's, else the system's.

    The wheel's files are listed by its installed metadata (``importlib.metadata``), not guessed: the newest
    library of the newest such distribution wins.
    """
    if override := os.environ.get("EDGEDECODE_NVRTC"):
        return Path(override)
    found: list[tuple[tuple[int, ...], Path]] = []
    for name in NVRTC_DISTRIBUTIONS:
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        version = tuple(int(part) for part in re.findall(r"\d+", distribution.version)[:3])
        for file in distribution.files or ():
            if _LIBRARY_NAME.search(file.name):
                found.append((version, Path(str(distribution.locate_file(file)))))
    if found:
        return max(found, key=lambda item: (item[0], str(item[1])))[1]
    system = ctypes.util.find_library("nvrtc")
    return Path(system) if system else None


class Nvrtc:
    """NVRTC through ctypes: its documented C entry points, declared here."""

    def __init__(self, path: Path) -> None:
        try:
            # NVRTC dlopens its builtins library by name at the first compile; a wheel's directory is on no search
            # path, so load the builtins beside it first (a library already loaded under that name is reused).
            for builtins in sorted(Path(path).parent.glob(_BUILTINS_PATTERN)):
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            self._lib = ctypes.CDLL(str(path))
        except OSError as error:
            raise KernelBuildError(f"NVRTC at {path} could not be loaded: {error}") from error
        self.path = path
        lib = self._lib
        handle, size = ctypes.c_void_p, ctypes.c_size_t
        strings = ctypes.POINTER(ctypes.c_char_p)
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        lib.nvrtcCreateProgram.argtypes = [
            ctypes.POINTER(handle),
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_int,
            strings,
            strings,
        ]
        lib.nvrtcCompileProgram.argtypes = [handle, ctypes.c_int, strings]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(handle)]
        for name in ("nvrtcGetProgramLogSize", "nvrtcGetCUBINSize"):
            getattr(lib, name).argtypes = [handle, ctypes.POINTER(size)]
        for name in ("nvrtcGetProgramLog", "nvrtcGetCUBIN"):
            getattr(lib, name).argtypes = [handle, ctypes.c_char_p]

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def _check(self, code: int, what: str) -> None:
        if code:
            raise KernelBuildError(f"{what} failed: {self._lib.nvrtcGetErrorString(code).decode()} ({code})")

    def compile(self, source: str, name: str, headers: dict[str, str], options: list[str]) -> tuple[bytes, str]:
        """A cubin of ``source`` (which may include ``headers`` by name) and NVRTC's log; raises with the log."""
        lib = self._lib
        program = ctypes.c_void_p()
        names = list(headers)
        texts = (ctypes.c_char_p * max(len(names), 1))(*(headers[n].encode() for n in names))
        includes = (ctypes.c_char_p * max(len(names), 1))(*(n.encode() for n in names))
        self._check(
            lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), len(names), texts, includes),
            "nvrtcCreateProgram",
        )
        try:
            flags = (ctypes.c_char_p * len(options))(*(option.encode() for option in options))
            result = lib.nvrtcCompileProgram(program, len(options), flags)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, text)
            log = text.value.decode(errors="replace")
            if result:
                raise KernelBuildError(f"NVRTC could not compile {name} ({' '.join(options)}):\n{log}")
            self._check(lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
            return cubin.raw, log
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(program))


def sources() -> dict[str, str]:
    """The kernel sources by file name: ``kernels.cu`` and the headers it includes."""
    files = sorted(SOURCE_DIR.iterdir())
    return {path.name: path.read_text() for path in files if path.suffix in (".cu", ".cuh", ".h")}


def compile_options(arch: int) -> list[str]:
    """NVRTC options for a compute capability given as major * 10 + minor (90: sm_90)."""
    return [f"--gpu-architecture=sm_{arch}", *OPTIONS]


def cache_key(arch: int, nvrtc_version: tuple[int, int]) -> str:
    """What names a cached cubin: a hash of the sources and options, the architecture, the NVRTC version."""
    digest = hashlib.sha256()
    for name, text in sources().items():
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    digest.update(" ".join(OPTIONS).encode())
    return f"edgedecode-kernels-{digest.hexdigest()[:16]}-sm_{arch}-nvrtc{nvrtc_version[0]}.{nvrtc_version[1]}"


@dataclass(frozen=True)
class Cubin:
    """A compiled image of the kernels for one architecture."""

    arch: int
    path: Path  # the cached file
    compiled: bool  # compiled now (False: read from the cache)
    log: str  # NVRTC's log when compiled now


def cubin(arch: int, cache_dir: Path, nvrtc: Nvrtc | None = None) -> Cubin:
    """The kernels' cubin for ``arch`` from ``cache_dir``, compiled there first if absent (written atomically)."""
    if nvrtc is None:
        path = find_nvrtc()
        if path is None:
            raise KernelBuildError(
                "NVRTC not found: install onnxruntime-gpu with its CUDA extra (pip install 'onnxruntime-gpu[cuda]', "
                "which brings nvidia-cuda-nvrtc), or point EDGEDECODE_NVRTC at libnvrtc.so"
            )
        nvrtc = Nvrtc(path)
    target = cache_dir / f"{cache_key(arch, nvrtc.version())}.cubin"
    if target.is_file():
        return Cubin(arch, target, False, "")
    texts = sources()
    image, log = nvrtc.compile(texts.pop(MAIN_SOURCE), MAIN_SOURCE, texts, compile_options(arch))
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=cache_dir, suffix=".part", delete=False) as part:
        part.write(image)
    os.replace(part.name, target)
    return Cubin(arch, target, True, log)


def device_arch(ordinal: int = 0) -> int:
    """The compute capability (major * 10 + minor) of CUDA device ``ordinal``, asked of the driver through ctypes."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise KernelBuildError(f"no CUDA driver: libcuda.so.1 could not be opened ({error})") from error
    device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    for call, what in (
        (lambda: driver.cuInit(0), "cuInit"),
        (lambda: driver.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet"),
        (
            lambda: driver.cuDeviceGetAttribute(ctypes.byref(major), _COMPUTE_CAPABILITY_MAJOR, device),
            "cuDeviceGetAttribute",
        ),
        (
            lambda: driver.cuDeviceGetAttribute(ctypes.byref(minor), _COMPUTE_CAPABILITY_MINOR, device),
            "cuDeviceGetAttribute",
        ),
    ):
        if code := call():
            raise KernelBuildError(f"{what} failed with CUDA error {code} (device {ordinal})")
    return major.value * 10 + minor.value


def prepare(cache_dir: Path, device: int = 0, library: ctypes.CDLL | None = None) -> Cubin:
    """Compile (or find cached) the kernels for CUDA ``device`` and hand them to the kernels library.

    Call before creating a session that uses the CUDA ops. ``library`` defaults to this install's
    (``edgedecode.kernels.load()``), opened through ctypes: ctypes and onnxruntime's dlopen of one path share one
    instance, so the image reaches the ops onnxruntime creates. Raises KernelBuildError when it cannot.
    """
    if library is None:
        from edgedecode import kernels  # the package imports this module only on demand

        found = kernels.load()
        if not found.available or found.path is None:
            raise KernelBuildError(f"the kernels library is unusable: {found.reason}")
        library = kernels.open_library(found.path)
    arch = device_arch(device)
    image = cubin(arch, cache_dir)
    data = image.path.read_bytes()
    library.edgedecode_cuda_set_image.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    library.edgedecode_cuda_set_image.restype = ctypes.c_int
    if library.edgedecode_cuda_set_image(arch, data, len(data)) != 0:
        raise KernelBuildError(f"the kernels library refused the sm_{arch} image ({len(data)} bytes)")
    return image


def set_tuning(library: ctypes.CDLL, lanes: int = 0, rows: int = 0, threads: int = 0, blocks_per_sm: int = 0) -> None:
    """Override the GEMV launch shape for kernels created from now on (benchmarks; 0 keeps the default rule)."""
    library.edgedecode_cuda_set_tuning.argtypes = [ctypes.c_int] * 4
    library.edgedecode_cuda_set_tuning.restype = None
    library.edgedecode_cuda_set_tuning(lanes, rows, threads, blocks_per_sm)
