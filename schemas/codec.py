"""JSON encoding and decoding of wire types, with encoders and decoders built once."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from schemas.errors import DecodeError

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def encode(message: msgspec.Struct) -> bytes:
    """The exact bytes that go on the wire (and that a signature covers)."""
    return _encoder.encode(message)


def decode(data: bytes, message_type: type[T], subject: str = "") -> T:
    """Decode ``data`` as ``message_type``; failures name the subject they came from."""
    decoder = _decoders.get(message_type)
    if decoder is None:
        decoder = _decoders[message_type] = msgspec.json.Decoder(message_type)
    try:
        result: T = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        # msgspec raises UnicodeDecodeError, not DecodeError, for invalid UTF-8 in a string.
        raise DecodeError(subject, message_type.__name__, str(exc)) from None
    return result
