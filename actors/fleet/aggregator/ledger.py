"""The owner's ledger: the in-memory table of its nodes, and verdicts taken into it.

Holds every owned node's :class:`NodeState` (:mod:`actors.fleet.aggregator.hot_state`),
the nodes seen going stale, the refused ones (:class:`RefusalTracker`), the count of
pending records, the checkpoints due, and when the stream stored what was judged with the
TTL markers held through a silence of it (:mod:`~actors.fleet.aggregator.silence`);
applies verdicts to the table (:meth:`Ledger.accept`). Judges nothing, raises no alert
and does no I/O: records are read into the table by :mod:`~actors.fleet.aggregator.reads`
and written from it by :mod:`~actors.fleet.aggregator.writes`.
"""

from __future__ import annotations

import sys
import time

from actors.fleet.aggregator.hot_state import FACTS, CheckpointQueue, NodeState, NodeTable
from actors.fleet.aggregator.judge import Verdict
from actors.fleet.aggregator.outage import Outages
from actors.fleet.aggregator.pending import PendingCounts
from actors.fleet.aggregator.refusals import RefusalTracker, mark_refused
from actors.fleet.aggregator.silence import HeldMarkers, StreamPulse
from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics
from schemas import codec
from schemas.messages import Heartbeat, NodeRecord


class Ledger:
    """One aggregator's node table and what it remembers of its nodes."""

    def __init__(self, config: AggregatorConfig, metrics: AggregatorMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.nodes = NodeTable()
        """The acceptance state of every node this aggregator owns (see hot_state)."""
        self.stale: set[str] = set()
        """Nodes this aggregator saw go stale: the offline sweep checks these often."""
        self.refusals = RefusalTracker(config.refused_note_every)
        self.checkpoints = CheckpointQueue(config.checkpoint_interval)
        self.pending = PendingCounts()
        """Pending records, in all and per key, as of the last full sweep plus those
        registered since."""
        self.pulse = StreamPulse()
        """When FLEET_HB stored the heartbeats judged here (see the silence module)."""
        self.held = HeldMarkers(config.bus_outage_max)
        """TTL markers that came after a silence of the whole stream, not yet believed."""
        self.outages = Outages(config.bus_outage_max)
        """Silences of the stream the nodes beat again after: one alert each."""
        self._accepted = 0
        self._to_pack: list[tuple[NodeState, bytes]] = []
        """The bodies of the heartbeats accepted while judging, packed once it is done
        (:meth:`settle`), before any write can read them."""

    def accept(
        self,
        state: NodeState | None,
        verdict: Verdict,
        heartbeat: Heartbeat,
        body: bytes,
        key: str,
        verifier: bytes,
    ) -> None:
        """Take an accepted ``heartbeat`` (its bytes: ``body``, signed by ``key``) into
        the node's state (made, with the key's ``verifier``, for a node with none);
        queue its checkpoint unless ``verdict`` writes the record at once."""
        node = sys.intern(heartbeat.node_id)  # kept by the checkpoint queue: one per node
        if state is None:
            state = self.nodes[node] = NodeState(verdict.record, time.monotonic())
            state.key, state.verifier = key, verifier
        else:
            if state.record.seq_reset:
                state.reset_consumed = True
            state.keep(verdict.record)
        if verdict.facts is not None and verdict.facts != state.facts:
            state.facts = FACTS.one(verdict.facts)
        self.refusals.on_accepted(node)
        self.held.release(node)
        self._to_pack.append((state, body or codec.encode(heartbeat)))
        state.fresh = False
        state.dirty = True
        self._accepted += 1
        self.nodes.changed(node)
        if not verdict.write:
            self.checkpoints.push(node, state)

    def mark_stale(self, node: str, state: NodeState, record: NodeRecord) -> None:
        """The node's ``record`` gone stale (its write follows)."""
        state.keep(record)
        state.dirty = True
        self.stale.add(node)

    def refused(self, node: str, kind: str, boot_id: str) -> tuple[bool, bool]:
        """A heartbeat of ``node`` refused as ``kind``: (whether to raise its alert:
        ``deregistered_node_beating`` once per boot, the rest always; whether the kind
        was noted in the node's record, to write for the node to read: at most once per
        ``refused_note_every`` per kind). The node is remembered for the refused sweep."""
        if node not in self.stale:
            self.refusals.on_refused(node)
        alert = kind != "deregistered_node_beating" or self.refusals.first_of_boot(node, boot_id)
        state = self.nodes.get(node)
        if state is None or not self.refusals.should_note(node, kind, time.monotonic()):
            return alert, False
        every = self.config.refused_note_every
        noted = mark_refused(state.record, kind, time.time(), every)
        if noted is None:
            return alert, False
        # A state change the node reads: written now, not at a checkpoint.
        state.keep(noted)
        state.dirty = True
        return alert, True

    def settle(self) -> None:
        """Pack the bodies of the heartbeats accepted since the last call and count them:
        once per batch, not per heartbeat. Packed in one loop, zstd's code and tables stay
        in the core's caches (about 2 % of a heartbeat's CPU); a metric update takes a
        lock."""
        pack = self.nodes.bodies.pack
        for state, body in self._to_pack:
            state.body = pack(body)
        self._to_pack.clear()
        if self._accepted:
            self.metrics.accepted.inc(self._accepted)
            self._accepted = 0

    def drop(self, nodes: list[str]) -> None:
        """Let ``nodes`` go (their partitions are no longer this owner's)."""
        for node in nodes:
            self.nodes.pop(node, None)
            self.stale.discard(node)
            self.refusals.forget(node)

    def superseded(self, node: str) -> None:
        """Another owner judged later heartbeats of ``node`` than this one holds: its view
        here is dropped (the node's next heartbeat, if it is still this owner's, reads the
        record afresh)."""
        self.nodes.pop(node, None)
        self.stale.discard(node)
        self.held.release(node)
