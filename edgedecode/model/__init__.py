"""Model layer: GGUF files, model specs, tokenizers and ONNX graph building."""
