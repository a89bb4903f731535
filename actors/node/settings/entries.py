"""The fleet's settings entries a node holds: for each key of KV ``fleet_settings``, the
newest entry it took, kept across restarts in ``<state_dir>/settings.json``.

An entry is taken only when it is signed (``Fleet-Key``/``Fleet-Sig`` over the stored
bytes) by one of the node's operator keys, never its own; it decodes; it names the key
it is stored under (an entry copied to another key is refused); and its revision is
above the one held for that key. Anything else is ignored, and counted once per stored
message by reason. So whoever can write the bucket (in a deployment that lets more than
operators) can neither forge an entry nor bring an older one back: a replayed entry has
a revision the node already passed, and the held revisions survive a restart. (A node
that never held a newer one, a fresh one, takes the newest signed entry it finds.) A
deleted or purged key changes nothing: deleting is not signed.

The held entries are read again at start and checked again (the signer must still be
trusted), so a restart applies the settings the node last took even when the bucket
cannot be read then.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

import msgspec

from actors.runtime.atomic_file import write_atomically
from actors.runtime.bounded import remember
from schemas import codec, signing
from schemas.errors import DecodeError, SignatureError
from schemas.settings import SettingsEntry, entry_key

log = logging.getLogger(__name__)

IGNORE_REASONS: Final = (
    "unsigned",
    "bad_signature",
    "untrusted_key",
    "node_key",
    "malformed",
    "misplaced",
    "replayed",
)
"""Why a stored entry is ignored: no signature (a delete or purge included); a signature
that does not verify; signed by a key that is not one of the node's operators'; signed by
the node's own key; a body that does not decode; an entry of another key; a revision not
above the one held for its key."""
TAKEN: Final = "taken"
KNOWN: Final = ""
"""A message judged before, or the held entry stored again: nothing to do or count."""
MAX_KEYS: Final = 1024
"""Keys held at most (a bucket read answers at most this many)."""
SEEN_MEMORY: Final = 4096
"""Stored messages remembered as judged, so each is counted once."""
FILE_NAME: Final = "settings.json"


class Kept(msgspec.Struct, frozen=True, kw_only=True):
    """One entry as it was stored: its bytes and their signature."""

    key: str
    body: bytes
    signer: str
    signature: str


class KeptFile(msgspec.Struct, kw_only=True):
    """``settings.json``: the held entries, and the labels the node last reported."""

    entries: list[Kept] = []
    labels: dict[str, str] = {}


class Held:
    """The newest entry taken for each key, and what the node's selectors are judged by."""

    def __init__(self, state_dir: Path, node_key: str) -> None:
        self.path = state_dir / FILE_NAME
        self.node_key = node_key
        self.entries: dict[str, tuple[Kept, SettingsEntry]] = {}
        self.labels: dict[str, str] = {}
        """The labels of the node's last heartbeat (its selectors match on them)."""
        self._seen: dict[tuple[str, int], None] = {}

    def load(self, trusted: set[str]) -> None:
        """The entries and labels ``settings.json`` holds, each entry judged again."""
        try:
            kept = msgspec.json.decode(self.path.read_bytes(), type=KeptFile)
        except FileNotFoundError:
            return
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("settings file unreadable; starting without it", extra={"reason": str(exc)})
            return
        self.labels = dict(kept.labels)
        for one in kept.entries[:MAX_KEYS]:
            headers = {signing.HEADER_KEY: one.signer, signing.HEADER_SIG: one.signature}
            reason = self.take(one.key, 0, headers, one.body, trusted)
            if reason != TAKEN:
                log.warning("held settings entry dropped", extra={"key": one.key, "reason": reason})

    def save(self) -> None:
        """Write the held entries and labels down (atomically); a failure is logged."""
        kept = KeptFile(entries=[one for one, _ in self.entries.values()], labels=self.labels)
        try:
            write_atomically(self.path, msgspec.json.encode(kept))
        except OSError as exc:
            log.warning("settings file not written", extra={"reason": str(exc)})

    def take(
        self, key: str, seq: int, headers: dict[str, str], body: bytes, trusted: set[str]
    ) -> str:
        """Judge the message stored as ``key`` at stream sequence ``seq`` (0: from the
        file): TAKEN, KNOWN, or the reason it is ignored (one of IGNORE_REASONS)."""
        if seq:
            if (key, seq) in self._seen:
                return KNOWN
            remember(self._seen, (key, seq), None, SEEN_MEMORY)
        signer = headers.get(signing.HEADER_KEY, "")
        if not body or not signer or signing.HEADER_SIG not in headers:
            return "unsigned"
        if signer == self.node_key:
            return "node_key"
        if signer not in trusted:
            return "untrusted_key"
        try:
            signing.verify(headers, body)
        except SignatureError:
            return "bad_signature"
        try:
            entry = codec.decode(body, SettingsEntry, f"settings key {key}")
            placed = entry_key(entry)
        except (DecodeError, ValueError):
            return "malformed"
        if placed != key:
            return "misplaced"
        held = self.entries.get(key)
        if held is not None and held[0].body == body:
            return KNOWN
        if held is not None and entry.revision <= held[1].revision:
            return "replayed"
        if held is None and len(self.entries) >= MAX_KEYS:
            log.warning("settings keys over the bound; ignored", extra={"key": key})
            return KNOWN
        kept = Kept(key=key, body=body, signer=signer, signature=headers[signing.HEADER_SIG])
        self.entries[key] = (kept, entry)
        return TAKEN

    def trusted_entries(self, trusted: set[str]) -> list[tuple[str, SettingsEntry]]:
        """The held entries whose signer is trusted now (an operator key removed from the
        node's trust takes its settings away with it)."""
        return [
            (key, entry) for key, (kept, entry) in self.entries.items() if kept.signer in trusted
        ]
