"""Keys and signatures ahead of judging: whose key a heartbeat must be signed by, and
whether it is.

A heartbeat is judged only if it is signed, over the bytes received, by its node's
approved key: the trust watch's (:class:`NodeStore`), or one read afresh for the slow
path. The verifier built from a node's key is kept in its :class:`NodeState` (the
verifier cache: ``key``, ``verifier``), and a fetch's signatures are checked in one loop
before any of its heartbeats is judged (:meth:`Signatures.ahead`). Owns those checks and
the keys read afresh; reads the node table, never writes a record, does no other I/O
than reading a key.
"""

from __future__ import annotations

from nats.aio.msg import Msg

from actors.fleet.aggregator import nats_ttl
from actors.fleet.aggregator.hot_state import NodeState, NodeTable
from actors.fleet.aggregator.judge import NeedsFetch, Refused, Stored, judged_before
from actors.fleet.storage.node_store import NodeStore
from actors.runtime.batch_pull import Delivery, delivery
from schemas import signing
from schemas.base import MAX_STALE_AFTER
from schemas.errors import SignatureError

TRUST_WAIT = 2.0
"""Seconds a batch of heartbeats waits at most for the trust watch to catch up."""
ROLLUP = "Nats-Rollup"
"""No agent sends it, and FLEET_HB_IN refuses it; one that reaches FLEET_HB anyway (a
stream of an older version, where the server forces rollups on for its delete markers)
is refused and alerted on."""
TTL = "Nats-TTL"


class Signatures:
    """The signature checks of one aggregator's heartbeats, against ``store``'s keys and
    the verifiers kept in ``nodes``."""

    def __init__(self, store: NodeStore, nodes: NodeTable) -> None:
        self.store = store
        self.nodes = nodes
        self.verified: dict[int, tuple[bytes, Delivery]] = {}
        """While a fetch is judged: the messages whose signature held, by ``id``, with the
        raw key it held under and the message's :func:`delivery`, read once (see
        :meth:`ahead`)."""
        self.fresh: dict[str, str | None] = {}
        """Trusted keys read afresh for the slow path, while it judges again."""
        self.revoked: set[str] = set()
        """Nodes of ``fresh`` whose trust entry is there, revoked."""

    async def keys_current(self) -> None:
        """While the trust watch is behind (a bulk enrollment), wait for it, up to
        TRUST_WAIT (see :meth:`NodeStore.trust_caught_up`)."""
        await self.store.trust_caught_up(TRUST_WAIT)

    def known_signer(self, node: str, headers: dict[str, str]) -> bool:
        """Whether the key ``headers`` name is the one the trust watch approved for
        ``node``."""
        return self.store.cached_key(node) == headers.get(signing.HEADER_KEY)

    def ahead(self, messages: list[Msg]) -> None:
        """Check the signatures of a fetch's heartbeats from known nodes, under the key
        their state keeps, all in one loop before any is judged (into :attr:`verified`).
        The same checks interleaved with the Python of judging cost about 4 % more CPU a
        heartbeat (libsodium and the interpreter evict each other's code from the core's
        caches). :meth:`check` takes a result only for the same message and the same key
        (the check is a function of the two); it checks anything else itself, as it does
        every signature that failed here, to say why. A heartbeat judged before is
        skipped here as there (a cold start reads many again). The delivery read from
        the ack subject here is kept for the judge: reading it again cost about 0.5 % of
        a heartbeat's CPU side by side."""
        verified: dict[int, tuple[bytes, Delivery]] = {}
        for msg in messages:
            node = msg.subject.rpartition(".")[2]
            state = self.nodes.get(node)
            headers = msg.headers
            if state is None or state.verifier is None or headers is None:
                continue
            if not state.key == headers.get(signing.HEADER_KEY) == self.store.cached_key(node):
                continue
            try:
                read = delivery(msg)
                if judged_before(state.record, Stored(stream_seq=read[0], at=read[1])):
                    continue
                signing.verify_with(state.verifier, state.key, headers, msg.data)
            except Exception:
                # Outside the judge's guard, which terminates a message that breaks it: a
                # fault here must not fail the batch. The judge checks it again, there.
                continue
            verified[id(msg)] = (state.verifier, read)
        self.verified = verified

    async def fetch(self, node: str) -> None:
        """Read the node's trusted key afresh for the slow path (an approval or a new key
        a moment ago, before the trust watch delivered it); kept until :meth:`forget`."""
        self.fresh[node], revoked = await self.store.fresh_standing(node)
        if revoked:
            self.revoked.add(node)

    def forget(self, node: str) -> None:
        self.fresh.pop(node, None)
        self.revoked.discard(node)

    def _without_key(self, node: str, state: NodeState | None) -> Refused:
        """The refusal of a heartbeat from a node with no approved key: ``forgotten`` (an
        operator's ``fleetctl forget``), ``revoked`` (its key was) or ``unknown_node``."""
        record = state.record if state is not None else None
        if record is not None and record.deregistered and record.deregistered_by != "node":
            by = record.deregistered_by[:12] or "an operator"
            reason = record.deregistered_reason or "no reason given"
            return Refused("forgotten", f"node {node} was forgotten by {by}: {reason}", by=by)
        if node in self.revoked:
            return Refused("revoked", f"node {node}'s approved key was revoked")
        return Refused("unknown_node", f"node {node} has no approved key")

    def check(
        self,
        msg: Msg,
        headers: dict[str, str],
        node: str,
        state: NodeState | None,
        fetched: bool,
    ) -> tuple[str, bytes]:
        """The node's trusted key and its verifier, once ``msg`` is found signed by it
        (over the bytes received); Refused if not, NeedsFetch if refusing needs the key
        read afresh first (``fetched``: it was). A node in memory keeps the verifier of
        its key in ``state``; a node's first heartbeat keeps it when accepted."""
        if ROLLUP in headers:
            raise Refused(
                "bad_signature",
                "heartbeat carries a Nats-Rollup header (it purged earlier heartbeats)",
                rollup=headers[ROLLUP][:16],
            )
        if not nats_ttl.ttl_within(headers.get(TTL), MAX_STALE_AFTER):
            raise Refused(
                "bad_signature",
                f"heartbeat's Nats-TTL is longer than {MAX_STALE_AFTER:g}s or never",
                ttl=headers[TTL][:16],
            )
        signer = headers.get(signing.HEADER_KEY)
        trusted = self.fresh.get(node) if fetched else self.store.cached_key(node)
        if (trusted is None or trusted != signer) and not fetched:
            # Refusing costs a fresh read: the node may have been approved (or given a
            # new key) a moment ago, before the trust watch delivered it.
            raise NeedsFetch
        if trusted is None:
            raise self._without_key(node, state)
        try:
            if signer != trusted:
                signing.verify(headers, msg.data)
                raise Refused(
                    "unknown_node",
                    "signed by a key that is not the node's approved key",
                    key=signer or "",
                )
            if state is None or state.verifier is None or state.key != trusted:
                verifier = signing.verify_key(trusted)
                if state is not None:
                    state.key, state.verifier = trusted, verifier
            else:
                verifier = state.verifier
            ahead = self.verified.get(id(msg))
            if ahead is None or ahead[0] != verifier:
                signing.verify_with(verifier, trusted, headers, msg.data)
        except SignatureError as exc:
            raise Refused("bad_signature", exc.reason, key=exc.public_key) from None
        return trusted, verifier
