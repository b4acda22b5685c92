"""The float16 graphs on onnxruntime-gpu's CUDA provider (skipped where there is no CUDA device).

The CUDA-graph decode step is held to the plain CUDA runs of the same graph: same greedy tokens,
except past a near-tie. KV injection on the device writes exactly the rows given, and export reads
exactly the rows held (both checked on CPU too, where the same graphs run over host memory). The
CUDA decode graph ships Q4_1 as float zero points (GraphOptions.q4_1); it is held to the correction
graph on CUDA, and its weight form and emission are checked exactly on the CPU. The decode graph on edgedecode's own
CUDA ops (FusedMatMulGGUF; tests/test_graph_cuda.py checks it on the emulator) is held to the numpy reference on
every synthetic case, and on SmolLM2 to llama.cpp's argmax and greedy text and, replayed as a CUDA graph, to its
plain runs.
"""

from __future__ import annotations

import types
from pydoc_data.topics import topics

import numpy as np
import pytest
from cuda_graph_cases import CASES, CUDA_OWN, FLOAT16_LOGITS_ATOL, IDS_COUNT, PROMPT_TOKENS, write_cases
from synthetic_gguf import DIMS

from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import encode_payload
from edgedecode.model.fetch import register_gguf
from edgedecode.model.graph import DEVICE_Q4_1, GraphOptions, GraphOptionsError
from edgedecode.model.loader import load_model
from edgedecode.model.reference import reference_forward
from edgedecode.model.weights import BlockQuantized, load_tensors
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.kvcache import DeviceExport, DeviceRows, KVCache
from edgedecode.runtime.sampler import SamplingParams
from edgedecode.runtime.session import available_devices, cuda_kernels_problem

NEAR_TIE = 0.5
LONG_PROMPT_TOKENS = 1500
CUDA_DECODE = GraphOptions("decode", "float16", 4, q4_1=DEVICE_Q4_1["cuda"])  # as shipped for CUDA


def on_cuda(test):
    """Mark a test as needing onnxruntime-gpu and a CUDA device."""
    needs = pytest.mark.skipif("cuda" not in available_devices(), reason="needs onnxruntime-gpu with a CUDA device")
    return pytest.mark.gpu(needs(test))


@pytest.fixture(scope="module")
def cuda_decoder(smollm2_model):
    """The fp16 INT4 decoder as shipped for CUDA: decode steps replay a captured CUDA graph."""
    return Engine(smollm2_model, CUDA_DECODE, max_context=2048, device="cuda")


@pytest.fixture(scope="module")
def cuda_plain_decoder(smollm2_model):
    """The same graph run step by step without CUDA graphs."""
    return Engine(smollm2_model, CUDA_DECODE, max_context=2048, device="cuda", cuda_graph=False)


@pytest.fixture(scope="module")
def cuda_correction_decoder(smollm2_model):
    """The fp16 graph with the exact Q4_1 correction (blocksum(x) @ C) instead of float zero points."""
    return Engine(
        smollm2_model, GraphOptions("decode", "float16", 4, q4_1="correction"), max_context=2048, device="cuda"
    )


@pytest.fixture(scope="module")
def cuda_prefiller(smollm2_model):
    return Engine(smollm2_model, GraphOptions("prefill", "float16", 0), max_context=2048, device="cuda")


@pytest.fixture(scope="module")
def own_ops() -> GraphOptions:
    """The decode graph on edgedecode's own CUDA ops, once their kernels are compiled for this card (or read from
    the cache)."""
    if problem := cuda_kernels_problem():
        pytest.skip(f"edgedecode's CUDA ops cannot run here: {problem}")
    return CUDA_OWN


@pytest.fixture(scope="module")
def own_decoder(smollm2_model, own_ops):
    """SmolLM2 on the own ops as shipped for CUDA: decode steps replay a captured CUDA graph."""
    return Engine(smollm2_model, own_ops, max_context=2048, device="cuda")


@pytest.fixture(scope="module")
def own_plain_decoder(smollm2_model, own_ops):
    return Engine(smollm2_model, own_ops, max_context=2048, device="cuda", cuda_graph=False)


@pytest.fixture(scope="module")
def cuda_cases(tmp_path_factory):
    return write_cases(tmp_path_factory.mktemp("cuda-cases"))


