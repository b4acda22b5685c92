"""serving/heap.py: with the server's malloc settings, buffers freed by worker threads leave the
process (glibc; elsewhere the call says it changed nothing)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Run in a process of its own: in the suite's process (RSS 2.7 GB by then) the heap already holds freed pages
# from earlier tests, which new buffers reuse without raising RSS, so "they were committed" could not be seen.
CHURN = """
import json, threading
import numpy as np, psutil
from edgedecode.serving.heap import return_freed_buffers

applied = return_freed_buffers()
process = psutil.Process()
before = process.memory_info().rss
held = []

def churn():  # growing buffers, each freed before the next: glibc would raise its threshold
    for size in range(1, 33):
        buffer = np.ones(size << 18, np.float32)  # 1 MiB ... 32 MiB
        del buffer
    buffers = [np.ones(1 << 19, np.float32) for _ in range(100)]  # 200 MiB in 2 MiB buffers
    held.append(process.memory_info().rss)
    del buffers

thread = threading.Thread(target=churn)
thread.start()
thread.join()
print(json.dumps({"applied": applied, "before": before, "held": held[0], "after": process.memory_info().rss}))
"""


def test_buffers_freed_on_a_worker_thread_go_back_to_the_os():
    done = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, timeout=300, check=True)
    rss = json.loads(done.stdout)
    if not rss["applied"]:
        pytest.skip("not glibc: the heap keeps its platform's defaults")
    assert rss["held"] - rss["before"] > 150 << 20, rss  # they were committed
    assert rss["after"] - rss["before"] < 20 << 20, rss  # and all but a little went back


# Many small buffers from malloc's heap (bytes objects over pymalloc's 512-byte limit), every tenth kept alive
# between the freed ones, as parsing a vocabulary leaves them: the free pages stay resident until trimmed.
FRAGMENTS = """
import json
import psutil
from edgedecode.serving.heap import release_free_pages

process = psutil.Process()
pieces = [bytes(2000) for _ in range(100_000)]  # ~200 MiB
kept = pieces[::10]
del pieces
freed = process.memory_info().rss
released = release_free_pages()
print(json.dumps({"released": released, "freed": freed, "after": process.memory_info().rss, "kept": len(kept)}))
"""


def test_the_free_pages_between_live_buffers_go_back_to_the_os():
    done = subprocess.run([sys.executable, "-c", FRAGMENTS], capture_output=True, text=True, timeout=300, check=True)
    rss = json.loads(done.stdout)
    if not rss["released"]:
        pytest.skip("not glibc, or nothing to release: the heap keeps its platform's defaults")
    assert rss["freed"] - rss["after"] > 100 << 20, rss  # ~180 MiB of the 200 were free pages between kept ones
