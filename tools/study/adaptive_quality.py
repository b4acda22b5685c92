"""The quality cost of the KV a benchmark request used (tools/bench/adaptive.py): Δ perplexity and KL
of a teacher-forced continuation against FP16 transfer, by tools/study/kv_quality.py's protocol (fp32
prefill graph, EDKV at the budget under the ``ours`` policy and the model's tier profile, scored by
the INT4 graph at accuracy level 0); local prefill is the scoring graph's own prefill of the prompt.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from edgedecode.evaluation.scoring import mean_kl, score_continuation
from edgedecode.kv.policy import TierProfile, profile_path
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel
from edgedecode.prefill.pipeline import prefill_and_score, through_wire
from edgedecode.runtime.engine import Engine
from tools.bench.adaptive_report import LOCAL


@dataclass(frozen=True)
class Prompt:
    """A prose window: ``ids`` are sent, ``continuation`` scores the quality cost."""

    tokens: int
    index: int
    ids: np.ndarray
    continuation: np.ndarray

    @property
    def key(self) -> str:
        return f"{self.tokens}:{self.index}"


def quality_costs(
    model: LoadedModel, prompts: dict[int, list[Prompt]], results: list[dict], continuation_tokens: int, threads: int
) -> dict:
    """Δ perplexity % and KL against FP16 transfer of every (prompt, KV source) the results used:
    ``{prompt key: {kv_used: {"dppl_pct", "kl"}}}``."""
    used: dict[str, set[str]] = {}
    for r in results:
        if r["kv_used"] is not None:
            used.setdefault(r["prompt"], set()).add(r["kv_used"])
    by_key = {p.key: p for windows in prompts.values() for p in windows}
    longest = max(prompts) + continuation_tokens + 64
    prefiller = Engine(model, GraphOptions("prefill"), max_context=longest, threads=threads)
    scorer = Engine(model, GraphOptions(accuracy_level=0), max_context=longest, threads=threads)
    profile = TierProfile.load(profile_path(model))
    contract = model.spec.kv_contract
    costs: dict[str, dict] = {}
    for key, sources in sorted(used.items()):
        prompt = by_key[key]
        scored = prefill_and_score(prefiller, prompt.ids)
        reference = score_continuation(
            scorer, prompt.ids, prompt.continuation, through_wire(scored, 1.0, "ours", contract)[0]
        )
        for source in sorted(sources):
            kv = None
            if source != LOCAL:
                kv = through_wire(scored, float(source.removeprefix("b")), "ours", contract, profile=profile)[0]
            score = score_continuation(scorer, prompt.ids, prompt.continuation, kv)
            costs.setdefault(key, {})[source] = {
                "dppl_pct": 100 * math.expm1(score.mean_nll - reference.mean_nll),
                "kl": mean_kl(reference, score),
            }
        print(f"  quality of prompt {key} scored", file=sys.stderr, flush=True)
    return costs