@pytest.fixture(scope="module")
def long_prompt(smollm2_model) -> np.ndarray:
    text = "\n\n".join(topics[key] for key in sorted(topics))[: LONG_PROMPT_TOKENS * 8]
    return np.asarray(smollm2_model.tokenizer.encode(text)[:LONG_PROMPT_TOKENS], np.int64)


def _prompt(name: str, logit_vectors, long_prompt) -> np.ndarray:
    return long_prompt if name == "long" else logit_vectors[f"{name}_ids"]


def _step_logits(engine: Engine, context: np.ndarray) -> np.ndarray:
    """Logits after ``context``, its last token run as a one-token decode step."""
    engine.prefill(context[:-1])
    return engine.forward(context[-1:]).astype(np.float32)


def _assert_greedy_agrees_up_to_a_near_tie(first, second, ids: np.ndarray, label: str) -> None:
    """64 greedy tokens of two engines are equal, or part only where both margins are < NEAR_TIE."""
    greedy = SamplingParams(max_tokens=64, stop_token_ids=())
    a, b = list(first.generate(ids, greedy)), list(second.generate(ids, greedy))
    split = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if split is None:
        assert a == b
        return
    context = np.concatenate([ids, b[:split]])
    a_logits, b_logits = _step_logits(first, context), _step_logits(second, context)
    a_margin, b_margin = a_logits[a[split]] - a_logits[b[split]], b_logits[b[split]] - b_logits[a[split]]
    print(f"{label}: diverge at {split}: margins {a_margin:.3f} / {b_margin:.3f}")
    assert a_margin < NEAR_TIE and b_margin < NEAR_TIE


@pytest.mark.parametrize("source", ("float16", "float32 slice", "float32 copy"))
def test_device_rows_write_only_the_given_slots(source):
    spec = types.SimpleNamespace(n_layers=3, n_kv_heads=2, head_dim=8)
    cache = KVCache(spec, 40, np.float16, "cpu")  # the row writer over host memory: same graph, same addressing
    rows = DeviceRows(cache)
    rng = np.random.default_rng(0)
    expected = cache.host.copy()
    for start, n in ((0, 5), (5, 17), (39, 1)):
        keys, values = (rng.standard_normal((3, 2, n + 3, 8)).astype(np.float32) for _ in range(2))
        if source == "float16":
            keys, values = keys.astype(np.float16), values.astype(np.float16)
        keys, values = keys[:, :, :n], values[:, :, :n]  # row slices, as Engine.prefill passes them
        if source == "float32 copy":
            keys, values = keys.transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3), values.copy()
        rows.write(start, keys, values)
        expected[:, 0, 0, :, start : start + n] = keys
        expected[:, 1, 0, :, start : start + n] = values
        np.testing.assert_array_equal(cache.host, expected)


@pytest.mark.parametrize("dtype", (np.float16, np.float32))
def test_device_export_reads_the_first_rows_of_every_buffer(dtype):
    spec = types.SimpleNamespace(n_layers=3, n_kv_heads=2, head_dim=8)
    cache = KVCache(spec, 40, dtype, "cpu")  # the export graph over host memory: same graph, same bindings
    cache.host[...] = np.random.default_rng(0).standard_normal(cache.host.shape)
    export = DeviceExport(cache)
    for n in (1, 17, 40):
        out = np.full((2, 3, 2, n, 8), np.nan, dtype)
        export.read(out)
        np.testing.assert_array_equal(out, cache.host[:, :, 0, :, :n].swapaxes(0, 1))


@on_cuda
def test_decode_step_is_captured_as_a_cuda_graph(cuda_decoder, cuda_plain_decoder):
    assert cuda_decoder.cuda_graph
    assert not cuda_plain_decoder.cuda_graph


@on_cuda
@pytest.mark.parametrize("prompt", ("chat", "long"))
def test_graph_step_logits_track_the_plain_cuda_step(
    prompt, cuda_decoder, cuda_plain_decoder, logit_vectors, long_prompt
):
    ids = _prompt(prompt, logit_vectors, long_prompt)
    graph, plain = _step_logits(cuda_decoder, ids), _step_logits(cuda_plain_decoder, ids)
    print(f"{prompt}: CUDA graph step vs plain step, max |logit diff| {np.abs(graph - plain).max():.4f}")
    np.testing.assert_allclose(graph, plain, atol=0.25)
    top2 = np.sort(plain)[-2:]
    if top2[1] - top2[0] > NEAR_TIE:
        assert graph.argmax() == plain.argmax()


