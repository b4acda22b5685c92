"""tools/bench/zstd_levels.py on a synthetic snapshot: the chunks it compresses are the writer's, level for level
(the real model runs in the tool)."""

from __future__ import annotations

import numpy as np
from test_kv_coder import _snapshot
from tool_modules import import_tools

from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import encode_payload
from edgedecode.kv.wire.frames import CHUNK_PREFIX

(levels,) = import_tools("bench.zstd_levels")


def test_each_level_compresses_the_writers_chunks_to_the_writers_bytes():
    snapshot = _snapshot(300)
    table = levels.level_table(snapshot, (Tier.FP16, Tier.INT4), (1, 3), runs=1, chunk_tokens=64)
    for tier in (Tier.FP16, Tier.INT4):
        tiers = np.full(300, tier, np.uint8)
        row = table[tier.name]
        for level in (1, 3):
            frames = list(encode_payload(snapshot, tiers, chunk_tokens=64, level=level))[1:-1]
            cell = row["levels"][str(level)]
            assert cell["compressed_bytes"] == sum(len(frame) - CHUNK_PREFIX.size for frame in frames)
            assert cell["ratio"] == cell["compressed_bytes"] / row["raw_bytes"] and cell["cpu_s"] > 0
    assert table["FP16"]["raw_bytes"] == 300 * 6 * 2 * 2 * 64 * 2  # tokens × layers × K, V × heads × dim × 2 B
