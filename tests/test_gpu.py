"""The float16 graphs on onnxruntime-gpu's CUDA provider (skipped where there is no CUDA device)."""

from __future__ import annotations

import numpy as np
import pytest

from edgedecode.decode.engine import Engine
from edgedecode.decode.sampler import SamplingParams
from edgedecode.model.graph import GraphOptions
from edgedecode.model.session import available_devices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif("cuda" not in available_devices(), reason="needs onnxruntime-gpu with a CUDA device"),
]
NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def cuda_decoder(smollm2_model):
    return Engine(smollm2_model, GraphOptions("decode", "float16", 4), max_context=2048, device="cuda")


@pytest.fixture(scope="module")
def cuda_prefiller(smollm2_model):
    return Engine(smollm2_model, GraphOptions("prefill", "float16", 0), max_context=2048, device="cuda")


@pytest.mark.parametrize("prompt", ("prose", "code", "chat"))
def test_fp16_prefill_graph_on_cuda_argmax_equals_llama_cpp(prompt, cuda_prefiller, logit_vectors):
    ids = logit_vectors[f"{prompt}_ids"]
    scored = logit_vectors[f"{prompt}_scored_positions"]
    top5_ids = logit_vectors[f"{prompt}_top5_ids"]
    cuda_prefiller.reset()
    logits = cuda_prefiller.forward(ids, all_logits=True).astype(np.float32)
    diff = np.abs(np.take_along_axis(logits, top5_ids.astype(np.int64), 1) - logit_vectors[f"{prompt}_top5_logits"])
    print(f"{prompt}: CUDA fp16 prefill vs llama.cpp, max |logit diff| {diff.max():.3f}, mean {diff.mean():.3f}")
    np.testing.assert_array_equal(logits[scored].argmax(-1), top5_ids[scored, 0])


def test_cuda_int4_graph_tracks_the_exact_cpu_graph(cuda_decoder, exact_decoder, logit_vectors):
    ids = logit_vectors["prose_ids"]
    cuda_decoder.reset()
    exact_decoder.reset()
    gpu = cuda_decoder.forward(ids, all_logits=True).astype(np.float32)
    cpu = exact_decoder.forward(ids, all_logits=True)
    print(f"CUDA fp16 INT4 vs CPU fp32 INT4 (acc0): max |logit diff| {np.abs(gpu - cpu).max():.3f}")
    top2 = np.sort(cpu, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > NEAR_TIE
    np.testing.assert_array_equal(gpu[clear].argmax(-1), cpu[clear].argmax(-1))


def test_device_kv_exports_what_the_cpu_graph_computes(cuda_decoder, exact_decoder, logit_vectors):
    ids = logit_vectors["chat_ids"]
    cuda_decoder.prefill(ids)
    exact_decoder.prefill(ids)
    gpu, cpu = cuda_decoder.export_kv(), exact_decoder.export_kv()
    assert gpu.keys.dtype == np.float16
    np.testing.assert_allclose(gpu.values.astype(np.float32), cpu.values, atol=0.1, rtol=0.05)
    np.testing.assert_allclose(gpu.keys.astype(np.float32), cpu.keys, atol=0.25, rtol=0.05)


def test_cuda_handoff_matches_local_prefill_up_to_a_near_tie(cuda_decoder, cuda_prefiller, logit_vectors):
    ids = logit_vectors["chat_ids"]
    greedy = SamplingParams(max_tokens=32)
    local = list(cuda_decoder.generate(ids, greedy))
    cuda_prefiller.prefill(ids)
    kv = cuda_prefiller.export_kv()
    handed = list(cuda_decoder.generate(ids, greedy, kv=kv))
    assert cuda_decoder.stats.injected_tokens == len(ids) - 1
    split = next((i for i, (a, b) in enumerate(zip(local, handed)) if a != b), None)
    if split is None:
        return
    context = np.concatenate([ids, local[:split]])
    local_logits = cuda_decoder.prefill(context).astype(np.float32)
    handed_logits = cuda_decoder.prefill(context, kv=kv).astype(np.float32)
    print(f"diverge at {split}: margins {local_logits[local[split]] - local_logits[handed[split]]:.3f} / "
          f"{handed_logits[handed[split]] - handed_logits[local[split]]:.3f}")
    assert local_logits[local[split]] - local_logits[handed[split]] < NEAR_TIE
    assert handed_logits[handed[split]] - handed_logits[local[split]] < NEAR_TIE
