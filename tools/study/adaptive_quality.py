"""The quality cost of the KV a benchmark request used (tools/bench/adaptive.py): Δ perplexity and KL
of a teacher-forced continuation against FP16 transfer, by tools/study/kv_quality.py's protocol (fp32
prefill graph, EDKV at the budget under the ``ours`` policy and the model's tier profile, scored by
the INT4 graph at accuracy level 0); local prefill is the scoring graph's own prefill of the prompt.

A turn whose KV came from several parts — a split (a head computed here, the rest pulled), a pull
re-planned mid-transfer (segments at different budgets) or a pull cut with its rest computed here —
is scored as that composite (``KVOrigin``): each pulled range is the payload the server encodes for
it (``from_position``, as for a split's tail or a resume) cut to the tokens the segment delivered,
and each range computed here is FP16 transfer's KV, the local prefill's stand-in (the ranges after a
cut attended to the pulled KV when the daemon computed them: this counts them as exact).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace

import numpy as np

from edgedecode.evaluation.scoring import mean_kl, score_continuation
from edgedecode.kv.policy import TierProfile, profile_path
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel
from edgedecode.model.spec import KVContract
from edgedecode.prefill.pipeline import ScoredPrefill, prefill_and_score, through_wire
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


@dataclass(frozen=True)
class KVOrigin:
    """Where a turn's KV came from, in prompt order: ``head`` tokens computed here, then each segment's
    ``(budget, tokens)`` pulled, then whatever is left computed here. Its ``label`` names it in a run's
    records: ``local``, ``b0.3`` (one whole pull), or e.g. ``h1024 b0.25x3072`` / ``b0.3x1800 b0.15x2296``."""

    head: int
    segments: tuple[tuple[float, int | None], ...]  # (budget, tokens) of each pulled segment; tokens None: the rest

    @property
    def label(self) -> str:
        if not self.segments:
            return LOCAL
        if self.head == 0 and len(self.segments) == 1 and self.segments[0][1] is None:
            return f"b{self.segments[0][0]!r}"
        parts = [f"h{self.head}"] if self.head else []
        return " ".join(parts + [f"b{b!r}" if t is None else f"b{b!r}x{t}" for b, t in self.segments])

    @classmethod
    def parse(cls, label: str) -> KVOrigin:
        """The source a ``label`` names."""
        if label == LOCAL:
            return cls(0, ())
        head, segments = 0, []
        for part in label.split():
            if part.startswith("h"):
                head = int(part[1:])
            else:
                budget, _, tokens = part[1:].partition("x")
                segments.append((float(budget), int(tokens) if tokens else None))
        return cls(head, tuple(segments))

    @classmethod
    def of_report(cls, report: dict | None) -> KVOrigin | None:
        """The source a daemon's turn report describes; None without a report, or for KV restored from a
        conversation (not a fresh prompt's)."""
        if report is None:
            return None
        kv = report["kv"]
        if kv["source"] == "local":
            return cls(0, ())
        if kv.get("restored_tokens") or kv.get("reused_tokens"):
            return None
        segments = kv.get("segments") or ()
        if not segments:
            return None
        head = kv.get("head_tokens") or 0
        if len(segments) == 1 and segments[0]["ended"] == "complete":
            return cls(head, ((round(segments[0]["budget"], 4), None),))
        return cls(head, tuple((round(s["budget"], 4), s["tokens"]) for s in segments))

    def kv(
        self, scored: ScoredPrefill, fp16: KVSnapshot, contract: KVContract, profile: TierProfile
    ) -> KVSnapshot | None:
        """This source's KV for ``scored`` (``fp16``: FP16 transfer's, the ranges computed here); None: local."""
        if not self.segments:
            return None
        parts, position = [fp16.slots(0, self.head)], self.head
        for budget, tokens in self.segments:
            got = through_wire(scored.from_position(position), budget, "ours", contract, profile=profile)[0]
            end = fp16.n_tokens if tokens is None else position + tokens
            parts.append(got.slots(0, int(np.searchsorted(got.positions, end))))
            position = end
        parts.append(fp16.slots(position))
        return replace(
            fp16,
            token_ids=np.concatenate([p.token_ids for p in parts]),
            positions=np.concatenate([p.positions for p in parts]),
            keys=np.concatenate([p.keys for p in parts], axis=2),
            values=np.concatenate([p.values for p in parts], axis=2),
        )


def kv_used(report: dict | None) -> str | None:
    """The label of the KV a turn used (``KVOrigin``), None where it cannot be scored."""
    source = KVOrigin.of_report(report)
    return None if source is None else source.label


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
        fp16 = through_wire(scored, 1.0, "ours", contract)[0]
        reference = score_continuation(scorer, prompt.ids, prompt.continuation, fp16)
        for source in sorted(sources):
            kv = KVOrigin.parse(source).kv(scored, fp16, contract, profile)
            score = score_continuation(scorer, prompt.ids, prompt.continuation, kv)
            costs.setdefault(key, {})[source] = {
                "dppl_pct": 100 * math.expm1(score.mean_nll - reference.mean_nll),
                "kl": mean_kl(reference, score),
            }
        print(f"  quality of prompt {key} scored", file=sys.stderr, flush=True)
    return costs
