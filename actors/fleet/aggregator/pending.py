"""Pending registrations: every key that registered a node name, and what one key may hold.

A registration costs nothing to make (any key signs its own), so the first one for a name
must not decide which key an operator approves, nor may one key take the room others
need. A pending record keeps each key that registered its name (the first in
``public_key``, the others in ``candidates``, at most ``MAX_CANDIDATES``); ``fleetctl
approve NODE`` lists them all and approves without a named key only when there is one.
Each key's pending names are counted (as of the last full sweep, plus what this
aggregator registered since, like the global count) and capped at
``max_pending_per_key``, so one key cannot fill ``max_pending``.

Keys cost nothing to make, so where the server names the NATS login a registration came
from, the login is limited the same way: the shipped configurations import
``fleet.register`` into the nodes' account with ``share: true``, and the server then sets
``Nats-Request-Info`` on every such request, replacing any header of that name the client
sent. A stolen node key is one login, however many signing keys it makes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import msgspec

from actors.fleet.aggregator import record_rules
from schemas.base import MAX_NAME
from schemas.messages import MAX_CANDIDATES, Candidate, NodeIdentity, NodeRecord

REQUEST_INFO = "Nats-Request-Info"
LOGIN = "login:"
"""What a login is counted under, apart from the public keys (``U...``)."""


class _RequestInfo(msgspec.Struct):
    """What this module reads of the server's ``Nats-Request-Info``."""

    acc: str = ""
    user: str = ""


def login_of(headers: Mapping[str, str] | None) -> str:
    """``ACCOUNT/USER`` of the login a request came from, as the server's
    ``Nats-Request-Info`` names it; "" without one (a server that does not share it)."""
    raw = (headers or {}).get(REQUEST_INFO, "")
    if not raw:
        return ""
    try:
        info = msgspec.json.decode(raw, type=_RequestInfo)
    except msgspec.DecodeError:  # ValidationError included; the server's JSON is never bad
        return ""
    if not info.user:
        return ""
    return f"{info.acc}/{info.user}"[:MAX_NAME]


def new_record(
    node: str,
    cluster: str,
    public_key: str,
    login: str,
    now: float,
    approved: bool = False,
    identity: NodeIdentity | None = None,
) -> NodeRecord:
    """The pending record a first registration makes, with the ``identity`` it carried
    (:func:`actors.fleet.identity.recordable`);
    one whose key is ``approved`` (an enrollment token, an earlier approve) awaits only
    its first heartbeat, not approval."""
    record = record_rules.pending_record(node, cluster, public_key, since=now, approved=approved)
    return msgspec.structs.replace(record, registered_by=login, registered_identity=identity)


def identity_of_key(record: NodeRecord, public_key: str) -> NodeIdentity | None:
    """The identity the registration of ``public_key`` carried, while ``record`` is
    pending and it is the key of its first registration; None otherwise (a candidate's is
    not kept: nine identities a name would let registrations, which cost nothing, fill
    ``fleet_nodes``)."""
    if record.state != "pending" or record.public_key != public_key:
        return None
    return record.registered_identity


def keys(record: NodeRecord) -> list[str]:
    """The keys that registered ``record``'s name, first one first (none but its key when
    the record is not pending)."""
    found = [record.public_key] if record.public_key else []
    if record.state == "pending":
        found += [c.public_key for c in record.candidates if c.public_key not in found]
    return found


def _open_to(record: NodeRecord, public_key: str) -> bool:
    """Whether ``public_key`` is new to ``record``, a name no heartbeat was accepted for."""
    return record.state == "pending" and record.last_seq == 0 and public_key not in keys(record)


def with_candidate(
    record: NodeRecord, public_key: str, cluster: str, now: float, login: str = ""
) -> NodeRecord | None:
    """``record`` with ``public_key`` added as a candidate; None when it is one already,
    the record is not an unapproved pending one, or it holds MAX_CANDIDATES."""
    if not _open_to(record, public_key) or len(record.candidates) >= MAX_CANDIDATES:
        return None
    added = Candidate(public_key=public_key, cluster=cluster, since=now, registered_by=login)
    return msgspec.structs.replace(record, candidates=[*record.candidates, added])


def why_unrecorded(
    before: NodeRecord | None, public_key: str, new_name_refusal: str, candidate_refusal: str
) -> str:
    """Why a registration of ``public_key`` that wrote nothing is refused: the record's
    name was new (``new_name_refusal``) or open to another key (``candidate_refusal``,
    or the name's candidates are full); "" when nothing was to be written (a key the name
    has, a node no longer pending)."""
    if before is None:
        return new_name_refusal
    if not _open_to(before, public_key):
        return ""
    if len(before.candidates) >= MAX_CANDIDATES:
        return (
            f"{len(keys(before))} keys registered this name already; an operator approves "
            "yours by key (fleetctl approve NODE KEY)"
        )
    return candidate_refusal


def holders(record: NodeRecord) -> list[str]:
    """What a pending record counts against: each of its keys, and each login that
    registered it (once each)."""
    logins = [record.registered_by, *(c.registered_by for c in record.candidates)]
    return [*keys(record), *dict.fromkeys(LOGIN + login for login in logins if login)]


class PendingCounts:
    """Pending names in all, and per key and per login (a name counts once for each key
    and each login that registered it)."""

    def __init__(self) -> None:
        self.names = 0
        self.by_key: Counter[str] = Counter()

    def recount(self, records: Iterable[NodeRecord]) -> None:
        """Start again from the pending records the full sweep read."""
        self.names = 0
        self.by_key = Counter()
        for record in records:
            if record.state == "pending":
                self.names += 1
                self.by_key.update(holders(record))

    def add(self, public_key: str, login: str, new_name: bool) -> None:
        """A registration just recorded ``public_key``, sent by ``login`` (on a name it
        made, or as a candidate)."""
        self.names += int(new_name)
        self.by_key[public_key] += 1
        if login:
            self.by_key[LOGIN + login] += 1

    def refusal(
        self, public_key: str, login: str, new_name: bool, max_names: int, per_key: int
    ) -> str:
        """Why a registration may not add a pending name (``new_name``: there are
        ``max_names``) or a candidate key to one (the key or the login has ``per_key``
        pending names); "" when it may."""
        if new_name and self.names >= max_names:
            return "too many pending registrations"
        if self.by_key[public_key] >= per_key:
            return "too many pending registrations for this key"
        if login and self.by_key[LOGIN + login] >= per_key:
            return "too many pending registrations for this login"
        return ""
