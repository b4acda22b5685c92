"""Decode layer: KV buffers, sampling and the token-by-token engine."""
