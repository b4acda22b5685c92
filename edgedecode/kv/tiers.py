"""Per-token precision tiers of transferred KV and what each costs on the wire before compression."""

from __future__ import annotations

from enum import IntEnum


class Tier(IntEnum):
    """Precision of one token's K and V in one layer. Codes are stored on the wire: never renumber."""

    FP16 = 0
    INT8 = 1
    INT4 = 2
    INT2 = 3
    DROP = 4
    INT3 = 5  # EDKV 1.3; after DROP, so a list built in Tier order is indexed by code


QUANTIZED_TIERS = (Tier.INT8, Tier.INT4, Tier.INT3, Tier.INT2)
TIER_BITS = {Tier.FP16: 16, Tier.INT8: 8, Tier.INT4: 4, Tier.INT3: 3, Tier.INT2: 2, Tier.DROP: 0}


def parse_tiers(names: str | list[str]) -> tuple[Tier, ...]:
    """Tiers from names such as "fp16,int8,int4" (case-insensitive); unknown names are a ValueError."""
    items = names.split(",") if isinstance(names, str) else names
    tiers = []
    for item in items:
        key = item.strip().upper()
        if key not in Tier.__members__:
            raise ValueError(f"unknown KV tier {item.strip()!r}; known: {', '.join(t.name.lower() for t in Tier)}")
        tiers.append(Tier[key])
    return tuple(sorted(set(tiers)))
