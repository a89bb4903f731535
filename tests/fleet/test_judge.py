"""The judge with plain values: a node's state and a heartbeat in, a verdict out, nothing
changed on the way (no server, no clock, no table)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import msgspec
import pytest

from actors.fleet import record_state
from actors.fleet.aggregator import judge, record_rules
from actors.fleet.aggregator.hot_state import NO_GPUS, NodeState, encoded, slim_heartbeat
from actors.fleet.aggregator.judge import Forged, LateDelivery, NeedsFetch, Refused, Verdict
from actors.fleet.packing import Bodies
from schemas import codec
from schemas.events import Health, HealthCheck
from schemas.messages import Heartbeat, NodeRecord, WorkloadSummary
from tests.support.fleet import heartbeat

KEY = "UKEY"
SUBJECT = "fleet.hb.c1.n1"
T = TypeVar("T")
NOW = 1_000.0
MAX_JUMP = 1_000


def beat(seq: int, **changes: object) -> Heartbeat:
    """Node n1's heartbeat ``seq``, sent ``seq`` half-second intervals after t=900."""
    return heartbeat("n1", seq, ts=900.0 + seq * 0.5, **changes)


def state_after(seq: int, stream_seq: int = 10, stored: float = 990.0) -> NodeState:
    """n1's state once heartbeats up to ``seq`` were accepted (the last at ``stream_seq``)."""
    previous = record_rules.pending_record("n1", "c1", KEY, since=1.0)
    for n in range(1, seq + 1):
        hb = beat(n)
        previous = record_rules.accepted(
            previous,
            hb,
            KEY,
            NOW,
            stream_seq,
            stored,
            record_rules.gpu_fingerprint(hb),
            slim_heartbeat(hb, previous),
        )
    facts = record_rules.decision_facts(beat(seq)) if seq else 0
    return NodeState(previous, 1.0, facts=facts)


class Spans:
    """A partition read to its end from ``start`` to ``end`` (the owner's CaughtUp)."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end

    def within(self, after: float, before: float) -> bool:
        return self.start < before and self.end > after


def moment(
    now: float,
    skew: float = 60.0,
    monotonic: float = 100.0,
    fetched: bool = False,
    caught_up: Spans | None = None,
) -> judge.Moment:
    """The owner's moment: its clocks at ``now`` (and ``monotonic``), skew bound ``skew``."""
    return judge.Moment(
        now=now,
        monotonic=monotonic,
        max_skew=skew,
        max_jump=MAX_JUMP,
        fetched=fetched,
        caught_up=caught_up,
    )


def verdict(
    state: NodeState | None,
    hb: Heartbeat,
    stream_seq: int = 11,
    stored: float = 995.0,
    fetched: bool = False,
    monotonic: float = 100.0,
    caught_up: Spans | None = None,
) -> Verdict:
    return judge.accept(
        state,
        hb,
        KEY,
        judge.Stored(stream_seq=stream_seq, at=stored),
        moment(NOW, monotonic=monotonic, fetched=fetched, caught_up=caught_up),
    )


def test_a_steady_beat_is_accepted_with_no_alert_and_no_write() -> None:
    """The next seq of a live node: its record moves on (seq, stream seq, stored time),
    no alert, checkpointed rather than written, and the state given is left as it was."""
    state = state_after(3)
    before = copy.deepcopy(state)
    result = verdict(state, beat(4))
    assert result.alerts == [] and not result.write
    assert (result.record.last_seq, result.record.last_stream_seq) == (4, 11)
    assert result.record.last_stored == 995.0 and result.record.state == "active"
    assert state == before


def test_a_change_of_what_decisions_read_is_written_at_once() -> None:
    """A workload turning ready, a check turning unhealthy, what the node can run: each is
    written at once (the reconciler and the policy follow fleet_nodes, not a checkpoint
    later); the next beat with none of it is checkpointed, and each verdict carries the
    facts the ledger keeps."""
    state = state_after(3)
    ready = WorkloadSummary(name="w", engine="llamacpp", state="ready", since=1.0, port=1)
    unhealthy = Health(
        ts=1.0,
        status="healthy",
        score=90,
        checks=[HealthCheck(name="xid", status="unhealthy", reason="79")],
    )
    for changed in (
        beat(4, workloads=[ready]),
        beat(4, health=unhealthy),
        beat(4, capabilities=["llamacpp"]),
        beat(4, schedulability_by="UOTHER"),
    ):
        result = verdict(state, changed)
        assert result.write and result.alerts == [], changed
        assert result.facts == record_rules.decision_facts(changed) != state.facts
    steady = verdict(state, beat(4, labels={}))
    assert not steady.write and steady.facts == state.facts


