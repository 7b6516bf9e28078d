"""`release_free_heap`: memory freed below a live allocation stays resident until it is called (glibc keeps
it in the heap), and leaves the resident set when it is. Run in a fresh interpreter so no other test's heap
is measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = r"""
import json
from cann_llm.runtime.heap_trim import release_free_heap

def resident():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

chunks = [bytes(range(256)) * 4 + bytes([i % 256]) for i in range(60_000)]  # ~60 MB in the C heap
pinned = [bytes(1025) for _ in range(100)]  # above them: the heap's top cannot shrink past these
full = resident()
del chunks
freed = resident()
release_free_heap()
print(json.dumps({"full": full, "freed": freed, "trimmed": resident()}))
"""


def test_freed_heap_leaves_the_resident_set_only_when_released():
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    sizes = json.loads(out.stdout)
    assert sizes["full"] - sizes["freed"] < 10  # glibc keeps what was freed under a live allocation
    assert sizes["freed"] - sizes["trimmed"] > 40
