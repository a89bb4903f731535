"""Freed C-heap pages between live objects go back to the system when asked."""

from __future__ import annotations

import platform

import psutil
import pytest

from actors.runtime import heap


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_pages_freed_between_live_objects_are_given_back() -> None:
    """72 MB of 16 KB objects freed between small ones that stay (what a load's decoded
    records leave among the states kept) stay in the RSS until give_back hands them back."""
    process = psutil.Process()
    freed: list[bytes] = []
    kept: list[bytes] = []
    for step in range(5000):
        freed.append(bytes(16_000))
        if step % 16 == 0:
            kept.append(bytes(1000))  # over pymalloc's 512 bytes: from the C heap too
    del freed
    before = process.memory_info().rss
    assert heap.give_back()
    assert before - process.memory_info().rss > 40 * 2**20
    assert len(kept) == 313