def test_a_new_nodes_first_beat_is_a_transition() -> None:
    """A node with no state: an active record built from a pending one, written at once."""
    result = verdict(None, beat(1))
    assert result.write and result.alerts == []
    assert (result.record.node_id, result.record.state, result.record.last_seq) == (
        "n1",
        "active",
        1,
    )
    assert result.record.public_key == KEY


def test_a_replay_is_refused_once_read_afresh() -> None:
    """A seq at or below the last accepted one, stored later: read afresh first (an
    operator's reset-seq may be waiting), then refused as a replay; read afresh a moment
    ago, refused at once."""
    state = state_after(5)
    with pytest.raises(NeedsFetch):
        verdict(state, beat(5))
    with pytest.raises(Refused) as refused:
        verdict(state, beat(5), fetched=True)
    assert refused.value.kind == "replay" and refused.value.details == {"seq": "5"}
    state.refreshed = 99.0
    with pytest.raises(Refused):
        verdict(state, beat(4), monotonic=100.0)


def test_a_redelivery_is_late_not_refused() -> None:
    """The same beat at a stream seq already judged: a late delivery, no alert."""
    with pytest.raises(LateDelivery):
        verdict(state_after(5, stream_seq=10), beat(5), stream_seq=10, fetched=True)


def test_a_seq_jump_beyond_the_limit_is_refused_with_its_range() -> None:
    """A seq more than max_jump above the last: refused as a sequence gap."""
    with pytest.raises(Refused) as refused:
        verdict(state_after(2), beat(2 + MAX_JUMP + 1), fetched=True)
    assert refused.value.kind == "sequence_gap"
    assert refused.value.details["from"] == "2"
    assert refused.value.details["to"] == str(3 + MAX_JUMP)


def test_a_gap_is_news_only_if_the_owner_read_in_time() -> None:
    """Beats 3-4 missing: a sequence_gap alert (event q<seq>, written at once) when the
    owner had read the partition to its end just before; none when it had not (the
    stream replaced them before it read them)."""
    late = beat(5)
    assert [a.kind for a in verdict(state_after(2), late).alerts] == []
    read = verdict(state_after(2), late, caught_up=Spans(994.0, 994.9))
    (gap,) = read.alerts
    assert gap.kind == "sequence_gap" and read.write
    assert gap.details == {"from": "2", "to": "5", "event": "q5"}


def test_a_beat_replaced_within_the_delivery_margin_is_no_gap_news() -> None:
    """Beat 4 missing, beat 5 sent 5 ms after it (a goodbye right after the last beat):
    no sequence_gap even though the owner was caught up all the while (the server may
    replace a beat that soon before a waiting pull gets it); 0.3 s after it, the gap
    is the node's."""
    caught_up = Spans(900.0, 995.0)
    soon = beat(5, previous_ts=902.495)
    assert verdict(state_after(3), soon, caught_up=caught_up).alerts == []
    later = beat(5, previous_ts=902.2)
    (gap,) = verdict(state_after(3), later, caught_up=caught_up).alerts
    assert gap.kind == "sequence_gap" and gap.details["from"] == "3"


def test_a_deregistered_node_beating_is_refused_after_a_fresh_read() -> None:
    """A deregistered record takes no other heartbeat: read afresh first (it may have
    been re-admitted), then refused, its alert naming the boot."""
    state = state_after(2)
    state.record = record_state.with_state(state.record, deregistered=True)
    with pytest.raises(NeedsFetch):
        verdict(state, beat(3))
    with pytest.raises(Refused) as refused:
        verdict(state, beat(3), fetched=True)
    assert refused.value.kind == "deregistered_node_beating"
    assert refused.value.details["boot_id"] == "b1"


def test_read_refuses_a_body_of_another_node_a_skewed_clock_and_garbage() -> None:
    """The signed body must be a Heartbeat naming the subject's node and cluster, its
    timestamp within the skew bound."""
    body = codec.encode(beat(1))
    assert judge.read(body, "s", "n1", "c1", moment(950.0)).seq == 1
    cases = [
        (body, "n2", "c1", 950.0, "bad_signature"),
        (body, "n1", "c2", 950.0, "bad_signature"),
        (body, "n1", "c1", 1_100.0, "clock_skew"),
        (b"{not json", "n1", "c1", 950.0, "bad_signature"),
    ]
    for data, node, cluster, now, kind in cases:
        with pytest.raises(Refused) as refused:
            judge.read(data, "s", node, cluster, moment(now))
        assert refused.value.kind == kind


def test_an_old_heartbeat_not_above_the_last_seq_is_a_replay_not_a_clock_problem() -> None:
    """Outside the skew bound, a seq at or below the node's last accepted one is a
    replay (a captured heartbeat sent again late); a newer seq is a clock problem."""
    body = codec.encode(beat(3))
    for last_seq, kind in ((3, "replay"), (5, "replay"), (2, "clock_skew"), (-1, "clock_skew")):
        with pytest.raises(Refused) as refused:
            judge.read(body, "s", "n1", "c1", moment(1_100.0), last_seq=last_seq)
        assert refused.value.kind == kind, last_seq


