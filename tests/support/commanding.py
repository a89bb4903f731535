"""Test helpers for commands: an operator key, signed commands, and the node's results."""

from __future__ import annotations

import time
from typing import Any

from nats.aio.msg import Msg

from actors.fleet.operator.commands import new_command, publish_command
from actors.node.engine import EngineActor
from actors.runtime.bus import PUBLISH_TIMEOUT, NatsBus
from schemas import codec, signing
from schemas.errors import DecodeError, SignatureError
from schemas.events import Engine
from schemas.messages import FINAL_STATUSES, Action, Alert, Command, CommandResult
from schemas.subjects import EVENT_ENGINE, Subjects
from tests.support.fleet import HANG, Fleet, wait_for


class Results:
    """Every CommandResult (signature checked) and Alert seen for one test's prefix."""

    def __init__(self) -> None:
        self.results: list[CommandResult] = []
        self.alerts: list[Alert] = []

    async def start(self, bus: NatsBus, prefix: str) -> Results:
        subjects = Subjects(prefix)
        await bus.subscribe(subjects.results(), self._on_result)
        await bus.subscribe(subjects.alerts(), self._on_alert)
        await bus.flush()
        return self

    async def _on_result(self, msg: Msg) -> None:
        try:
            signing.verify(msg.headers, msg.data)
            result = codec.decode(msg.data, CommandResult, msg.subject)
        except (SignatureError, DecodeError):
            return  # a hostile test's junk: what it checks is who else took it
        self.results.append(result)

    async def _on_alert(self, msg: Msg) -> None:
        self.alerts.append(codec.decode(msg.data, Alert, msg.subject))

    def of(self, command_id: str) -> list[CommandResult]:
        """Results naming ``command_id``, or (a refusal of an unread message) this digest."""
        return [r for r in self.results if command_id in (r.command_id, r.command_digest)]

    def statuses(self, command_id: str) -> list[str]:
        return [r.status for r in self.of(command_id)]

    async def final(self, command_id: str, timeout: float = HANG) -> CommandResult:
        """The final result naming ``command_id`` or digest, once there is one."""

        def check() -> CommandResult | None:
            done = [r for r in self.of(command_id) if r.status in FINAL_STATUSES]
            return done[-1] if done else None

        found: CommandResult = await wait_for(check, timeout)
        return found


async def send(
    bus: NatsBus,
    prefix: str,
    key: signing.KeyPair,
    action: Action,
    node: str = "n1",
    cluster: str = "c1",
    **kw: Any,
) -> Command:
    command = new_command(node, cluster, action, **kw)
    await publish_command(bus, Subjects(prefix), key, command)
    return command


async def send_raw(
    bus: NatsBus, prefix: str, body: bytes, headers: dict[str, str], node: str = "n1"
) -> None:
    """Publish exactly these bytes and headers (no Nats-Msg-Id unless given)."""
    subject = Subjects(prefix).command("c1", node)
    await bus.js.publish(subject, body, headers=headers, timeout=PUBLISH_TIMEOUT)


async def set_in_flight(fleet: Fleet, count: int, node: str = "n1") -> None:
    """Pretend to be the engine actor of ``node`` (an agent ``fleet`` started) reporting
    ``count`` in-flight requests. The node's own engine actor, with no engine to probe,
    would report none at its next round (every engine_interval) and undo the pretence in
    the middle of a drain: it is made to report ``count`` too."""

    async def pretended(session: object) -> Engine:
        return Engine(ts=time.time(), in_flight=count)

    agent = fleet.agents.get(node)
    if agent is not None and agent.supervisor is not None:
        for actor in agent.supervisor.actors:
            if isinstance(actor, EngineActor):
                setattr(actor, "check", pretended)  # noqa: B010 (an instance's method)
    await fleet.publish_event(EVENT_ENGINE, Engine(ts=time.time(), in_flight=count), node)
