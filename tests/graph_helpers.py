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
    session = create_session(build_graph(spec, tensors, options).SerializeToString(), device=device, threads=2)
    past = np.zeros((1, spec.n_kv_heads, 32, spec.head_dim), options.np_dtype)
    feeds = {
        "input_ids": ids[None],
        "attention_mask": np.ones((1, len(ids)), np.int64),
        "position_ids": np.arange(len(ids), dtype=np.int64)[None],
        "logits_positions": np.arange(len(ids), dtype=np.int64),
    }
    feeds.update({f"past_key_values.{i}.{t}": past for i in range(spec.n_layers) for t in ("key", "value")})
    return session.run(["logits"], feeds)[0][0].astype(np.float32)
