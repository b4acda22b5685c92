"""The prefill side of a KV handoff: the higher-precision graph, token scoring and EDKV encoding."""
