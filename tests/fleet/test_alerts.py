"""An alert FLEET_ALERTS does not acknowledge is raised again, under its own id, until it
is stored (once), for RESEND_FOR at most; then it is logged as lost."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from actors.fleet.alerts import publisher as publisher_module
from actors.fleet.alerts.publisher import AlertPublisher
from actors.fleet.storage.streams import provision
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.messages import Alert
from schemas.subjects import STREAM_ALERTS, Subjects
from tests.support.fleet import TEST_LIMITS, wait_for


async def stored(bus: NatsBus, subjects: Subjects) -> int:
    info = await bus.js.stream_info(subjects.stream_name(STREAM_ALERTS))
    return int(info.state.messages)


async def test_an_unacknowledged_alert_is_raised_until_stored_once(bus: NatsBus) -> None:
    """With no stream to store it (no responders), the alert waits; once the stream is
    there, the next flush stores it, and flushes after that store nothing more."""
    subjects = Subjects("unstored")  # no streams yet: every publish fails at once
    publisher = AlertPublisher(bus, subjects)
    await publisher.publish("stale", "c1", "n1", "no heartbeat for 5s", "q7")
    assert list(publisher.unsent) == ["stale:c1:n1:q7"]
    await publisher.flush()
    assert list(publisher.unsent) == ["stale:c1:n1:q7"]
    await provision(bus.js, subjects, limits=TEST_LIMITS)
    await publisher.flush()
    assert publisher.unsent == {}
    await publisher.flush()
    assert await stored(bus, subjects) == 1


async def test_an_alert_whose_publish_is_cancelled_in_flight_is_raised_again(
    bus: NatsBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The work that raised an alert is cancelled while its publish waits for the
    stream's answer (a fault round: a refusal's replay alert, then the aggregator's
    leases fenced 4.5 s later, the partition's work stopped): the alert is kept, and the
    next flush stores it (it was never stored before)."""
    subjects = Subjects("cancelled")
    await provision(bus.js, subjects, limits=TEST_LIMITS)
    publisher = AlertPublisher(bus, subjects)
    in_flight = asyncio.Event()
    real_publish = bus.js.publish

    async def unanswered(*args: object, **kwargs: object) -> None:
        in_flight.set()
        await asyncio.Event().wait()  # no answer: only a cancel ends it

    monkeypatch.setattr(bus.js, "publish", unanswered)
    raising = asyncio.create_task(publisher.publish("replay", "c1", "g4", "seq 1032", "s442"))
    await in_flight.wait()
    raising.cancel()
    with pytest.raises(asyncio.CancelledError):
        await raising
    assert list(publisher.unsent) == ["replay:c1:g4:s442"]
    monkeypatch.setattr(bus.js, "publish", real_publish)
    await publisher.flush()
    assert publisher.unsent == {}
    assert await stored(bus, subjects) == 1


async def test_an_alert_unacknowledged_past_its_time_is_logged_lost(
    bus: NatsBus, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Past RESEND_FOR (inside the stream's duplicate window) the alert is given up, and
    the log says it was lost, naming it."""
    monkeypatch.setattr(publisher_module, "RESEND_FOR", 0.0)
    publisher = AlertPublisher(bus, Subjects("neverstored"))
    await publisher.publish("offline", "c1", "n2", "stale for 5m", "q9")
    with caplog.at_level(logging.ERROR, logger="actors.fleet.alerts.publisher"):
        await publisher.flush()
    assert publisher.unsent == {}
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.message == "alert lost: not acknowledged in time"
    assert record.alert == "offline:c1:n2:q9"  # type: ignore[attr-defined]


async def test_a_window_is_summarised_once_while_a_flush_runs_beside_its_publish(
    bus: NatsBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A limited alert after its window closed sends the window's summary; a flush that
    runs while that summary is being published does not summarise the same window again
    (a refusal flood on a busy machine counted 99 alerts for 76 refusals)."""
    subjects = Subjects("summarised")
    await provision(bus.js, subjects, limits=TEST_LIMITS)
    publisher = AlertPublisher(bus, subjects, window=0.05)
    sent: list[dict[str, str]] = []
    summary_sent = asyncio.Event()
    gate = asyncio.Event()
    publish = publisher._publish

    async def publish_slowly(alert_id: str, subject: str, body: bytes) -> bool:
        alert = codec.decode(body, Alert, subject)
        sent.append(alert.details)
        if "suppressed" in alert.details and not summary_sent.is_set():
            summary_sent.set()
            await gate.wait()  # a loaded server's slow acknowledgement of the first
        return await publish(alert_id, subject, body)

    monkeypatch.setattr(publisher, "_publish", publish_slowly)
    for seq in range(4):
        await publisher.publish("bad_signature", "c1", "n1", "unsigned", f"s{seq}")
    window = publisher.windows["bad_signature", "c1", "n1"]
    assert window.suppressed == 3
    await wait_for(lambda: time.monotonic() >= window.closes)
    flooding = asyncio.create_task(publisher.publish("bad_signature", "c1", "n1", "unsigned", "s4"))
    await summary_sent.wait()
    await publisher.flush()
    gate.set()
    await flooding
    summaries = [int(details["suppressed"]) for details in sent if "suppressed" in details]
    assert summaries == [3]
