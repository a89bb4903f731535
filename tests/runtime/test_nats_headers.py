"""The faster header parser gives what nats-py's own gives, and is the one installed."""

from __future__ import annotations

from nats.aio.client import Client

from actors.runtime import nats_headers

SAMPLES = [
    b"Fleet-Key: UABC\r\nFleet-Sig: c2ln+/==\r\nNats-Msg-Id: n1:b:1\r\nNats-TTL: 30\r\n\r\n",
    b"Name:Value\r\nName2:\tspaced \r\n",
    b"Bad Name: x\r\nTab\tName: y\r\nUnit\x1fSep: z\r\nok: w\r\n",
    b"no-colon\r\n:empty-name\r\nK: caf\xc3\xa9 \xff\r\n",
    b"N\xc3\xa4me: non-ascii name\r\nA: 1\r\nA: 2\r\n",
    b"",
]


def test_same_result_as_nats_py() -> None:
    """Every sample, hostile ones included, parses to exactly nats-py's result."""
    original = nats_headers.ORIGINAL
    assert isinstance(original, staticmethod)
    for raw in SAMPLES:
        assert nats_headers.parse_header_lines(raw) == original.__func__(raw), raw


def test_installed() -> None:
    """Importing the bus installs it on nats-py's client."""
    import actors.runtime.bus  # noqa: F401

    assert Client._parse_header_lines is nats_headers.parse_header_lines