@on_cuda
@pytest.mark.parametrize("prompt", ("chat", "long"))
def test_graph_greedy_tokens_equal_plain_cuda_runs(
    prompt, cuda_decoder, cuda_plain_decoder, logit_vectors, long_prompt
):
    ids = _prompt(prompt, logit_vectors, long_prompt)
    _assert_greedy_agrees_up_to_a_near_tie(cuda_decoder, cuda_plain_decoder, ids, prompt)
    assert cuda_decoder.stats.decode_steps == cuda_plain_decoder.stats.decode_steps == 63


@on_cuda
def test_injected_kv_lands_on_the_device_exactly(cuda_decoder, long_prompt):
    local = cuda_decoder.prefill(long_prompt).astype(np.float32)
    kv = cuda_decoder.export_kv()
    resumed = cuda_decoder.prefill(long_prompt, kv=kv).astype(np.float32)
    assert cuda_decoder.stats.injected_tokens == len(long_prompt) - 1
    again = cuda_decoder.export_kv()
    n = len(long_prompt) - 1
    np.testing.assert_array_equal(again.keys[:, :, :n], kv.keys[:, :, :n])
    np.testing.assert_array_equal(again.values[:, :, :n], kv.values[:, :, :n])
    print(f"resumed from injected KV vs local prefill: max |logit diff| {np.abs(resumed - local).max():.4f}")
    np.testing.assert_allclose(resumed, local, atol=0.25)


@on_cuda
def test_streamed_compacted_kv_steps_alike_with_and_without_cuda_graphs(cuda_decoder, cuda_plain_decoder, long_prompt):
    cuda_plain_decoder.prefill(long_prompt)
    kv = cuda_plain_decoder.export_kv()
    tiers = np.full(kv.n_tokens, Tier.FP16, np.uint8)
    tiers[10:-50:3] = Tier.DROP  # compacted slots: true positions run ahead of cache slots
    payload = b"".join(encode_payload(kv, tiers))
    tokens, runs = [], []
    for engine in (cuda_plain_decoder, cuda_decoder):  # the graph engine decodes the plain engine's picks
        reader = engine.open_kv_stream(long_prompt)
        reader.feed(payload)
        logits = [engine.prefill(long_prompt, reader).astype(np.float32)]
        assert engine.next_position == len(long_prompt) > engine.length
        for i in range(8):
            if len(tokens) < 8:
                tokens.append(int(logits[-1].argmax()))
            logits.append(engine.forward(np.array([tokens[i]])).astype(np.float32))
        runs.append(np.stack(logits))
    plain, graph = runs
    print(
        f"compacted KV ({engine.length} slots): graph vs plain steps, "
        f"max |logit diff| {np.abs(graph - plain).max():.4f}"
    )
    np.testing.assert_allclose(graph, plain, atol=0.25)


@on_cuda
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


@on_cuda
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


@on_cuda
def test_device_kv_exports_what_the_cpu_graph_computes(cuda_decoder, exact_decoder, logit_vectors):
    ids = logit_vectors["chat_ids"]
    cuda_decoder.prefill(ids)
    exact_decoder.prefill(ids)
    gpu, cpu = cuda_decoder.export_kv(), exact_decoder.export_kv()
    assert gpu.keys.dtype == np.float16
    np.testing.assert_allclose(gpu.values.astype(np.float32), cpu.values, atol=0.1, rtol=0.05)
    np.testing.assert_allclose(gpu.keys.astype(np.float32), cpu.keys, atol=0.25, rtol=0.05)


@on_cuda
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
    print(
        f"diverge at {split}: margins {local_logits[local[split]] - local_logits[handed[split]]:.3f} / "
        f"{handed_logits[handed[split]] - handed_logits[local[split]]:.3f}"
    )
    assert local_logits[local[split]] - local_logits[handed[split]] < NEAR_TIE
    assert handed_logits[handed[split]] - handed_logits[local[split]] < NEAR_TIE


