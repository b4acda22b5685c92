"""serving/heap.py: with the server's malloc settings, buffers freed by worker threads leave the
process (glibc; elsewhere the call says it changed nothing)."""

from __future__ import annotations

import threading

import numpy as np
import psutil
import pytest

from edgedecode.serving.heap import return_freed_buffers


def test_buffers_freed_on_a_worker_thread_go_back_to_the_os():
    if not return_freed_buffers():
        pytest.skip("not glibc: the heap keeps its platform's defaults")
    process = psutil.Process()
    before = process.memory_info().rss
    held: list[float] = []

    def churn() -> None:  # growing buffers, each freed before the next: glibc would raise its threshold
        for size in range(1, 33):
            buffer = np.ones(size << 18, np.float32)  # 1 MiB ... 32 MiB
            del buffer
        buffers = [np.ones(1 << 19, np.float32) for _ in range(100)]  # 200 MiB in 2 MiB buffers
        held.append(process.memory_info().rss)
        del buffers

    thread = threading.Thread(target=churn)
    thread.start()
    thread.join()
    assert held[0] - before > 150 << 20  # they were committed
    assert process.memory_info().rss - before < 20 << 20  # and all but a little went back
