"""A float16 decode graph of the CUDA form run on onnxruntime's CPU provider, its custom ops emulated.

``build_library`` compiles the CUDA ops' own glue (edgedecode/kernels/csrc/cuda_ops.c: attributes, input checks,
launch planning) with the kernels' sources under the host emulator (tests/cuda_emu) into an onnxruntime custom-op
library whose MatMulGGUF, GatherGGUF and FusedMatMulGGUF run on the CPU provider (tests/cuda_emu/emu_driver.c).
Every other node runs on onnxruntime's own CPU kernels in float16. So the graph graph.py emits for CUDA is checked
end to end, wiring and kernels, where there is no GPU; what only the card can check is tests/test_gpu.py's.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np

from edgedecode.model.spec import ModelSpec
from edgedecode.runtime.session import import_onnxruntime

ROOT = Path(__file__).resolve().parents[1]
CUDA = ROOT / "edgedecode" / "kernels" / "cuda"
CSRC = ROOT / "edgedecode" / "kernels" / "csrc"
EMU = Path(__file__).resolve().parent / "cuda_emu"


def build_library(folder: Path) -> Path | None:
    """The emulated ops' shared library, compiled into ``folder``; None where there is no gcc and g++."""
    gcc, gxx = shutil.which("gcc"), shutil.which("g++")
    if gcc is None or gxx is None:
        return None
    includes = [f"-I{CUDA}", f"-I{CSRC}", f"-I{EMU}"]
    objects = []
    for source in [CSRC / name for name in ("cuda_plan.c", "cuda_ops.c", "op_common.c")] + [EMU / "emu_driver.c"]:
        objects.append(folder / f"{source.stem}.o")
        compile_c = [gcc, "-std=gnu11", "-O1", "-fPIC", "-c", *includes, str(source), "-o", str(objects[-1])]
        subprocess.run(compile_c, check=True)
    library = folder / "libemulated_cuda_ops.so"
    subprocess.run(
        [gxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-w", *includes, str(EMU / "emu_launch.cpp"),
         *map(str, objects), "-o", str(library)],
        check=True,
    )  # fmt: skip
    return library


def session(graph: bytes, library: Path):
    """A CPU InferenceSession of ``graph`` with the emulated ops registered."""
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


def decode(session, spec: ModelSpec, ids: np.ndarray, prompt: int, context: int = 32) -> np.ndarray:
    """Logits (float32) of every position of ``ids``: its first ``prompt`` tokens in one run (every position's
    logits), then one token a run, each over the KV the runs before it wrote in place, as the engine binds it."""
    ort = import_onnxruntime()
    shape = (1, spec.n_kv_heads, context, spec.head_dim)
    caches = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float16)) for _ in range(2 * spec.n_layers)]
    io = session.io_binding()
    for i, cache in enumerate(caches):
        layer, kind = divmod(i, 2)
        name = ("key", "value")[kind]
        io.bind_ortvalue_input(f"past_key_values.{layer}.{name}", cache)
        io.bind_ortvalue_output(f"present.{layer}.{name}", cache)
    rows = []
    for start, end in [(0, prompt)] + [(t, t + 1) for t in range(prompt, len(ids))]:
        io.bind_cpu_input("input_ids", np.ascontiguousarray(ids[None, start:end], np.int64))
        io.bind_cpu_input("attention_mask", np.ones((1, end), np.int64))
        io.bind_cpu_input("position_ids", np.arange(start, end, dtype=np.int64)[None])
        io.bind_cpu_input("logits_positions", np.arange(end - start, dtype=np.int64))
        logits = np.empty((1, end - start, spec.vocab_size), np.float16)
        io.bind_output("logits", "cpu", 0, np.float16, logits.shape, logits.ctypes.data)
        session.run_with_iobinding(io)
        rows.append(logits[0].astype(np.float32))
    return np.concatenate(rows)
