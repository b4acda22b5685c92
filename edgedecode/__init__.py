"""edgedecode: an edge decode runtime for prefill-decode disaggregated LLM inference."""

__version__ = "0.1.0"
