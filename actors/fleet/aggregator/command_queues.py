"""Every admitted node's command consumer on FLEET_CMD, created by the provider.

A node that could create its own consumer could create it with any configuration the
server takes under its name and filter: a push consumer delivering its commands into a
FLEET subject with listeners (``fleet.register``: one command became hundreds of
registrations a second). So under the shipped permissions nodes may only look their
consumer up, pull from it and acknowledge; the aggregator creates it, with the one
configuration :func:`actors.runtime.consumer.pull_config` pins (pull only, bounded
redeliveries, ack wait and pulls), for every node it owns whose record is admitted, and
puts back any that is missing or configured otherwise (deleted, or left from before).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Iterable

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig

from actors.runtime.bus import Bus
from actors.runtime.consumer import pull_config
from actors.runtime.schedule import stop_if_cancelled
from schemas.subjects import (
    COMMAND_ACK_WAIT,
    COMMAND_MAX_DELIVER,
    STREAM_COMMANDS,
    Subjects,
    command_consumer,
)

log = logging.getLogger(__name__)

NOT_ADMITTED = ("pending", "deregistered")
"""Record states whose node gets no command consumer (created when it is admitted)."""
Admitted = Callable[[], Iterable[tuple[str, str]]]
"""(cluster, node) of every node whose command consumer should exist now."""
PINNED = (
    "deliver_subject",
    "filter_subject",
    "ack_policy",
    "deliver_policy",
    "ack_wait",
    "max_deliver",
    "max_waiting",
    "max_ack_pending",
)
"""The fields a consumer in place must share with :func:`wanted` to be left alone."""
INFO_PAGE = 256
"""Consumers (with their configurations) the server lists per request."""
API_TIMEOUT = 5.0


def wanted(subjects: Subjects, cluster: str, node: str) -> ConsumerConfig:
    """The configuration of ``node``'s command consumer."""
    return pull_config(
        command_consumer(cluster, node),
        subjects.command(cluster, node),
        ack_wait=COMMAND_ACK_WAIT,
        max_deliver=COMMAND_MAX_DELIVER,
    )


def _differs(current: ConsumerConfig, config: ConsumerConfig) -> bool:
    return any(getattr(current, name) != getattr(config, name) for name in PINNED)


async def ensure(
    bus: Bus, subjects: Subjects, nodes: Iterable[tuple[str, str]], *, check_configs: bool
) -> int:
    """Create the command consumer of each (cluster, node) that has none; with
    ``check_configs`` also one configured otherwise (deleted first). How many were
    created. Without ``check_configs`` only the consumers' names are listed (a few bytes
    each, where a configuration is about a kilobyte): nodes cannot configure one."""
    stream = subjects.stream_name(STREAM_COMMANDS)
    current = await (_configs(bus.js, stream) if check_configs else _names(bus, stream))
    created = 0
    for cluster, node in nodes:
        config = wanted(subjects, cluster, node)
        name = command_consumer(cluster, node)
        found = current.get(name)
        if name in current and (found is None or not _differs(found, config)):
            continue
        if found is not None:
            log.warning(
                "command consumer configured otherwise; creating it again",
                extra={"consumer": name, "deliver_subject": found.deliver_subject or ""},
            )
            await bus.js.delete_consumer(stream, name)
        await bus.js.add_consumer(stream, config=config)
        created += 1
    return created


async def _configs(js: JetStreamContext, stream: str) -> dict[str, ConsumerConfig | None]:
    """Every consumer of ``stream`` with its configuration."""
    found: dict[str, ConsumerConfig | None] = {}
    while page := await js.consumers_info(stream, offset=len(found) or None):
        found.update((info.name, info.config) for info in page)
        if len(page) < INFO_PAGE:
            break
    return found


async def _names(bus: Bus, stream: str) -> dict[str, ConsumerConfig | None]:
    """Every consumer of ``stream`` by name (configurations not read: None)."""
    found: dict[str, ConsumerConfig | None] = {}
    subject = f"{bus.js_api_prefix}.CONSUMER.NAMES.{stream}"
    while True:
        asked = json.dumps({"offset": len(found)}).encode()
        answer = json.loads((await bus.request(subject, asked, timeout=API_TIMEOUT)).data)
        if "error" in answer:
            raise nats.js.errors.APIError.from_error(answer["error"])
        names = answer.get("consumers") or []
        found.update((name, None) for name in names)
        if not names or len(found) >= answer.get("total", 0):
            return found


async def keep_forever(
    bus: Bus, subjects: Subjects, admitted: Admitted, every: float, full_every: float
) -> None:
    """Until cancelled: every ``every`` seconds, :func:`ensure` for the nodes admitted
    since the last round; every ``full_every`` seconds, for all of them (a consumer
    deleted since is put back), the first time with their configurations checked. A
    failed round is logged and tried again at the next."""
    ensured: set[tuple[str, str]] = set()
    last_full = -math.inf
    while True:
        stop_if_cancelled()
        now = time.monotonic()
        nodes = set(admitted())
        full = now - last_full >= full_every
        todo = nodes if full else nodes - ensured
        if todo:
            try:
                created = await ensure(
                    bus, subjects, sorted(todo), check_configs=last_full == -math.inf
                )
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("command consumers not checked", extra={"reason": str(exc)})
            else:
                if created:
                    log.info("command consumers created", extra={"consumers": created})
                ensured = (ensured | todo) & nodes
                if full:
                    last_full = now
        await asyncio.sleep(every)
