"""CPU decode tok/s at past 16 / 2048 for the Q4_1 graph forms and onnxruntime session variants.

Engines alternate run by run; medians of N runs (first argument, default 5); 64 greedy steps
(32 for the slow zero-point form). Used to rule levers in or out for the decode-speed work:

    python tools/cpu_variants.py 5
"""

import statistics
import sys

import numpy as np
import onnxruntime as ort

from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.sampler import SamplingParams

model = load_model()


def make(q4_1="correction", threads=2, config=None):
    real = ort.SessionOptions
    if config:

        class Opt(real):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                for key, v in config.items():
                    self.add_session_config_entry(key, v)

        ort.SessionOptions = Opt
    try:
        return Engine(model, GraphOptions(q4_1=q4_1), max_context=2200, threads=threads)
    finally:
        ort.SessionOptions = real


engines = {
    "correction": make(),
    "stacked": make("stacked"),
    "zero_point": make("zero_point"),
    "nospin": make(config={"session.intra_op.allow_spinning": "0"}),
    "1thread": make(threads=1),
}
ids = np.random.default_rng(0).integers(100, 40000, 2100)
pasts = (16, 2048)
res = {(n, p): [] for n in engines for p in pasts}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    for p in pasts:
        for n, e in engines.items():
            steps = 33 if n == "zero_point" else 65
            for _ in e.generate(ids[:p], SamplingParams(max_tokens=steps, stop_token_ids=())):
                pass
            res[(n, p)].append(e.stats.decode_tokens_per_second)
for (n, p), v in res.items():
    print(f"{n:11} past {p:5}: {statistics.median(v):7.1f} tok/s  {[round(x) for x in v]}")
