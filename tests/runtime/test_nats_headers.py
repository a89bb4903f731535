"""The faster header parser gives what nats-py's own gives, and is the one installed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
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


PIECES = st.sampled_from(
    [
        b"\r\n",
        b":",
        b" ",
        b"\t",
        b"\x0b",
        b"\x0c",
        b"\x1c",
        b"\x1f",
        b"\x85",
        b"\xc2\xa0",
        b"\xa0",
        b"\xff",
        b"\r",
        b"\n",
        b"Fleet-Key",
        b"Nats-Sequence",
        b"a",
        b"Z",
        b"-",
        b"\x00",
    ]
)


@given(st.lists(PIECES, max_size=40).map(b"".join))
def test_same_result_as_nats_py_for_any_block(raw: bytes) -> None:
    """Any block of header-like pieces (whitespace of every kind, bare CR or LF, colons,
    non-ASCII bytes and UTF-8) parses to exactly nats-py's result, ASCII or not."""
    original = nats_headers.ORIGINAL
    assert isinstance(original, staticmethod)
    assert nats_headers.parse_header_lines(raw) == original.__func__(raw)


def test_installed() -> None:
    """Importing the bus installs it on nats-py's client."""
    import actors.runtime.bus  # noqa: F401

    assert Client._parse_header_lines is nats_headers.parse_header_lines
