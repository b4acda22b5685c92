"""The edge decode daemon: OpenAI-compatible API over the INT4 decode graph, KV pulled from a prefill node."""