def test_a_ttl_marker_makes_a_live_node_stale_and_a_forged_one_is_told() -> None:
    """A marker with no body, after stale_after has run out: the record goes stale, its
    alert says when the server marked it, written at once. One with a body, or before
    the time, is forged; one on a record already stale changes nothing."""
    record = state_after(2).record
    stale_after = beat(2).stale_after
    at = 990.0 + stale_after
    result = judge.marker(record, "MaxAge", b"", judge.Stored(stream_seq=11, at=at), moment(NOW))
    assert result is not None and result.write
    assert result.record.stale_since == NOW and result.record.state == "stale"
    (alert,) = result.alerts
    assert alert.kind == "stale"
    assert alert.details == {"event": "q2", "last_seq": "2", "marked_at": f"{at:.3f}"}
    for body, marked in ((b"x", at), (b"", 990.0)):
        with pytest.raises(Forged):
            judge.marker(
                record, "MaxAge", body, judge.Stored(stream_seq=11, at=marked), moment(NOW)
            )
    again = judge.Stored(stream_seq=12, at=at)
    assert judge.marker(result.record, "MaxAge", b"", again, moment(NOW)) is None


def test_a_stale_verdict_is_carried_onto_a_record_judged_further_only_if_it_ran_out() -> None:
    """A view gone stale at NOW whose write finds a record judged further: that record is
    stale at NOW too when its own last beat's stale_after had run out by then; not when
    the node beat later, nor onto a record stale already, nor from a view not stale."""
    stale_after = beat(2).stale_after
    mine = record_state.with_state(state_after(2).record, stale_since=NOW)
    ran_out = state_after(5, stream_seq=20, stored=NOW - stale_after).record
    carried = judge.stale_carried(mine, ran_out)
    assert carried is not None
    assert carried.stale_since == NOW and carried.state == "stale" and carried.last_seq == 5
    beat_later = state_after(5, stream_seq=20, stored=NOW - stale_after / 4).record
    assert judge.stale_carried(mine, beat_later) is None
    assert judge.stale_carried(mine, carried) is None
    assert judge.stale_carried(state_after(2).record, ran_out) is None


def test_judged_before_needs_both_the_sequence_and_the_time() -> None:
    """A heartbeat at or before the last accepted stream seq and stored no later was
    judged before; a stream made again (seqs from 1, stored later) was not."""
    record = msgspec.structs.replace(state_after(1).record, last_stream_seq=10, last_stored=990.0)
    assert judge.judged_before(record, judge.Stored(stream_seq=10, at=990.0))
    assert not judge.judged_before(record, judge.Stored(stream_seq=11, at=995.0))
    assert not judge.judged_before(record, judge.Stored(stream_seq=3, at=995.0))


def _nested_at(stack: int, call: Callable[[], T]) -> T:
    """``call()`` run ``stack`` Python frames deeper than here: a reader deep in its stack."""
    return call() if stack == 0 else _nested_at(stack - 1, call)


def test_every_heartbeat_the_judge_accepts_makes_a_readable_record() -> None:
    """A node-signed heartbeat whose unknown field nests 0 to 950 levels is accepted only
    while the heartbeat stays within codec.MAX_DEPTH, however deep in its stack the judge
    reads it; and the record it makes (its bytes spliced in one level down, as the
    ledger writes them) decodes for every reader, at any stack depth. The judge decoded
    heartbeats without the depth scan and took up to about 900 levels: records every
    other reader refused (tests/security/test_fuzz.py failed on one)."""
    bodies = Bodies()
    base = codec.encode(beat(5))
    accepted = []
    for levels in [*range(0, 40), 100, 500, 900, 950]:
        body = base[:-1] + b',"future":' + b"[" * levels + b"0" + b"]" * levels + b"}"
        outcomes = set()
        for stack in (0, 400):
            try:
                hb = _nested_at(
                    stack, partial(judge.read, body, SUBJECT, "n1", "c1", moment(NOW, 300))
                )
            except Refused as refused:
                assert "nested deeper than 32 levels" in refused.message
                outcomes.add("refused")
                continue
            outcomes.add("accepted")
            record = msgspec.structs.replace(record_rules.pending_record("n1", "c1"), heartbeat=hb)
            written = encoded(record, bodies.pack(body), NO_GPUS, bodies)
            for reader_stack in (0, 400):
                read = _nested_at(reader_stack, partial(codec.decode, written, NodeRecord, "kv"))
                assert read.heartbeat == hb
        assert len(outcomes) == 1, (levels, outcomes)
        if outcomes == {"accepted"}:
            accepted.append(levels)
    # The heartbeat object is level 1: a field may nest MAX_DEPTH - 1 levels.
    assert accepted == list(range(0, codec.MAX_DEPTH))
