"""The CUDA-only figures of tools/bench/decode.py: first-token latency, the ingest of a 4k-token KV, the card's
memory in use and its read bandwidth."""

from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import time

import numpy as np

from edgedecode.runtime.engine import Engine
from edgedecode.runtime.sampler import SamplingParams
from tools.bench.prompts import prompt_tokens

INGEST_TOKENS = 4096  # the KV payload whose ingest --device cuda times
FIRST_TOKEN_PROMPTS = {"chat": None, "2k": 2048}  # None: a short chat prompt


def first_token_ms(engine: Engine, ids: np.ndarray) -> float:
    """From the call to generate() to the first token in hand (prompt pass, then sampling)."""
    started = time.perf_counter()
    next(iter(engine.generate(ids, SamplingParams(max_tokens=1, stop_token_ids=()))))
    return (time.perf_counter() - started) * 1e3


def ingest_ms(engine: Engine, ids: np.ndarray, kv, payload: bytes | None) -> dict[str, float]:
    """One ingest of ``kv`` (a snapshot of ``ids``): the KV upload alone (from the snapshot's dtype,
    and from float32 as the wire decoder returns it); resuming from it (prefill with kv: upload,
    then the last prompt token to first-token logits); and, given an EDKV payload of it, decoding
    the payload alone, and streaming it into the engine then resuming."""
    n = len(ids) - 1
    keys32, values32 = kv.keys.astype(np.float32), kv.values.astype(np.float32)
    started = time.perf_counter()
    engine.cache.update(0, keys32[:, :, :n], values32[:, :, :n])
    uploaded32 = time.perf_counter()
    engine.cache.update(0, kv.keys[:, :, :n], kv.values[:, :, :n])
    uploaded = time.perf_counter()
    engine.prefill(ids, kv=kv)
    resumed = time.perf_counter()
    times = {
        "upload_ms": (uploaded - uploaded32) * 1e3,
        "upload_from_float32_ms": (uploaded32 - started) * 1e3,
        "resume_ms": (resumed - uploaded) * 1e3,
    }
    if payload is not None:
        from edgedecode.kv.wire import decode_snapshot

        started = time.perf_counter()
        decode_snapshot(payload, engine.spec.kv_contract)
        times["edkv_int4_decode_ms"] = (time.perf_counter() - started) * 1e3
        started = time.perf_counter()
        reader = engine.open_kv_stream(ids)
        reader.feed(payload)
        engine.prefill(ids, reader)
        times["edkv_int4_stream_and_resume_ms"] = (time.perf_counter() - started) * 1e3
    return times


def int4_payload(kv) -> bytes | None:
    """An all-INT4 EDKV payload of ``kv``, or None where the wire format is not installed."""
    try:
        from edgedecode.kv.tiers import Tier
        from edgedecode.kv.wire import encode_payload
    except ImportError as exc:
        print(f"EDKV ingest not measured: {exc}", file=sys.stderr)
        return None
    return b"".join(encode_payload(kv, np.full(kv.n_tokens, Tier.INT4, np.uint8)))


def cuda_extras(runners, model, runs: int) -> dict:
    """First-token latency and 4k-token KV ingest of each CUDA runner (medians over ``runs``)."""
    tokenizer = model.tokenizer
    prompts = {
        name: (
            np.asarray(tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}]), np.int64)
            if n is None
            else prompt_tokens(tokenizer, n)
        )
        for name, n in FIRST_TOKEN_PROMPTS.items()
    }
    ingest_ids = prompt_tokens(tokenizer, INGEST_TOKENS)
    runners[0].engine.prefill(ingest_ids)
    kv = runners[0].engine.export_kv()
    payload = int4_payload(kv)
    extras = {}
    for runner in runners:
        first = {name: [] for name in prompts}
        ingests = []
        for _ in range(runs):
            for name, ids in prompts.items():
                first[name].append(first_token_ms(runner.engine, ids))
            ingests.append(ingest_ms(runner.engine, ingest_ids, kv, payload))
        extras[runner.name] = {
            "first_token_ms": {
                f"{name} ({len(prompts[name])} tokens)": statistics.median(v) for name, v in first.items()
            },
            f"ingest_{INGEST_TOKENS}_tokens": {key: statistics.median(i[key] for i in ingests) for key in ingests[0]},
        }
    if payload is not None:
        extras["edkv_int4_payload_bytes"] = len(payload)
    return extras


# A read-bound kernel over 4 GiB of float16 (a sum reads every byte once), best of 5 after a warm-up.
_BANDWIDTH_PROBE = """
import time, torch
x = torch.ones(1 << 31, dtype=torch.float16, device="cuda")
x.sum(); torch.cuda.synchronize()
best = float("inf")
for _ in range(5):
    started = time.perf_counter(); x.sum(); torch.cuda.synchronize(); best = min(best, time.perf_counter() - started)
print(x.numel() * x.element_size() / best / 1e9)
"""


def gpu_read_bandwidth_gb_s() -> float | None:
    """The card's read bandwidth in GB/s, measured by PyTorch in a process of its own (so its CUDA
    libraries never meet the engines'); None where PyTorch with CUDA is not installed."""
    result = subprocess.run([sys.executable, "-c", _BANDWIDTH_PROBE], capture_output=True, text=True)
    if result.returncode != 0:
        print(f"GPU bandwidth not measured: {result.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return float(result.stdout.strip().splitlines()[-1])


def gpu_memory_used_mib() -> float | None:
    """Device memory in use on GPU 0, all processes together (nvidia-smi); None without nvidia-smi.
    The benchmark takes one engine's share as the difference while only its process changes."""
    query = ["nvidia-smi", "--id=0", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    try:
        return float(subprocess.run(query, capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, ValueError, subprocess.CalledProcessError):
        return None


def cuda_machine() -> dict:
    """Card, driver and onnxruntime version, for the record."""
    import onnxruntime

    info = {"onnxruntime": onnxruntime.__version__, "python": platform.python_version()}
    try:
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        info["gpu"] = subprocess.run(query, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        info["gpu"] = f"unknown ({exc})"
    return info
