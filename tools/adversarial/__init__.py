"""Adversarial runs against the servers and the KV decoder: hostile HTTP and clients, failing prefill
peers, the EDKV fuzzer, load and isolation (tools/README.md)."""
