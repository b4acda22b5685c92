"""Speed and memory benchmarks: decode and prefill speed, KV encode and ingest, TTFT through the real
servers, memory under a KV budget, RSS, the prefill tier on Ray Serve (tools/README.md)."""
