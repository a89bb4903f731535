"""Fleet settings for tests: an operator writing entries as ``fleetctl settings set``
does, and a wait for a node's heartbeat to say what it made of them."""

from __future__ import annotations

import time
from collections.abc import Callable

from actors.fleet.storage import settings as settings_store
from actors.runtime.bus import NatsBus
from schemas.messages import Heartbeat, NodeRecord
from schemas.settings import Scope, SettingsEntry, SettingsStatus
from schemas.signing import KeyPair
from schemas.subjects import Subjects
from tests.support.fleet import HANG, wait_record


async def put_settings(
    bus: NatsBus,
    prefix: str,
    operator: KeyPair,
    values: dict[str, str],
    *,
    cluster: str = "",
    selector: dict[str, str] | None = None,
) -> SettingsEntry:
    """Write ``values`` as the whole entry of the fleet, ``cluster`` or ``selector``,
    signed by ``operator``, at the next revision."""
    scope: Scope = "selector" if selector else "cluster" if cluster else "fleet"
    draft = SettingsEntry(
        scope=scope,
        revision=1,
        issued_at=time.time(),
        values=values,
        cluster=cluster,
        selector=selector or {},
    )
    entry, _ = await settings_store.put(bus, Subjects(prefix), operator, draft)
    return entry


async def wait_settings(
    bus: NatsBus,
    prefix: str,
    node: str,
    check: Callable[[SettingsStatus, Heartbeat], bool],
    timeout: float = HANG,
) -> Heartbeat:
    """The first heartbeat of ``node`` whose settings status (and heartbeat) pass
    ``check``, as its record shows it (``timeout`` only bounds a hang)."""

    def holds(record: NodeRecord) -> bool:
        beat = record.heartbeat
        return beat is not None and beat.settings is not None and check(beat.settings, beat)

    record = await wait_record(bus, prefix, node, holds, timeout)
    assert record.heartbeat is not None
    return record.heartbeat
