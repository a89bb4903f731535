"""Judging one heartbeat, pure: the node's state and a delivered heartbeat in, a verdict
out.

Inputs: the node's :class:`NodeState` (None: none in memory), the heartbeat and the key
that signed it, where FLEET_HB stored it (:class:`Stored`) and what the owner knows as
it judges (:class:`Moment`: its clocks, its limits, whether the node's key and record
were just read afresh, when it had read the partition to its end). No I/O, no clock, no
table, and nothing here changes the state it is given.

Outcomes, every one of them (the heartbeat path in :mod:`actors.fleet.aggregator.actor`
acts on each):

- :class:`Verdict` (:func:`accept`): accepted. ``record`` is the node's record after it
  (:mod:`~actors.fleet.aggregator.record_rules`, its state by
  :mod:`actors.fleet.record_state`; the heartbeat kept slim, as
  :mod:`~actors.fleet.aggregator.hot_state` keeps it), ``alerts`` the alerts it raises
  (:mod:`~actors.fleet.aggregator.alert_rules`), ``write`` whether the record is
  written at once rather than at the node's next checkpoint. The ledger takes it in;
  the path publishes the alerts, then writes.
- :class:`Refused` (:func:`read`, :func:`accept`): the heartbeat changes nothing; it
  carries the alert to raise (kind, message, details). The path deletes it from FLEET_HB,
  raises the alert and notes the refusal in the record (:meth:`Ledger.refused`).
- :class:`LateDelivery`: an older heartbeat delivered after a newer one, or one judged
  before (:func:`judged_before`, checked ahead of the signature): dropped and counted.
- :class:`NeedsFetch`: the judgement needs the node's key and record read afresh (an
  approval, a new key, an operator's ``reset-seq``, a re-admission); the path reads
  them and judges again with ``Moment.fetched``.
- :func:`marker`: a TTL marker's :class:`Verdict` (the record gone stale), None when it
  changes nothing, or :class:`Forged` when it cannot be the server's.
- :func:`stale_carried`: a stale verdict whose write found the record judged further
  (this owner's view was older than the store), carried onto the stored record.

Signatures are checked before this (:mod:`actors.fleet.aggregator.verify`). Tested with
plain values (tests/fleet/test_judge.py).
"""

from __future__ import annotations

import sys
from typing import NamedTuple, Protocol

import msgspec

from actors.fleet import record_state
from actors.fleet.aggregator import alert_rules, record_rules
from actors.fleet.aggregator.hot_state import (
    ALIKE,
    NodeState,
    packed_gpus,
    slim_heartbeat,
    together,
)
from actors.fleet.aggregator.record_rules import AlertSpec
from schemas import codec
from schemas.errors import DecodeError
from schemas.messages import AlertKind, Heartbeat, NodeRecord

REFRESH_INTERVAL = 5.0
"""A refused node's record is read afresh at most this often (a reset-seq shows then)."""


MARKER_TOLERANCE = 1.0
"""Seconds a TTL marker may come before its heartbeat's ``stale_after`` ran out (clocks
of the servers of a cluster differ a little)."""


class NeedsFetch(Exception):
    """The judgement needs the node's key or record read afresh (the slow path)."""


class Refused(Exception):
    """A heartbeat that must not change state; carries the alert to raise."""

    def __init__(self, kind: AlertKind, message: str, **details: str) -> None:
        self.kind: AlertKind = kind
        self.message = message
        self.details = details
        super().__init__(message)


class LateDelivery(Exception):
    """An older heartbeat delivered after a newer one (another aggregator was faster)."""


class Forged(Exception):
    """A TTL marker that cannot be the server's (see :func:`marker_is_real`)."""


class Spans(Protocol):
    """When the owner had read a partition to its end (:class:`CaughtUp`)."""

    def within(self, after: float, before: float) -> bool: ...


