"""onnxruntime in one place: the install check, execution-provider choice and session options."""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
from pathlib import Path

import psutil

from edgedecode import kernels
from edgedecode.errors import EdgeDecodeError
from edgedecode.kernels import nvrtc
from edgedecode.model.graph import GraphOptions
from edgedecode.model.registry import model_home
from edgedecode.runtime.jetson import detect_jetson, onnxruntime_advice

logger = logging.getLogger(__name__)
_ORT_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu")
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


class RuntimeSetupError(EdgeDecodeError):
    """onnxruntime is missing, installed twice, or lacks the requested execution provider."""


def installed_onnxruntime() -> list[str]:
    """The onnxruntime distributions installed in this environment."""
    found = []
    for dist in _ORT_DISTRIBUTIONS:
        try:
            importlib.metadata.version(dist)
            found.append(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def import_onnxruntime():
    """Import onnxruntime after checking that exactly one build of it is installed.

    Both `onnxruntime` and `onnxruntime-gpu` install the same module; with both present the CUDA
    provider silently disappears (microsoft/onnxruntime#7748), so that state is refused.
    """
    found = installed_onnxruntime()
    if len(found) > 1:
        jetson = detect_jetson()
        problem = "both onnxruntime and onnxruntime-gpu are installed, which hides the CUDA provider"
        if jetson is not None:  # [gpu]'s fix would pull PyPI's onnxruntime-gpu, which is not for Jetson
            raise RuntimeSetupError(f"{problem}; {onnxruntime_advice(jetson, found, [])}")
        raise RuntimeSetupError(
            f"{problem}; fix with: pip uninstall -y onnxruntime onnxruntime-gpu && pip install 'edgedecode[gpu]' "
            "(or '[cpu]')"
        )
    try:
        import onnxruntime
    except ImportError as exc:
        jetson = detect_jetson()
        if jetson is not None:
            raise RuntimeSetupError(
                f"onnxruntime is not installed: pip install 'edgedecode[cpu]' for the CPU only, or for the GPU: "
                f"{onnxruntime_advice(jetson, [], [])}"
            ) from exc
        raise RuntimeSetupError(
            "onnxruntime is not installed: pip install 'edgedecode[cpu]' or 'edgedecode[gpu]'"
        ) from exc
    return onnxruntime


def available_devices() -> list[str]:
    """Devices ('cpu', 'cuda') whose execution provider this onnxruntime build offers."""
    providers = set(import_onnxruntime().get_available_providers())
    return [device for device, provider in PROVIDERS.items() if provider in providers]


def default_threads() -> int:
    """Physical cores: decode is memory-bound and hyper-threads only add contention."""
    return int(os.environ.get("EDGEDECODE_THREADS") or psutil.cpu_count(logical=False) or os.cpu_count() or 1)


def spin_enabled() -> bool:
    """Whether onnxruntime's idle worker threads spin (``$EDGEDECODE_SPIN``, default on; ``0`` turns it off).

    Spinning saves the wake-up between ops on cores of its own (SmolLM2, 2 threads, quiet: 126 tok/s
    against 94 without); on cores other processes share it loses badly, since each op waits for its
    slowest, descheduled thread (Qwen2.5-0.5B's shape, 2 threads, load ~3.3 on 2 cores: 31 tok/s
    against 51 without, and 61 on 1 thread; docs/performance.md).
    """
    return os.environ.get("EDGEDECODE_SPIN", "1") != "0"


# The own CUDA ops are opt-in: measured on an H200 (docs/performance.md, 2026-11-27), their fused decode step is
# 1.05-1.25x MatMulNBits' on Q4_1 and Q4_K_M but 0.76-0.96x on Q4_0, and their GEMV walks a prompt four tokens
# at a time: prompts run 20-50x slower than MatMulNBits' tensor-core GEMM (3B Q4_0 at 512 tokens: 589 against
# 29,923 tok/s). Until a many-row path exists they serve only where asked for (they hold 0.7x the GPU memory).
CUDA_KERNELS_OPT_IN = "EDGEDECODE_CUDA_KERNELS"


def cuda_kernels_opted_in() -> bool:
    """Whether ``$EDGEDECODE_CUDA_KERNELS`` asks for edgedecode's own CUDA ops (``on``, ``1``, ``yes``)."""
    return os.environ.get(CUDA_KERNELS_OPT_IN, "").strip().lower() in ("on", "1", "yes", "true")


@functools.cache
def kernel_form(device: str) -> str:
    """Which ops the decode graph reads its quantized weights with on ``device`` (GraphOptions.kernels):
    "gguf", edgedecode's own over the GGUF's blocks, where its kernel library loads and (CUDA, opted in by
    ``$EDGEDECODE_CUDA_KERNELS``) its kernels compile for this card (:func:`cuda_kernels_problem`); "stock"
    (onnxruntime's MatMulNBits) otherwise, said once in the log with the reason."""
    if device == "cuda" and not cuda_kernels_opted_in():
        reason = f"edgedecode's CUDA ops are opt-in ({CUDA_KERNELS_OPT_IN}=on): their prompts are still slow"
    else:
        reason = cuda_kernels_problem() if device == "cuda" else kernels.load().reason
    if not reason:
        logger.info("decode graphs on %s use edgedecode's own kernels (%s)", device, kernel_summary())
        return "gguf"
    logger.info("decode graphs on %s use onnxruntime's MatMulNBits: %s", device, reason)
    return "stock"


# The CPU paths on which edgedecode's DecodeAttention has SIMD kernels (kernels/csrc/attention_x86_impl.h): there the
# CPU decode graph keeps its KV in float16 and attends with it. tools/bench/attention.py (the four issue-17 shapes,
# past 16 to 4096, 2 threads, AMD EPYC 2-vCPU VM under load ~6, 2026-11-27) measured DecodeAttention over float16
# at 0.25-0.89x the CPU time per layer of onnxruntime's GroupQueryAttention over float32 (0.23-0.91x wall from past
# 512 on; at past 16 both are per-node overhead, 0.8-1.3x wall), and GQA over float16 (a float16 graph) at
# 1.0-1.7x, slower everywhere. The portable kernel (aarch64 until a NEON path exists) does not ship.
FLOAT16_KV_CPU_ISAS = ("avx512vnni", "avx2")


def decode_kv_dtype(device: str, kernels_form: str, accuracy_level: int) -> str | None:
    """The decode graph's KV dtype on ``device`` (None: the graph's own): float16 on a CPU whose kernel library
    runs DecodeAttention's SIMD path, except in the exact graph (accuracy level 0) the others are verified against."""
    fast = kernels_form == "gguf" and kernels.load().cpu_isa in FLOAT16_KV_CPU_ISAS
    return "float16" if device == "cpu" and fast and accuracy_level != 0 else None


def cuda_kernel_cache() -> Path:
    """Where compiled CUDA kernels are cached (one cubin per kernel sources, card architecture and NVRTC version,
    shared by every model)."""
    return model_home() / "kernels"


@functools.cache
def cuda_kernels_problem() -> str:
    """Why edgedecode's CUDA ops cannot run in this process ("" once they can): the library's own check
    (``KernelLibrary.cuda_reason``: built, driver, NVRTC), then NVRTC's compile of the kernels for device 0, or
    the cubin an earlier one cached in :func:`cuda_kernel_cache`, handed to the library (nvrtc.prepare; a compile
    error carries NVRTC's log). Once per process: the first start on a card compiles (~20 s on a quick CPU), later
    ones read the cache. Sessions created afterwards load the kernels from that image, never while capturing."""
    library = kernels.load()
    if not library.available:
        return library.reason
    if not library.cuda:
        return library.cuda_reason
    try:
        image = nvrtc.prepare(cuda_kernel_cache())
    except nvrtc.KernelBuildError as error:
        return f"the CUDA kernels could not be prepared: {error}"
    how = "compiled into" if image.compiled else "read from"
    logger.info("edgedecode's CUDA kernels for sm_%d %s %s", image.arch, how, image.path)
    return ""


def decode_options(device: str, accuracy_level: int = 4) -> GraphOptions:
    """The decode graph as it ships for ``device``: GraphOptions.for_device with this host's kernel form and
    KV dtype (decode_kv_dtype)."""
    form = kernel_form(device)
    kv_dtype = decode_kv_dtype(device, form, accuracy_level)
    return GraphOptions.for_device("decode", device, accuracy_level, kernels=form, kv_dtype=kv_dtype)


def kernel_summary() -> str:
    """One line on edgedecode's kernel library: where it is and which paths it runs, or why it is not used."""
    library = kernels.load()
    if not library.available:
        return f"not used: {library.reason}"
    cuda = "CUDA ops" if library.cuda else f"no CUDA ops ({library.cuda_reason})"
    return f"{library.path}, CPU path {library.cpu_isa}, {cuda}"


def create_session(
    path: Path | bytes,
    *,
    device: str = "cpu",
    threads: int | None = None,
    profile: bool = False,
    cuda_graph: bool = False,
    own_kernels: bool = False,
):
    """An InferenceSession for a built graph (a file, or a serialized model) on the given device.

    ``profile`` turns on onnxruntime's profiler. ``own_kernels``: the graph has edgedecode's own ops
    (GraphOptions.kernels "gguf"), so their library is registered with the session, on CUDA after their
    kernels are compiled (or read from the cache) and handed to it (:func:`cuda_kernels_problem`).

    ``cuda_graph`` turns on the CUDA provider's graph capture (``enable_cuda_graph``): runs tagged
    with :func:`graph_run_options` capture once, then replay; runs tagged ``-1`` execute normally.

    Raises:
        RuntimeSetupError: the device's execution provider is not available, or ``own_kernels`` and the
            kernel library is not usable (on CUDA: or its kernels cannot be compiled, NVRTC's log in the message).
        onnxruntime's own error: graph capture was asked for and the graph cannot be captured
            (a compute node outside the CUDA provider).
    """
    ort = import_onnxruntime()
    if device not in PROVIDERS:
        raise RuntimeSetupError(f"unknown device {device!r}; choose one of {', '.join(PROVIDERS)}")
    if device not in available_devices():
        providers = ort.get_available_providers()
        jetson = detect_jetson()
        advice = onnxruntime_advice(jetson, installed_onnxruntime(), providers) if jetson is not None else None
        raise RuntimeSetupError(
            f"the {PROVIDERS[device]} is not available in this onnxruntime build "
            f"(available: {', '.join(providers)})" + (f"; {advice}" if advice else "")
        )
    if device == "cuda":
        ort.preload_dlls()  # CUDA/cuDNN from the nvidia-* pip wheels, when that is where they are
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or default_threads()
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin_enabled() else "0")
    options.enable_profiling = profile
    if own_kernels:
        problem = cuda_kernels_problem() if device == "cuda" else ""
        if problem or not kernels.register(options):
            raise RuntimeSetupError(
                f"the graph needs edgedecode's own kernels, which are not usable: {problem or kernels.load().reason} "
                "(rebuild the graph with the stock ops: EDGEDECODE_KERNELS=off)"
            )
    capture = cuda_graph and device == "cuda"
    provider = (PROVIDERS[device], {"enable_cuda_graph": "1"}) if capture else PROVIDERS[device]
    providers = [provider] + ([PROVIDERS["cpu"]] if device != "cpu" else [])
    logger.debug(
        "creating %s session for %s with %d threads (spinning %s)%s",
        device,
        "a serialized model" if isinstance(path, bytes) else path,
        options.intra_op_num_threads,
        "on" if spin_enabled() else "off",
        ", CUDA graph capture" if capture else "",
    )
    return ort.InferenceSession(path if isinstance(path, bytes) else str(path), options, providers=providers)


def graph_run_options(graph_id: int):
    """RunOptions that tag a run with a CUDA graph id: capture on its first use, replay after; -1 runs uncaptured."""
    options = import_onnxruntime().RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(graph_id))
    return options
