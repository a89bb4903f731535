"""Freed C-heap pages between live objects go back to the system when asked; the
collector paused for a bulk read runs again when the last pause ends."""

from __future__ import annotations

import asyncio
import gc
import json
import platform
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.runtime import heap

REPO = Path(__file__).resolve().parents[2]

SCENARIO = """
import json
import psutil
from actors.runtime import heap
process = psutil.Process()
freed, kept = [], []
for step in range(5000):
    freed.append(bytes(16_000))
    if step % 16 == 0:
        kept.append(bytes(1000))  # over pymalloc's 512 bytes: from the C heap too
del freed
before = process.memory_info().rss
gave = heap.give_back()
print(json.dumps({"gave": gave, "drop": before - process.memory_info().rss, "kept": len(kept)}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_pages_freed_between_live_objects_are_given_back() -> None:
    """72 MB of 16 KB objects freed between small ones that stay (what a load's decoded
    records leave among the states kept) stay in the RSS until give_back hands them back.
    In a fresh interpreter: a test process's heap, shaped by the tests before, may reuse
    free chunks it already had and leave less to give back."""
    run = subprocess.run(
        [sys.executable, "-c", SCENARIO],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["gave"] is True
    assert result["drop"] > 40 * 2**20, f"only {result['drop'] / 2**20:.1f} MiB given back"
    assert result["kept"] == 313


@pytest.fixture
def collector_on() -> Iterator[None]:
    """The collector on for the test, and as it was after."""
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


@pytest.mark.usefixtures("collector_on")
async def test_the_collector_runs_again_only_when_the_last_overlapping_pause_ends() -> None:
    """Two reads of one loop overlap: the first to end must not turn the collector on
    under the second, which is still decoding."""
    first_in, second_in, first_out = asyncio.Event(), asyncio.Event(), asyncio.Event()
    seen: list[tuple[str, bool]] = []

    async def first() -> None:
        with heap.collector_paused():
            first_in.set()
            await second_in.wait()
        first_out.set()

    async def second() -> None:
        await first_in.wait()
        with heap.collector_paused():
            second_in.set()
            await first_out.wait()
            seen.append(("second, after the first ended", gc.isenabled()))
            with heap.collector_paused():  # nested
                pass
            seen.append(("second, after a nested pause", gc.isenabled()))
        seen.append(("after both", gc.isenabled()))

    await asyncio.gather(first(), second())
    assert seen == [
        ("second, after the first ended", False),
        ("second, after a nested pause", False),
        ("after both", True),
    ]


@pytest.mark.usefixtures("collector_on")
def test_an_error_in_the_block_still_lets_the_collector_run_again() -> None:
    with pytest.raises(RuntimeError), heap.collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("a read that failed")
    assert gc.isenabled()


@pytest.mark.usefixtures("collector_on")
async def test_pauses_kept_overlapping_past_the_bound_collect_at_the_next_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reads that keep overlapping (a fleet API polled without rest) would keep the
    collector off for good: a pause that begins after MAX_PAUSED collects first, so a
    cycle left meanwhile is freed while the reads go on."""
    monkeypatch.setattr(heap, "MAX_PAUSED", 0.0)  # any later pause is past it
    first_in, second_done = asyncio.Event(), asyncio.Event()

    class Cycle:
        me: object

    async def first() -> None:
        with heap.collector_paused():
            first_in.set()
            await second_done.wait()

    async def second() -> weakref.ref[Cycle]:
        await first_in.wait()
        garbage = Cycle()
        garbage.me = garbage
        left = weakref.ref(garbage)
        del garbage
        assert left() is not None  # a cycle: only the collector frees it
        with heap.collector_paused():
            pass  # begins past the bound while the first still holds the collector off
        second_done.set()
        return left

    _, left = await asyncio.gather(first(), second())
    assert left() is None


def test_a_collector_turned_off_before_stays_off() -> None:
    was = gc.isenabled()
    gc.disable()
    try:
        with heap.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()
