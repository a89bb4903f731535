"""JSON encoding and decoding of wire types, with encoders and decoders built once."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from schemas.errors import DecodeError

T = TypeVar("T")

MAX_DEPTH = 32
"""Deepest nesting of arrays and objects a wire message may have, counted from the
message itself: what every reader of every message enforces (the aggregator's judge
of heartbeats too). The deepest wire type nests 7 levels (a NodeRecord holding a
heartbeat; tests/schemas checks this); anything deeper is refused, whatever its fields
are (unknown ones included). A type that holds another message's own bytes says how
deep it holds them (``embeds_at``: :class:`~schemas.messages.NodeRecord`'s heartbeat),
and is allowed that much more, so the message inside keeps the same bound."""

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, tuple[msgspec.json.Decoder[Any], int]] = {}
"""Each type's decoder and :func:`depth_limit`, made at its first decode."""


def encode(message: msgspec.Struct) -> bytes:
    """The exact bytes that go on the wire (and that a signature covers)."""
    return _encoder.encode(message)


def depth_limit(message_type: Any) -> int:
    """How deep a body of ``message_type`` may nest: :data:`MAX_DEPTH`, plus the level at
    which it embeds another message's bytes, if it does (``embeds_at``)."""
    return MAX_DEPTH + int(getattr(message_type, "embeds_at", 0))


def decode(data: bytes, message_type: type[T], subject: str = "") -> T:
    """Decode ``data`` as ``message_type``; failures name the subject they came from.

    A body nested deeper than :func:`depth_limit` is refused, the same for every reader.
    msgspec walks nesting (unknown fields' too) recursively and raises RecursionError at
    Python's recursion limit less the caller's own depth; that is a refusal too, but on
    its own whether a body decodes would depend on who reads it: the judge, which once
    relied on it alone, accepted heartbeats up to about 900 levels deep whose records
    every other reader refused (the depth scan, :func:`within_depth`, costs the judge
    about 7 % of its instructions per heartbeat: tests/bench/bench_instructions.py)."""
    known = _decoders.get(message_type)
    if known is None:
        known = _decoders[message_type] = (
            msgspec.json.Decoder(message_type),
            depth_limit(message_type),
        )
    decoder, limit = known
    try:
        result: T = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        # msgspec raises UnicodeDecodeError, not DecodeError, for invalid UTF-8 in a string.
        raise DecodeError(subject, message_type.__name__, str(exc)) from None
    except RecursionError:
        raise DecodeError(subject, message_type.__name__, too_deep(limit)) from None
    if not within_depth(data, limit):
        raise DecodeError(subject, message_type.__name__, too_deep(limit))
    return result


def too_deep(limit: int) -> str:
    return f"nested deeper than {limit} levels"


_NOT_STRUCTURE = bytes(byte for byte in range(256) if byte not in b'[]{}"')
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
_ONE_KIND = bytes.maketrans(b"{}", b"[]")
"""Objects' braces read as brackets: in a valid document each closes its own kind."""
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def within_depth(data: bytes, limit: int) -> bool:
    """Whether the JSON document ``data`` (valid: decoded already) nests arrays and objects
    at most ``limit`` deep, in C loops over the bytes (about 70,000 instructions for a
    4 KB heartbeat, two thirds of them the one pass over every byte), never a Python loop
    per byte. Only brackets and quotes are kept. With no escape in the document (a
    backslash: one ``memchr``), a string that holds no bracket is then a bare ``""``;
    counted left to right every quote pairs with the next one only if no string holds a
    bracket (the first that does leaves its opening quote unpaired), and then the
    brackets are the document's structure. Otherwise the strings are cut out with a
    regular expression first (slower; honest messages hold neither)."""
    kept = data.translate(_ONE_KIND, _NOT_STRUCTURE)
    brackets = kept.translate(None, b'"')
    if b"\\" not in data and len(kept) - len(brackets) == 2 * kept.count(b'""'):
        return _nesting_within(brackets, limit)
    return _nesting_within(_STRINGS.sub(b"", data).translate(_ONE_KIND, _NOT_BRACKETS), limit)


def _nesting_within(brackets: bytes, limit: int) -> bool:
    """Whether balanced ``brackets`` nest at most ``limit`` deep: each round removes the
    innermost pairs (one ``replace``: the pairs it makes are left for the next), one
    level."""
    for _ in range(limit):
        if not brackets:
            return True
        brackets = brackets.replace(b"[]", b"")
    return not brackets