class Stored(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Where and when FLEET_HB stored a message: its stream sequence and the time, in epoch
    seconds, the stream stored it (the server's clock)."""

    stream_seq: int
    at: float


class Moment(msgspec.Struct, frozen=True, kw_only=True):
    """What the owner knows as it judges one message: its clocks (``now``, epoch seconds;
    ``monotonic``), its limits (``max_skew`` seconds off its clock, ``max_jump`` seqs
    above the last accepted), whether the node's key and record were just read afresh
    (``fetched``) and when it had read the message's partition to its end
    (``caught_up``; None: never)."""

    now: float
    monotonic: float
    max_skew: float
    max_jump: int
    fetched: bool = False
    caught_up: Spans | None = None


class Verdict(NamedTuple):
    """What a heartbeat (or a TTL marker) does to its node: ``record`` is the node's
    record after it, ``alerts`` the alerts it raises (``event`` in each one's details),
    ``write`` whether the record is written at once (a transition, a change of the
    decision facts, or alerts raised first) rather than at the node's next checkpoint,
    ``facts`` the heartbeat's :func:`record_rules.decision_facts` (None: a marker's,
    which leaves them)."""

    record: NodeRecord
    alerts: list[AlertSpec]
    write: bool
    facts: int | None = None


def read(
    body: bytes, subject: str, node: str, cluster: str, moment: Moment, *, last_seq: int = -1
) -> Heartbeat:
    """The heartbeat in ``body`` (its signature already checked), if it names the node
    and cluster of its ``subject`` and its timestamp is within ``moment.max_skew`` seconds
    of ``moment.now``; else Refused. One too old whose seq is not above ``last_seq`` (the
    node's last accepted) is a ``replay``, not a clock problem."""
    try:
        heartbeat = codec.decode(body, Heartbeat, subject)
    except DecodeError as exc:
        raise Refused("bad_signature", f"signed body is not a Heartbeat: {exc.reason}") from None
    if heartbeat.node_id != node or heartbeat.cluster != cluster:
        raise Refused(
            "bad_signature",
            "body names another node or cluster than its subject",
            body_node=heartbeat.node_id,
            body_cluster=heartbeat.cluster,
        )
    off = heartbeat.ts - moment.now
    if abs(off) > moment.max_skew:
        if heartbeat.seq <= last_seq:
            raise Refused(
                "replay",
                f"seq {heartbeat.seq} is not above the last accepted {last_seq} "
                f"(and {off:+.0f}s off the aggregator's clock)",
                seq=str(heartbeat.seq),
            )
        raise Refused(
            "clock_skew",
            f"timestamp is {off:+.0f}s off the aggregator's clock",
            seq=str(heartbeat.seq),
        )
    return heartbeat


STEADY: list[AlertSpec] = []
"""A steady beat's alerts: none (one list for all, never added to)."""


def accept(
    state: NodeState | None,
    heartbeat: Heartbeat,
    public_key: str,
    stored: Stored,
    moment: Moment,
) -> Verdict:
    """The verdict on a verified ``heartbeat`` signed by ``public_key``, as FLEET_HB
    ``stored`` it, for a node in ``state`` (None: none in memory); or Refused,
    LateDelivery, NeedsFetch."""
    fingerprint = record_rules.gpu_fingerprint(heartbeat)
    facts = record_rules.decision_facts(heartbeat)
    if (
        state is not None
        and facts == state.facts
        and record_rules.is_steady(
            state.record,
            heartbeat,
            public_key,
            None if fingerprint is None else packed_gpus(fingerprint),
            state.gpus,
        )
    ):
        # Most heartbeats: no alert, no transition, only the next checkpoint to make.
        record = record_rules.steady_beat(
            state.record,
            heartbeat,
            moment.now,
            stored.stream_seq,
            stored.at,
            slim_heartbeat(heartbeat, state.record),
        )
        return Verdict(record, STEADY, False, facts)
    previous = (
        # Whole, as the rules compare GPUs: the state keeps the fingerprint apart.
        together(state.record, state.gpus)
        if state is not None
        # One string per node (its name, interned as the table's key is) or per fleet
        # (its cluster).
        else record_rules.pending_record(
            sys.intern(heartbeat.node_id), ALIKE.one(heartbeat.cluster), public_key
        )
    )
    verdict = record_rules.judge_seq(previous, heartbeat.seq, moment.max_jump, public_key)
    if verdict != "next":
        if stored.stream_seq <= previous.last_stream_seq:
            # Delivered again (a redelivery after a failover) or late: already seen.
            raise LateDelivery
        refreshed = state.refreshed if state is not None else 0.0
        if not moment.fetched and moment.monotonic - refreshed > REFRESH_INTERVAL:
            raise NeedsFetch  # an operator's reset-seq may be waiting in fleet_nodes
    elif not moment.fetched and record_rules.new_key_epoch(previous, public_key):
        # A re-imaged node's first beat under its new key: the operator's reset-seq
        # that may come with it is in fleet_nodes only, and this beat uses it up.
        raise NeedsFetch
    if verdict == "replay":
        raise Refused(
            "replay",
            f"seq {heartbeat.seq} is not above the last accepted {previous.last_seq}",
            seq=str(heartbeat.seq),
        )
    if verdict == "jump":
        raise Refused(
            "sequence_gap",
            f"seq {heartbeat.seq} jumps more than {moment.max_jump} above "
            f"the last accepted {previous.last_seq}; refused (fleetctl reset-seq "
            "lets the node in)",
            refused="true",
            **{"from": str(previous.last_seq), "to": str(heartbeat.seq)},
        )
    # After the seq checks, so a late delivery stays one.
    left = alert_rules.deregistered_refusal(previous, heartbeat)
    if left is not None:
        if not moment.fetched:
            # Always read afresh (no REFRESH_INTERVAL): an operator may have re-admitted
            # the node a moment ago, and a deregistered node beats only a few times
            # (its agent exits on learning it).
            raise NeedsFetch
        raise Refused(left.kind, left.message, **left.details)
    # The record kept in memory is slim; the heartbeat's bytes are kept beside it.
    after = record_rules.accepted(
        previous,
        heartbeat,
        public_key,
        moment.now,
        stored.stream_seq,
        stored.at,
        fingerprint,
        slim_heartbeat(heartbeat, previous),
    )
    transition = (
        state is None or facts != state.facts or record_rules.is_transition(previous, after)
    )
    # The first heartbeat after a load may follow heartbeats accepted but not yet
    # checkpointed by the previous owner: no gap to report.
    gaps = not (state is not None and state.fresh) and (
        heartbeat.seq <= previous.last_seq + 1
        or read_in_time(moment.caught_up, stored.at, heartbeat)
    )
    alerts = alert_rules.heartbeat_alerts(previous, after, heartbeat, gaps_are_news=gaps)
    hardware = alert_rules.hardware_alert(previous, heartbeat, fingerprint)
    if hardware:
        alerts.append(hardware)
    for alert in alerts:
        # Lifecycle alerts name their own event, so every aggregator derives one id.
        alert.details.setdefault("event", f"q{heartbeat.seq}")
    # Alerts before the write: a crash between the two raises the alert again (same id,
    # dropped by JetStream), never loses it.
    return Verdict(after, alerts, transition or bool(alerts), facts)


def read_in_time(caught_up: Spans | None, stored: float, heartbeat: Heartbeat) -> bool:
    """Whether a gap before ``heartbeat``, stored at ``stored``, is the node's: this
    owner had read the partition to its end within the later half of the :func:`spacing`
    between the beat before it and this one. That beat, stored about ``spacing`` earlier,
    was then read had it been stored; FLEET_HB keeps one heartbeat per node, so behind
    the stream a beat not yet read is replaced by the next, and the gap is this owner's
    doing (a beat sent at once on a change, a moment after the last, was replaced while
    this owner waited for its next fetch). Server and aggregator clocks must agree to well
    within half the spacing, as NTP keeps them. Nor before :data:`DELIVERY_MARGIN` after
    the beat before was stored: a beat the next replaces sooner may never reach even a
    waiting pull (a goodbye a moment after the last beat, two beats in one read of the
    node's connection), and then no moment proves the gap the node's."""
    gap = spacing(heartbeat)
    after = stored - gap + max(gap / 2, DELIVERY_MARGIN)
    return caught_up is not None and after < stored and caught_up.within(after, stored)


DELIVERY_MARGIN = 0.1
"""Seconds the server may take from storing a beat to handing it to a waiting pull,
under load: a beat replaced sooner than this was not provably there to be read."""


def spacing(heartbeat: Heartbeat) -> float:
    """Seconds between the node's previous beat and ``heartbeat``, by the node's clock:
    ``previous_ts`` when the node says it (a beat sent at once on a change may follow the
    last by far less than an interval), else its interval."""
    if heartbeat.previous_ts is None or heartbeat.previous_ts > heartbeat.ts:
        return heartbeat.interval
    return heartbeat.ts - heartbeat.previous_ts


def marker(
    record: NodeRecord | None, reason: str, body: bytes, stored: Stored, moment: Moment
) -> Verdict | None:
    """What a message with a TTL marker reason does, as FLEET_HB ``stored`` it: Forged if
    it cannot be the server's marker for the node's ``record``; None if it changes nothing
    (no live record, or one already stale or deregistered, or one whose node said goodbye:
    the TTL of its last heartbeat ran out, as it does after a requested stop); else the
    record gone stale at ``moment.now``, with its ``stale`` alert, written at once."""
    marked_at, now = stored.at, moment.now
    if not marker_is_real(record, marked_at, body):
        raise Forged
    if record is None or record.stale_since is not None or record.deregistered:
        return None
    if record.stopped_since is not None:
        return None
    stale = record_state.with_state(record, stale_since=now)
    stale_after = stale.heartbeat.stale_after if stale.heartbeat else 0.0
    alert = AlertSpec(
        "stale",
        f"no heartbeat for {stale_after:g}s (server marker: {reason})",
        # When the server stored its marker: how long after the TTL ran out the server
        # marked the node, and how long the alert took after that.
        {
            "event": f"q{stale.last_seq}",
            "last_seq": str(stale.last_seq),
            "marked_at": f"{marked_at:.3f}",
        },
    )
    return Verdict(stale, [alert], True)


def stale_carried(mine: NodeRecord, stored: NodeRecord) -> NodeRecord | None:
    """``stored`` gone stale when ``mine`` did, for an owner's view ``mine`` made stale
    (its alert raised) whose write found ``stored`` judged further: the view was older
    than the store (a write of an earlier tenure landed after this owner read the record,
    or the read was answered by a replica behind the stream's leader). The silence is the
    node's whichever view saw it, so ``stored`` is stale at ``mine.stale_since`` too if
    its own last heartbeat's ``stale_after`` had run out by then; else (the node beat
    later, or ``stored`` is not live: stale already, deregistered, stopped) None."""
    since = mine.stale_since
    if since is None or mine.offline_since is not None or stored.heartbeat is None:
        return None
    if stored.stale_since is not None or stored.deregistered or stored.stopped_since:
        return None
    last = record_state.last_stored_at(stored)
    if since - last < stored.heartbeat.stale_after - MARKER_TOLERANCE:
        return None
    return record_state.with_state(stored, stale_since=since)


def judged_before(record: NodeRecord, stored: Stored) -> bool:
    """Whether the heartbeat FLEET_HB ``stored`` was stored no later than the last one
    accepted into ``record``: a redelivery, or a new owner
    reading again from its partition's oldest checkpoint. It can change nothing, so it
    is dropped before its signature is checked (a cold start reads up to a checkpoint
    interval of heartbeats again). Both are compared, the sequence and the time: a
    FLEET_HB deleted and made again numbers from 1 again, and its heartbeats, stored
    later, are judged as ever instead of locking every node out."""
    last = record.last_stored
    return last is not None and stored.stream_seq <= record.last_stream_seq and stored.at <= last


def marker_is_real(record: NodeRecord | None, marked_at: float, body: bytes) -> bool:
    """Whether a message with ``Nats-Marker-Reason`` can be the server's TTL marker for
    ``record``'s node: real markers have no body and come only once the last accepted
    heartbeat's ``stale_after`` has run out since the stream stored it. Any client may
    publish such a header, so one on a live node is a forgery."""
    if body or record is None or record.heartbeat is None:
        return False
    stored = record_state.last_stored_at(record)
    return marked_at - stored >= record.heartbeat.stale_after - MARKER_TOLERANCE
