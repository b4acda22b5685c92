"""The single-token decode step as a captured CUDA graph (onnxruntime's CUDA provider, ``enable_cuda_graph``).

On replay onnxruntime skips its executor and relaunches the captured kernels on the addresses and
shapes of the capture. So every input and output of the step is a fixed device buffer of a fixed
shape, written in place before each replay:

* ``input_ids``, ``position_ids`` and ``attention_mask`` are views of one int64 device buffer
  ``[id, position, mask × max_context]``, refreshed by one host-to-device copy per step. The mask
  has full width: ones for the occupied slots and the new token, zeros after. The graph derives
  GQA's seqlens_k from its sum (on the device) and total_sequence_length from its width, which the
  CPU computes at capture and which stays max_context, so nothing frozen at capture changes.
* the KV buffers are the cache's own, bound as both past and present as in every run;
* ``logits`` ``[1, 1, vocab]`` stays on the device and is read back after each replay.

Prompt passes (several tokens, or all logits) cannot replay the graph; the engine runs them in the
same session with ``gpu_graph_id = -1`` (no capture, no replay).
"""

from __future__ import annotations

import numpy as np

from edgedecode.runtime.kvcache import KVCache
from edgedecode.runtime.session import graph_run_options, import_onnxruntime

CAPTURED_GRAPH_ID = 1  # 0 is onnxruntime's default id; -1 means "not captured"
UNCAPTURED_GRAPH_ID = -1


class CudaGraphStep:
    """Fixed device buffers bound for one-token decode steps, replayed through a captured CUDA graph."""

    def __init__(
        self, session, cache: KVCache, vocab_size: int, dtype: np.dtype, graph_id: int = CAPTURED_GRAPH_ID
    ) -> None:
        """``graph_id``: the capture's id in ``session``; engines sharing a session each need their own."""
        ort = import_onnxruntime()
        width = cache.max_context
        self._session = session
        self._host = np.zeros(2 + width, np.int64)  # [token id, position, attention mask [max_context]]
        self._filled = 0  # ones currently set at the head of the host mask
        self._device = ort.OrtValue.ortvalue_from_numpy(self._host, "cuda", 0)
        self._last_position = ort.OrtValue.ortvalue_from_numpy(np.array([-1], np.int64), "cuda", 0)
        self.logits = ort.OrtValue.ortvalue_from_shape_and_type([1, 1, vocab_size], dtype, "cuda", 0)
        base, int64_bytes = self._device.data_ptr(), 8
        io = session.io_binding()
        io.bind_input("input_ids", "cuda", 0, np.int64, [1, 1], base)
        io.bind_input("position_ids", "cuda", 0, np.int64, [1, 1], base + int64_bytes)
        io.bind_input("attention_mask", "cuda", 0, np.int64, [1, width], base + 2 * int64_bytes)
        io.bind_ortvalue_input("logits_positions", self._last_position)
        for layer, pair in enumerate(cache.ortvalues):
            for name, buffer in zip(("key", "value"), pair):
                io.bind_ortvalue_input(f"past_key_values.{layer}.{name}", buffer)
                io.bind_ortvalue_output(f"present.{layer}.{name}", buffer)
        io.bind_ortvalue_output("logits", self.logits)
        self._io = io
        self._options = graph_run_options(graph_id)

    def run(self, token: int, slot: int, position: int) -> np.ndarray:
        """Decode ``token`` into cache ``slot`` at true ``position``; returns its logits [vocab] (a fresh host copy).

        The first call captures the graph (onnxruntime runs the step normally once, then captures
        and replays it); every later call replays it.
        """
        host, mask_end = self._host, 2 + slot + 1
        host[0], host[1] = token, position
        if mask_end > 2 + self._filled:
            host[2 + self._filled : mask_end] = 1
        else:
            host[mask_end : 2 + self._filled] = 0
        self._filled = slot + 1
        self._device.update_inplace(host)
        # update_inplace copies on CUDA's legacy stream; the graph replays on the provider's own
        # non-blocking stream, so wait for the copy to land before launching.
        self._io.synchronize_inputs()
        self._session.run_with_iobinding(self._io, self._options)
        return self.logits.numpy()[0, 0]
