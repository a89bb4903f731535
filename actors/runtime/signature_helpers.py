"""Signature checks of a large read in helper processes, beside the process reading.

A live listing of 100,000 nodes checks up to 100,000 Ed25519 signatures (``Fleet-Sig``
over heartbeats of about 4.6 KB): about 4 s of a core, a quarter of the listing, in the
process that also receives, decodes and prints it. libsodium lets go of the GIL, but a
thread does not help: while the reading thread runs Python, each check waits for the
interpreter's switch interval before it takes the GIL back (5.2 ms a check measured,
against 43 µs alone). :class:`SignatureChecks` shares the checks with helper processes
(``python -P -m actors.runtime.signature_helpers``) over their stdin and stdout instead:
:meth:`~SignatureChecks.submit` returns at once, the reader goes on with other work while
the helpers check, and checks itself what they have not taken when it needs the answers.
Helpers run at a lower priority (``nice`` 10): on a machine that also runs the NATS server
the reader reads from, the server's answers come first.

A helper answers exactly what :func:`check` answers in this process. If a helper fails
in any way, its batches are checked here instead and no helper is sent more, so a check
is never skipped. Ways a helper can fail: it cannot start, dies, answers late, or answers
something that is not an answer.

Helpers run in a session of their own, so a Ctrl-C to the terminal's process group
reaches only the reader, which ends them. They also end when their input ends, so a
reader killed outright leaves none behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import struct
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import msgspec

from actors.runtime.python_children import child_env, module_command
from schemas import signing
from schemas.errors import SignatureError

Item = tuple[str | None, str | None, bytes]
"""One message to check: its ``Fleet-Key`` and ``Fleet-Sig`` headers (None: absent) and
its body."""

LENGTH = struct.Struct(">I")
"""Each frame's length, ahead of it: a batch of :data:`Item` one way, their answers
(:func:`check`'s) the other, as MessagePack."""
HELPED_FROM = 64
"""Lists of fewer items are checked in this process: a round trip costs more."""
BATCH = 100
"""Items a helper is sent at once: about 5 ms of checks, 470 KB of heartbeats."""
IN_FLIGHT = 2
"""Batches a helper holds at once: the one it checks and the next, in its pipe."""
PIPE_BYTES = 2**20
"""What a helper's input pipe holds (Linux's most for an unprivileged process): two
batches."""
ANSWER_TIMEOUT = 60.0
"""Seconds a helper may take to answer a batch (about 5 ms of checks) before it is
given up on."""
STOP_WAIT = 2.0
"""Seconds a helper has to end once its input is closed before it is killed."""

_items = msgspec.msgpack.Decoder(list[Item])
_answers = msgspec.msgpack.Decoder(list[str])
_encoder = msgspec.msgpack.Encoder()


def check(item: Item) -> str:
    """``""`` when the body's signature holds under the key its ``Fleet-Key`` names, else
    why not (:func:`schemas.signing.verify`'s reason)."""
    key, sig, body = item
    headers = {
        name: value
        for name, value in ((signing.HEADER_KEY, key), (signing.HEADER_SIG, sig))
        if value is not None
    }
    try:
        signing.verify(headers, body)
    except SignatureError as exc:
        return exc.reason
    return ""


def default_helpers() -> int:
    """Helpers for a large read on this machine: one fewer than the cores this process
    may run on, at most two (the reading process, not the checks, is then what a read
    waits for), none on one core."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cores = len(usable) if usable is not None else os.cpu_count() or 1
    return max(0, min(2, cores - 1))


@dataclass(eq=False)
class _Batch:
    """Up to BATCH items, queued, then sent to a helper (``sent``) or checked here."""

    items: list[Item]
    answers: asyncio.Future[list[str]]
    sent: bool = False


def _settle(batch: _Batch, answers: list[str]) -> None:
    """Give ``batch`` its ``answers``, unless it has them (or was given up on, timed out)."""
    if not batch.answers.done():
        batch.answers.set_result(answers)


class _Helper:
    """One helper process and the batches it was sent, answered in order; ``answered``
    is called after each answer."""

    def __init__(self, process: asyncio.subprocess.Process, answered: Callable[[], None]) -> None:
        self.process = process
        self.answered = answered
        self.waiting: deque[_Batch] = deque()
        self.ended = False
        """Its answers ended (it exited, or answered nonsense): it is sent nothing more."""
        self.reading = asyncio.create_task(self._read())

    async def _read(self) -> None:
        """Hand each answer to the batch it answers, until the helper ends or answers what
        is not an answer."""
        assert self.process.stdout is not None  # started with a pipe
        with contextlib.suppress(asyncio.IncompleteReadError, msgspec.DecodeError, OSError):
            while True:
                (size,) = LENGTH.unpack(await self.process.stdout.readexactly(LENGTH.size))
                answers = _answers.decode(await self.process.stdout.readexactly(size))
                if not self.waiting:
                    break  # an answer to no batch
                _settle(self.waiting.popleft(), answers)
                self.answered()
        self._fail()

    def _fail(self) -> None:
        """No answer will come: each batch waiting is answered with none (checked here)."""
        self.ended = True
        while self.waiting:
            _settle(self.waiting.popleft(), [])

    def send(self, batch: _Batch) -> None:
        """Write ``batch`` to the helper (buffered: a helper holds at most IN_FLIGHT)."""
        assert self.process.stdin is not None  # started with a pipe
        payload = _encoder.encode(batch.items)
        self.process.stdin.write(LENGTH.pack(len(payload)))
        self.process.stdin.write(payload)
        batch.sent = True
        self.waiting.append(batch)

    async def stop(self) -> None:
        """Close its input and wait for it to end (killed after STOP_WAIT)."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            async with asyncio.timeout(STOP_WAIT):
                await self.process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()
        self.reading.cancel()
        # Waited for, not awaited: its cancellation is not this task's (a Ctrl-C cancelling
        # the reader must not be taken for it and swallowed).
        await asyncio.wait([self.reading])
        self._fail()


def _widen(pipe: Any) -> None:
    """Let ``pipe`` hold PIPE_BYTES (as much as the system allows): a pipe holds 64 KB,
    and the reader refills it only between its own steps, so a helper would wait for
    most of each batch while the reader works."""
    resize = getattr(fcntl, "F_SETPIPE_SZ", None)  # Linux's alone
    if resize is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(pipe.fileno(), resize, PIPE_BYTES)


class SignatureChecks:
    """Checks of lists of :data:`Item` shared between this process and up to ``wanted``
    helper processes (none: every check made here), started with the first list of
    HELPED_FROM items or more: a read that checks nothing starts none.

    A list is cut into batches of BATCH, queued; each helper is sent the next queued
    batch as it answers one, holding at most IN_FLIGHT. When the answers are asked for
    (:meth:`Checking.answers`), the batches still queued are checked here: this process
    never waits while there is a check it could make (nor for the helpers to start), and
    helpers slowed by a busy machine take only what they keep up with."""

    def __init__(self, wanted: int) -> None:
        self.wanted = wanted
        self._helpers: list[_Helper] = []
        self._starting: asyncio.Task[None] | None = None
        self.queued: deque[_Batch] = deque()

    async def __aenter__(self) -> SignatureChecks:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        """End the helpers; none is started after."""
        self.wanted = 0
        if self._starting is not None:
            self._starting.cancel()
            await asyncio.wait([self._starting])  # as the helpers' reading tasks
        helpers, self._helpers = self._helpers, []
        await asyncio.gather(*(helper.stop() for helper in helpers))

    async def _start(self) -> None:
        for _ in range(self.wanted):
            try:
                process = await asyncio.create_subprocess_exec(
                    *module_command(__name__),
                    env=child_env(),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError:
                return  # checked here: never skipped
            assert process.stdin is not None  # started with a pipe
            _widen(process.stdin.transport.get_extra_info("pipe"))
            self._helpers.append(_Helper(process, self._feed))
            self._feed()

    def submit(self, items: list[Item]) -> Checking:
        """The checks of ``items`` (:func:`check`'s answers, in order), begun: made here at
        once for fewer than HELPED_FROM items or without helpers wanted, else queued (the
        helpers started, the first time)."""
        loop = asyncio.get_running_loop()
        batches = [
            _Batch(items[start : start + BATCH], loop.create_future())
            for start in range(0, len(items), BATCH)
        ]
        if len(items) < HELPED_FROM or not self.wanted:
            for batch in batches:
                batch.answers.set_result([check(item) for item in batch.items])
        else:
            self.queued.extend(batches)
            if self._starting is None:
                self._starting = asyncio.create_task(self._start())
            self._feed()
        return Checking(self, batches)

    def _feed(self) -> None:
        """Send queued batches to the helpers with room for one."""
        for helper in self._helpers:
            while self.queued and not helper.ended and len(helper.waiting) < IN_FLIGHT:
                helper.send(self.queued.popleft())

    async def answer(self, batch: _Batch) -> list[str]:
        """``batch``'s answers: checked here if it is still queued, else its helper's (or,
        if that helper fails, checked here after all, and no helper is sent more)."""
        if not batch.sent and not batch.answers.done():
            self.queued.remove(batch)
            batch.answers.set_result([check(item) for item in batch.items])
        try:
            async with asyncio.timeout(ANSWER_TIMEOUT):
                answers = await batch.answers
        except TimeoutError:
            answers = []
        if len(answers) != len(batch.items):
            await self.__aexit__(None, None, None)
            return [check(item) for item in batch.items]
        return answers


@dataclass(frozen=True)
class Checking:
    """The checks of one list of items (:meth:`SignatureChecks.submit`)."""

    checks: SignatureChecks
    batches: list[_Batch]

    async def answers(self) -> list[str]:
        """:func:`check`'s answer for each item, in order."""
        return [answer for batch in self.batches for answer in await self.checks.answer(batch)]


def serve() -> None:
    """A helper: answer each batch read from stdin on stdout until stdin ends."""
    os.nice(10)
    read, write = sys.stdin.buffer, sys.stdout.buffer
    while header := read.read(LENGTH.size):
        if len(header) < LENGTH.size:
            return
        (size,) = LENGTH.unpack(header)
        payload = read.read(size)
        if len(payload) < size:
            return
        answers = _encoder.encode([check(item) for item in _items.decode(payload)])
        write.write(LENGTH.pack(len(answers)))
        write.write(answers)
        write.flush()


if __name__ == "__main__":
    serve()
