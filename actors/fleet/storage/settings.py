"""KV ``fleet_settings`` as operators read and write it (``fleetctl settings``, ``fleetctl
describe``): the current entry of every key, one key's kept revisions, and a new entry
written signed, by compare-and-set on the key's last revision.

What a node takes of these entries, and why, is the node's (actors/node/settings/); here
an entry is only read as stored: whether its signature verifies over its bytes, whose
key signed it, whether it is where it claims to be. Which operator keys a node trusts
only the node knows.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import msgspec
import nats.errors
import nats.js.errors

from actors.runtime import direct_get
from actors.runtime.bus import Bus, publish_signed
from schemas import codec, signing
from schemas.errors import DecodeError, FleetError, SignatureError
from schemas.settings import SettingsEntry, entry_key
from schemas.signing import KeyPair
from schemas.subjects import BUCKET_SETTINGS, Subjects

READ_TIMEOUT = 5.0
WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code for a write whose expected last revision is not the key's."""


class NoSettingsBucket(FleetError):
    def __init__(self) -> None:
        super().__init__(
            "no fleet_settings bucket: start an aggregator (of this version) on this prefix first"
        )


class StoredEntry(NamedTuple):
    """One message of the bucket, read."""

    key: str
    revision: int
    """Its KV revision (the stream sequence), what a compare-and-set names."""
    stored: float
    signer: str
    """The public key of its ``Fleet-Key`` header ("" when unsigned)."""
    entry: SettingsEntry | None
    """The entry, when it verifies, decodes and sits under its own key."""
    problem: str
    """Why ``entry`` is None: unsigned (a delete or purge too), bad signature, malformed,
    or stored under another key."""


def _bucket(subjects: Subjects) -> tuple[str, str]:
    """(stream, subject prefix) of the bucket."""
    bucket = subjects.bucket_name(BUCKET_SETTINGS)
    return f"KV_{bucket}", f"$KV.{bucket}."


def read_stored(message: direct_get.Stored, prefix: str) -> StoredEntry:
    """``message`` read as an entry: verified over its bytes, decoded, placement checked."""
    key = message.subject.removeprefix(prefix)
    signer = message.headers.get(signing.HEADER_KEY, "")

    def stored(entry: SettingsEntry | None, problem: str) -> StoredEntry:
        return StoredEntry(key, message.seq, message.stored, signer, entry, problem)

    if not message.data or not signer:
        return stored(None, "unsigned")
    try:
        signing.verify(message.headers, message.data)
    except SignatureError:
        return stored(None, "bad signature")
    try:
        entry = codec.decode(message.data, SettingsEntry, f"settings key {key}")
        placed = entry_key(entry)
    except (DecodeError, ValueError) as exc:
        return stored(None, f"malformed: {exc}")
    if placed != key:
        return stored(None, f"stored under {key}, written for {placed}")
    return stored(entry, "")


async def current(bus: Bus, subjects: Subjects) -> list[StoredEntry]:
    """The latest message of every key (one batched direct get); NoSettingsBucket when
    the bucket does not exist."""
    stream, prefix = _bucket(subjects)
    try:
        found = await direct_get.last_of(bus, stream, [f"{prefix}>"], READ_TIMEOUT)
    except direct_get.BatchError as exc:
        if "503" in str(exc):
            raise NoSettingsBucket from None
        raise
    except nats.errors.NoRespondersError:
        raise NoSettingsBucket from None
    return [read_stored(message, prefix) for message in found]


async def history(bus: Bus, subjects: Subjects, key: str) -> list[StoredEntry]:
    """Every kept message of ``key``, oldest first."""
    stream, prefix = _bucket(subjects)
    kept: list[StoredEntry] = []
    try:
        async for page in direct_get.pages(bus, stream, prefix + key, READ_TIMEOUT):
            kept += [read_stored(message, prefix) for message in page]
    except direct_get.BatchError as exc:
        if "503" in str(exc):
            raise NoSettingsBucket from None
        raise
    return kept


async def write(bus: Bus, subjects: Subjects, entry: SettingsEntry, key: KeyPair, last: int) -> int:
    """Store ``entry`` signed by ``key`` under its key if the key's latest revision is
    still ``last`` (0: the key has none); its new revision. FleetError when another
    write came first, or the server refuses it."""
    _, prefix = _bucket(subjects)
    name = entry_key(entry)
    try:
        ack, _ = await publish_signed(
            bus,
            prefix + name,
            entry,
            key,
            f"settings:{name}:{entry.revision}",
            headers={"Nats-Expected-Last-Subject-Sequence": str(last)},
        )
    except nats.js.errors.APIError as exc:
        if exc.err_code == WRONG_LAST_SEQUENCE:
            raise FleetError(
                f"settings {name} changed while this was written; run it again"
            ) from None
        raise FleetError(f"settings {name} not written: {exc.description}") from None
    except nats.errors.NoRespondersError:
        raise NoSettingsBucket from None
    return int(ack.seq)


def next_revision(*readings: list[StoredEntry]) -> int:
    """Above every revision of the entries read (a node refuses an entry at or below one
    it took for its key)."""
    revisions = [stored.entry.revision for found in readings for stored in found if stored.entry]
    return 1 + max(revisions, default=0)


def newest(kept: list[StoredEntry]) -> StoredEntry | None:
    """The valid entry of the highest revision among ``kept`` (one key's history): what
    a change starts from, never an older entry stored again after it."""
    valid = [stored for stored in kept if stored.entry is not None]
    return max(valid, key=lambda stored: stored.entry.revision if stored.entry else 0, default=None)


async def put(
    bus: Bus,
    subjects: Subjects,
    signer: KeyPair,
    draft: SettingsEntry,
) -> tuple[SettingsEntry, list[StoredEntry]]:
    """Write ``draft`` (its revision is set here: above every one the bucket holds) as
    its key's next entry; the entry written, and the key's history before it."""
    key = entry_key(draft)
    kept = await history(bus, subjects, key)
    revision = next_revision(await current(bus, subjects), kept)
    entry = msgspec.structs.replace(draft, revision=revision)
    await write(bus, subjects, entry, signer, kept[-1].revision if kept else 0)
    return entry, kept


def as_json(stored: StoredEntry) -> dict[str, object]:
    """One stored entry for ``--json``."""
    entry = stored.entry
    return {
        "key": stored.key,
        "kv_revision": stored.revision,
        "stored": stored.stored,
        "signer": stored.signer,
        "problem": stored.problem,
        "entry": json.loads(codec.encode(entry)) if entry is not None else None,
    }
