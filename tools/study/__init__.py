"""Quality studies and their reports: what KV handoff, cross-quant prefill, dropped or compressed KV and
sliding windows cost in quality; which quantized operator forms onnxruntime runs (tools/README.md)."""