@on_cuda
@pytest.mark.parametrize("name", CASES)
def test_own_ops_decode_every_synthetic_case_as_the_reference(name, cuda_cases, own_ops, tmp_path, monkeypatch):
    """Every type mix and architecture: a prompt run (the M > 1 kernels), then single steps replayed through the
    captured CUDA graph (M = 1), against the numpy reference on the same GGUF blocks."""
    path, reader, spec = cuda_cases[name]
    monkeypatch.setenv("EDGEDECODE_HOME", str(tmp_path))
    model = load_model(register_gguf(path, f"case-{CASES.index(name)}").name)
    engine = Engine(model, own_ops, max_context=64, device="cuda")
    ids = np.random.default_rng(4).integers(0, DIMS.vocab, IDS_COUNT)
    logits = [engine.forward(ids[:PROMPT_TOKENS], all_logits=True)]
    logits += [engine.step(int(token))[None].copy() for token in ids[PROMPT_TOKENS:]]
    tensors = load_tensors(reader, spec, dense=False, as_stored=True)
    reference = reference_forward(spec, tensors, ids.tolist()).logits
    ours = np.concatenate(logits).astype(np.float32)
    print(f"{name}: own CUDA ops vs numpy reference, max |logit diff| {np.abs(ours - reference).max():.4f}")
    np.testing.assert_allclose(ours, reference, atol=FLOAT16_LOGITS_ATOL)
    assert engine.cuda_graph  # the steps above were replays


@on_cuda
@pytest.mark.parametrize("prompt", ("prose", "code", "chat"))
def test_own_ops_prompt_argmax_equals_llama_cpp(prompt, own_decoder, logit_vectors):
    ids, scored = logit_vectors[f"{prompt}_ids"], logit_vectors[f"{prompt}_scored_positions"]
    top5_ids = logit_vectors[f"{prompt}_top5_ids"]
    assert own_decoder.cuda_graph and own_decoder.options.kernels == "gguf"
    own_decoder.reset()
    logits = own_decoder.forward(ids, all_logits=True).astype(np.float32)
    diff = np.abs(np.take_along_axis(logits, top5_ids.astype(np.int64), 1) - logit_vectors[f"{prompt}_top5_logits"])
    print(f"{prompt}: own CUDA ops vs llama.cpp, max |logit diff| {diff.max():.3f}, mean {diff.mean():.3f}")
    np.testing.assert_array_equal(logits[scored].argmax(-1), top5_ids[scored, 0])


@on_cuda
@pytest.mark.parametrize("prompt", ("prose", "code", "chat"))
def test_own_ops_greedy_text_equals_llama_cpps_up_to_a_near_tie(prompt, own_decoder, logit_vectors):
    """Decode steps replayed through the CUDA graph pick llama.cpp's greedy tokens, up to a step where our own
    logits put llama.cpp's pick within NEAR_TIE of ours."""
    ids, theirs = logit_vectors[f"{prompt}_ids"], logit_vectors[f"{prompt}_greedy32"].tolist()
    greedy = SamplingParams(max_tokens=len(theirs), stop_token_ids=())
    steps = list(own_decoder.generate_scored(ids, greedy, top=5))
    ours = [step.token for step in steps]
    split = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if split is None:
        assert ours == theirs
        return
    ranked = dict(zip(steps[split].top_ids.tolist(), steps[split].top_logprobs.tolist()))
    margin = steps[split].logprob - ranked.get(theirs[split], -np.inf)
    print(f"{prompt}: diverge from llama.cpp at token {split}: ours leads theirs by {margin:.3f}")
    assert margin < NEAR_TIE


@on_cuda
@pytest.mark.parametrize("prompt", ("chat", "long"))
def test_own_ops_graph_steps_equal_plain_runs(prompt, own_decoder, own_plain_decoder, logit_vectors, long_prompt):
    ids = _prompt(prompt, logit_vectors, long_prompt)
    graph, plain = _step_logits(own_decoder, ids), _step_logits(own_plain_decoder, ids)
    print(f"{prompt}: own ops, CUDA graph step vs plain step, max |logit diff| {np.abs(graph - plain).max():.4f}")
    np.testing.assert_allclose(graph, plain, atol=0.25)
    _assert_greedy_agrees_up_to_a_near_tie(own_decoder, own_plain_decoder, ids, prompt)
    assert own_decoder.stats.decode_steps == own_plain_decoder.stats.decode_steps == 63


