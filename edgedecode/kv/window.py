"""Sliding-window layers and the KV they need: the rule every sender, store and receiver keeps.

A windowed layer's query sees the keys of the last ``sliding_window`` cache slots, itself included
(GroupQueryAttention's ``local_window_size`` counts slots, not positions). So of a prompt's KV a
windowed layer needs only the last ``sliding_window - 1`` tokens, and only if those slots hold the
tokens the model would see there, i.e. none of them was dropped. The rule:

* the **tail** of a prompt, its last ``sliding_window + WINDOW_SLACK`` tokens, is never dropped (by
  the prefill policy, the conversation store's drop rung or the memory ladder's last rung), so a
  windowed layer always sees exactly the window it was trained with;
* the windowed layers' KV is carried (EDKV 2.0 ``window``, docs/kv-format.md) and stored for the
  tail only; a receiver's windowed cells before it are never attended.

``WINDOW_SLACK`` extra tokens let a conversation whose next prompt differs in its last few tokens
(a re-rendered chat template, a client trimming its history) still reuse the KV it holds.
"""

from __future__ import annotations

import numpy as np

from edgedecode.kv.quant import token_nbytes
from edgedecode.kv.tiers import Tier
from edgedecode.model.spec import KVContract

WINDOW_SLACK = 64
# a payload's header and framing beside its KV, generously: contract, meta and chunk table, then base64 token ids,
# positions, tier map and importance (24 + 1.4 × layers bytes a token)
HEADER_BYTES = 8 << 10
HEADER_BYTES_PER_TOKEN = 64


def tail_tokens(contract: KVContract) -> int:
    """Tokens at the end of a prompt that keep every layer's KV and are never dropped (0: no windows)."""
    if not contract.sliding_window or not contract.sliding_layers:
        return 0
    return contract.sliding_window + WINDOW_SLACK


def tail_budget(tokens: int, contract: KVContract, floor_tier: Tier = Tier.INT4) -> float:
    """The smallest budget the KV of a prompt's last ``tokens`` tokens can be asked at: the windowed tail they
    hold is never dropped, so it travels at least at ``floor_tier`` (INT4: the cheapest tier a prefill server's
    default profile keeps), plus the header; 0 for a model without windows. A budget below it is refused
    (``budget_too_small``)."""
    tail = min(tail_tokens(contract), tokens)
    if not tail:
        return 0.0
    fp16 = token_nbytes(Tier.FP16, contract.n_kv_heads, contract.head_dim) * contract.n_layers
    kv = tail * token_nbytes(floor_tier, contract.n_kv_heads, contract.head_dim) * contract.n_layers
    return (kv + HEADER_BYTES + HEADER_BYTES_PER_TOKEN * tokens) / (tokens * fp16)


def window_covers(first_slot: int, slot: int, contract: KVContract) -> bool:
    """Whether a token run at cache ``slot`` finds KV in its windowed layers for every slot its window spans (the
    last ``sliding_window`` slots, itself included), those layers holding KV from ``first_slot`` on."""
    window = contract.sliding_window if contract.sliding_layers else None
    return first_slot == 0 or window is None or first_slot <= slot - window + 1


def window_start(kept: np.ndarray, count: int) -> int:
    """Index of the first of the last ``count`` kept tokens of bool ``kept`` [n] (0 when fewer are kept)."""
    kept_index = np.flatnonzero(kept)
    return int(kept_index[-count]) if 0 < count <= len(kept_index) else 0


def carried_from(kept: np.ndarray, contract: KVContract, valid_from: int = 0) -> int | None:
    """Where the windowed layers' KV of a held conversation starts being kept (EDKV ``window_start``): at its
    tail's first kept token, or at ``valid_from`` (the first token its windowed layers hold KV for) if later;
    None for a model without windows."""
    if not tail_tokens(contract):
        return None
    return max(window_start(kept, tail_tokens(contract)), valid_from)


def tail_mask(n_tokens: int, contract: KVContract) -> np.ndarray:
    """bool [n]: the tokens of an ``n_tokens`` prompt that must not be dropped (its windowed tail)."""
    mask = np.zeros(n_tokens, bool)
    tail = tail_tokens(contract)
    if tail:
        mask[max(n_tokens - tail, 0) :] = True
    return mask


def windowed_cost_scale(n_tokens: int, contract: KVContract, start: int | None = None) -> np.ndarray:
    """float64 [n]: each token's wire cost relative to all layers when the windowed layers carry the tokens
    from ``start`` on only (None: the tail): 1 from there, the global layers' share before it."""
    scale = np.ones(n_tokens)
    if tail_tokens(contract):
        before = ~tail_mask(n_tokens, contract) if start is None else np.arange(n_tokens) < start
        scale[before] = (contract.n_layers - len(contract.sliding_layers)) / contract.n_layers
    return scale
