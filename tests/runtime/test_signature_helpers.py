"""Signature checks in helper processes answer what a check in this process answers, and
a helper that fails costs nothing but its speed: its batches are checked here."""

from __future__ import annotations

import base64
import fcntl
import os
import signal
from pathlib import Path

import psutil
import pytest

from actors.runtime import signature_helpers
from actors.runtime.signature_helpers import Item, SignatureChecks, check
from schemas.signing import HEADER_KEY, HEADER_SIG, KeyPair

SIGNER = KeyPair.generate()
OTHER = KeyPair.generate()


def batch(size: int) -> list[Item]:
    """Good and bad messages in turn: signed, tampered with, another key's signature, no
    signature, no key, a signature that is not base64, one of the wrong length, a key
    that is not an nkey."""
    items: list[Item] = []
    for index in range(size):
        body = os.urandom(64) + index.to_bytes(4, "big")
        headers = SIGNER.headers(body)
        key, sig = headers[HEADER_KEY], headers[HEADER_SIG]
        kind = index % 8
        if kind == 1:
            body = body[:-1] + b"x"
        elif kind == 2:
            sig = OTHER.headers(body)[HEADER_SIG]
        elif kind == 3:
            sig = None  # type: ignore[assignment]
        elif kind == 4:
            key = None  # type: ignore[assignment]
        elif kind == 5:
            sig = "not base64!"
        elif kind == 6:
            sig = base64.b64encode(b"short").decode()
        elif kind == 7:
            key = "U" + "A" * 10
        items.append((key, sig, body))
    return items


def working(checks: SignatureChecks) -> int:
    """Helpers started and still sent batches."""
    return sum(not helper.ended for helper in checks._helpers)


async def started(checks: SignatureChecks) -> None:
    """Wait for the helpers to have started (each is sent batches as it does)."""
    assert checks._starting is not None
    await checks._starting


async def test_helpers_answer_what_a_check_here_answers() -> None:
    items = batch(400)
    here = [check(item) for item in items]
    assert here[0] == "" and all(here[index] for index in range(1, 8))  # each bad one said
    async with SignatureChecks(2) as checks:
        assert working(checks) == 0  # none started before a list needs them
        pending = [checks.submit(items[start : start + 100]) for start in range(0, 400, 100)]
        await started(checks)
        answered = [answer for checking in pending for answer in await checking.answers()]
        assert working(checks) == 2  # none given up
    assert answered == here


async def test_small_batches_and_no_helpers_are_checked_here() -> None:
    items = batch(200)
    async with SignatureChecks(0) as checks:
        assert await checks.submit(items).answers() == [check(item) for item in items]
    async with SignatureChecks(1) as checks:
        few = batch(signature_helpers.HELPED_FROM - 1)
        checking = checks.submit(few)
        assert all(b.answers.done() for b in checking.batches)  # before any round trip
        assert await checking.answers() == [check(item) for item in few]
        assert not psutil.Process().children()  # none started for it


async def test_the_reader_checks_what_no_helper_took_without_waiting_for_one() -> None:
    items = batch(400)
    async with SignatureChecks(2) as checks:
        checking = checks.submit(items)  # the helpers are not started yet
        assert await checking.answers() == [check(item) for item in items]
        assert not any(b.sent for b in checking.batches)


async def test_a_helper_killed_midway_leaves_its_batches_checked_here() -> None:
    items = batch(800)
    async with SignatureChecks(1) as checks:
        first = checks.submit(items[:400])
        await started(checks)
        (helper,) = psutil.Process().children()
        assert await first.answers() == [check(item) for item in items[:400]]
        assert all(b.sent for b in first.batches)  # the helper took all (nothing asked)
        helper.send_signal(signal.SIGKILL)
        helper.wait(10)
        second = checks.submit(items[400:])
        assert await second.answers() == [check(item) for item in items[400:]]
        assert working(checks) == 0  # given up: not sent more
        third = checks.submit(items[:100])
        assert not any(b.sent for b in third.batches)
        assert await third.answers() == [check(item) for item in items[:100]]


async def test_a_helper_answering_nonsense_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    items = batch(200)
    async with SignatureChecks(1) as checks:
        # As if the helper had answered for another batch: one answer short.
        real = signature_helpers._answers.decode
        monkeypatch.setattr(
            signature_helpers,
            "_answers",
            type("Short", (), {"decode": staticmethod(lambda raw: real(raw)[:-1])})(),
        )
        checking = checks.submit(items)
        await started(checks)
        assert await checking.answers() == [check(item) for item in items]
        assert working(checks) == 0


PIPE_MAX = int(Path("/proc/sys/fs/pipe-max-size").read_text())
"""The most a pipe may hold here (Linux)."""


async def test_helpers_run_in_their_own_session_and_end_with_the_checks() -> None:
    async with SignatureChecks(2) as checks:
        items = batch(100)
        checking = checks.submit(items)
        await started(checks)
        children = psutil.Process().children()
        assert len(children) == 2
        for child in children:
            # A terminal's Ctrl-C goes to its foreground process group: not to theirs.
            assert os.getsid(child.pid) == child.pid != os.getsid(0)
        # Each one's input holds two batches (the system's most), not 64 KB of one.
        for helper in checks._helpers:
            assert helper.process.stdin is not None
            pipe = helper.process.stdin.transport.get_extra_info("pipe")
            widened = fcntl.fcntl(pipe.fileno(), fcntl.F_GETPIPE_SZ)
            assert widened == min(signature_helpers.PIPE_BYTES, PIPE_MAX)
        assert await checking.answers() == [check(item) for item in items]
    assert not psutil.Process().children()


@pytest.mark.parametrize(("cores", "helpers"), [(1, 0), (2, 1), (3, 2), (64, 2)])
def test_helpers_are_one_fewer_than_the_cores_usable_at_most_two(
    monkeypatch: pytest.MonkeyPatch, cores: int, helpers: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert signature_helpers.default_helpers() == helpers