def test_zero_point_form_reproduces_every_block_exactly():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (3, 80), dtype=np.uint8)  # 80 = two blocks of 32 and a short one of 16
    scales = rng.uniform(0.01, 0.1, (3, 3)).astype(np.float32)
    offsets = rng.uniform(-1.0, 1.0, (3, 3)).astype(np.float32)
    scales[1, 2], scales[2, 0], offsets[2, 0] = 0.0, 0.0, 0.0  # constant blocks: m != 0 and m == 0
    weight = BlockQuantized(codes, scales, offsets, 4)
    form, zero_points = weight.zero_point_form()
    assert form.offsets is None and zero_points.shape == scales.shape
    blocks = np.pad(form.codes, ((0, 0), (0, 16))).reshape(3, 3, 32).astype(np.float64)
    rebuilt = (form.scales[..., None] * (blocks - zero_points[..., None])).reshape(3, -1)[:, :80]
    np.testing.assert_allclose(rebuilt, weight.dequantize(), rtol=1e-6, atol=1e-6)
    assert rebuilt[1, 64:].tolist() == [offsets[1, 2]] * 16 and not rebuilt[2, :32].any()


def test_q4_1_forms_are_validated():
    with pytest.raises(GraphOptionsError, match="q4_1 must be one of"):
        GraphOptions(q4_1="zeropoint")
    with pytest.raises(GraphOptionsError, match="decode graph only"):
        GraphOptions("prefill", q4_1="zero_point")
    assert GraphOptions().q4_1 == DEVICE_Q4_1["cpu"] == "correction"


@pytest.mark.parametrize("q4_1", ("zero_point", "stacked"))
def test_q4_1_forms_compute_what_the_correction_graph_does(q4_1, smollm2_model, exact_decoder, logit_vectors):
    """On the CPU in fp32 (acc0), where every form is exact: the emission, not the kernels, is checked."""
    ids = logit_vectors["chat_ids"]
    engine = Engine(smollm2_model, GraphOptions("decode", "float32", 0, q4_1=q4_1), max_context=64, threads=2)
    exact_decoder.reset()
    np.testing.assert_allclose(
        engine.forward(ids, all_logits=True), exact_decoder.forward(ids, all_logits=True), atol=2e-3
    )


@on_cuda
@pytest.mark.parametrize("prompt", ("chat", "long"))
def test_zero_point_graph_tracks_the_correction_graph(
    prompt, cuda_decoder, cuda_correction_decoder, logit_vectors, long_prompt
):
    ids = _prompt(prompt, logit_vectors, long_prompt)
    shipped, corrected = _step_logits(cuda_decoder, ids), _step_logits(cuda_correction_decoder, ids)
    print(f"{prompt}: zero-point vs correction step, max |logit diff| {np.abs(shipped - corrected).max():.4f}")
    np.testing.assert_allclose(shipped, corrected, atol=0.25)
    _assert_greedy_agrees_up_to_a_near_tie(cuda_decoder, cuda_correction_decoder, ids, prompt)


@on_cuda
def test_engines_sharing_a_cuda_session_each_replay_their_own_graph(
    smollm2_model, cuda_decoder, logit_vectors, long_prompt
):
    """The daemon's KV slots on CUDA: one session, one captured graph per engine, steps interleaved."""
    sibling = Engine(smollm2_model, CUDA_DECODE, max_context=2048, device="cuda", share=cuda_decoder)
    assert sibling.cuda_graph and sibling.session is cuda_decoder.session
    greedy = SamplingParams(max_tokens=16, stop_token_ids=())
    chat = logit_vectors["chat_ids"]
    alone = [list(cuda_decoder.generate(chat, greedy)), list(sibling.generate(long_prompt, greedy))]
    interleaved = [[], []]
    for a, b in zip(cuda_decoder.generate(chat, greedy), sibling.generate(long_prompt, greedy), strict=True):
        interleaved[0].append(a)
        interleaved[1].append(b)
    assert interleaved == alone


@on_cuda
def test_evicting_tokens_on_the_device_keeps_the_others_in_order(cuda_decoder, long_prompt):
    cuda_decoder.prefill(long_prompt[:200])
    whole = cuda_decoder.export_kv()
    evicted = np.arange(10, 60)
    cuda_decoder.evict(evicted)
    kept = ~np.isin(whole.positions, evicted)
    after = cuda_decoder.export_kv()
    np.testing.assert_array_equal(after.positions, whole.positions[kept])
    np.testing.assert_array_equal(after.keys, whole.keys[:, :, kept])
    np.testing.assert_array_equal(after.values, whole.values[:, :, kept])
    assert cuda_decoder.kv_preallocated and np.isfinite(cuda_decoder.step(int(long_prompt[200]))).all()
