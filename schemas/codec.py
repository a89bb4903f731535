"""JSON encoding and decoding of wire types, with encoders and decoders built once."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from schemas.errors import DecodeError

T = TypeVar("T")

MAX_DEPTH = 32
"""Deepest nesting of arrays and objects a wire message may have. The deepest wire type
nests 7 levels (a NodeRecord holding a heartbeat; tests/schemas checks this); anything
deeper is refused, whatever its fields are (unknown ones included)."""

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def encode(message: msgspec.Struct) -> bytes:
    """The exact bytes that go on the wire (and that a signature covers)."""
    return _encoder.encode(message)


def decode(data: bytes, message_type: type[T], subject: str = "", *, bounded: bool = True) -> T:
    """Decode ``data`` as ``message_type``; failures name the subject they came from.

    A body nested deeper than :data:`MAX_DEPTH` is refused. msgspec walks nesting (unknown
    fields' too) recursively and raises RecursionError about Python's recursion limit
    less the caller's own depth below; that is a refusal too, but on its own whether a
    body decodes would depend on who reads it (an aggregator could store in a record what
    a reader deeper in its stack cannot read back).

    ``bounded=False`` leaves the depth scan out (about 3 µs of a 4 KB heartbeat: 6 % of the
    aggregator's instructions per heartbeat) and keeps the RecursionError refusal: the
    aggregator's judge only. A signed heartbeat nested just below the interpreter's limit
    is then accepted, and its record may be unreadable to a reader deeper in its stack:
    only its own node's record, which every listing skips and counts."""
    decoder = _decoders.get(message_type)
    if decoder is None:
        decoder = _decoders[message_type] = msgspec.json.Decoder(message_type)
    try:
        result: T = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        # msgspec raises UnicodeDecodeError, not DecodeError, for invalid UTF-8 in a string.
        raise DecodeError(subject, message_type.__name__, str(exc)) from None
    except RecursionError:
        raise DecodeError(subject, message_type.__name__, TOO_DEEP) from None
    if bounded and not within_depth(data, MAX_DEPTH):
        raise DecodeError(subject, message_type.__name__, TOO_DEEP)
    return result


TOO_DEEP = f"nested deeper than {MAX_DEPTH} levels"

_NOT_STRUCTURE = bytes(byte for byte in range(256) if byte not in b'[]{}"\\')
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
_ONE_KIND = bytes.maketrans(b"{}", b"[]")
"""Objects' braces read as brackets: in a valid document each closes its own kind."""
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def within_depth(data: bytes, limit: int) -> bool:
    """Whether the JSON document ``data`` (valid: decoded already) nests arrays and objects
    at most ``limit`` deep, in C loops over the bytes (about 3 us for a 4 KB heartbeat),
    never a Python loop per byte. Only brackets, quotes and backslashes are kept. With no
    escape, a string that holds no bracket is then a bare ``""``; counted left to right
    every quote pairs with the next one only if no string holds a bracket (the first that
    does leaves its opening quote unpaired), and then the brackets are the document's
    structure. Otherwise the strings are cut out with a regular expression first (slower;
    honest messages hold neither)."""
    kept = data.translate(_ONE_KIND, _NOT_STRUCTURE)
    if b"\\" not in kept and kept.count(b'"') == 2 * kept.count(b'""'):
        return _nesting_within(kept.translate(None, b'"'), limit)
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
