"""KV transfer: the snapshot handed between graphs, precision tiers, quantizers and the EDKV wire format."""
