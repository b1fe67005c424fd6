"""`release_free_memory` (`trainer.release_memory`): what glibc keeps free inside its heap goes back to the OS."""

import os
import sys

import pytest

from empo2.utils import release_free_memory


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; malloc_trim is glibc's")
def test_memory_freed_below_the_heaps_top_returns_to_the_os():
    blocks = [bytearray(100_000) for _ in range(2000)]  # 200 MB under glibc's mmap threshold: on the heap
    for block in blocks:
        block[::4096] = b"\1" * len(block[::4096])  # touch every page
    del blocks[:-1]  # the last block keeps the heap's top in use, so glibc cannot trim the rest by itself
    before = _rss_mib()
    release_free_memory()
    after = _rss_mib()
    assert before - after > 150, (before, after)
    release_free_memory()  # nothing left to return: harmless
