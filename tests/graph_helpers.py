"""Running a built graph once, without the runtime: the tests that hold graphs to the numpy reference."""

from __future__ import annotations

import numpy as np

from edgedecode.model.graph import GraphOptions, build_graph
from edgedecode.model.spec import ModelSpec
from edgedecode.model.weights import ModelTensors
from edgedecode.runtime.session import create_session


def run_graph(
    spec: ModelSpec, tensors: ModelTensors, options: GraphOptions, ids: np.ndarray, device: str = "cpu"
) -> np.ndarray:
    """Every position's logits (float32) of one pass over ``ids`` from an empty cache."""
    graph = build_graph(spec, tensors, options).SerializeToString()
    session = create_session(graph, device=device, threads=2, own_kernels=options.kernels == "gguf")
    past = np.zeros((1, spec.n_kv_heads, 32, spec.head_dim), options.kv_np_dtype)
    feeds = {
        "input_ids": ids[None],
        "attention_mask": np.ones((1, len(ids)), np.int64),
        "position_ids": np.arange(len(ids), dtype=np.int64)[None],
        "logits_positions": np.arange(len(ids), dtype=np.int64),
    }
    feeds.update({f"past_key_values.{i}.{t}": past for i in range(spec.n_layers) for t in ("key", "value")})
    return session.run(["logits"], feeds)[0][0].astype(np.float32)


def prefill_against_llama_cpp(engine, vectors: dict[str, np.ndarray], prompt: str) -> np.ndarray:
    """Run ``prompt``'s ids of llama.cpp's test vectors through ``engine`` (a prefill graph), print how far its
    logits are from llama.cpp's, assert the argmax equals llama.cpp's at every scored position, and return
    |ours − llama.cpp's| at llama.cpp's top 5 of every position [positions, 5]."""
    top5_ids, top5_logits = vectors[f"{prompt}_top5_ids"], vectors[f"{prompt}_top5_logits"]
    scored = vectors[f"{prompt}_scored_positions"]
    engine.reset()
    logits = engine.forward(vectors[f"{prompt}_ids"], all_logits=True)
    diff = np.abs(np.take_along_axis(logits, top5_ids.astype(np.int64), axis=1) - top5_logits)
    last_diff = float(np.abs(logits[-1] - vectors[f"{prompt}_last_logits"]).max())
    print(
        f"{prompt}: |logit diff| vs llama.cpp over its top-5 at all positions: max {diff.max():.3f}, "
        f"mean {diff.mean():.3f}; full last row max {last_diff:.3f}; {len(scored)} scored positions"
    )
    np.testing.assert_array_equal(logits[scored].argmax(-1), top5_ids[scored, 0])
    return diff
