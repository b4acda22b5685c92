"""Runtime layer, shared by the prefill and decode sides: onnxruntime sessions, KV buffers, the
CUDA-graph step, sampling and the token-by-token engine."""
