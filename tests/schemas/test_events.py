"""Node events decode through one table from event kind to Struct."""

from __future__ import annotations

import pytest

from schemas import codec
from schemas.errors import DecodeError
from schemas.events import EVENT_TYPES, Event, decode_event
from schemas.subjects import EVENT_SAMPLE, EVENT_STATE, Subjects
from tests.schemas.test_schemas import EXAMPLES

EVENTS: dict[type[Event], Event] = {
    type(example): example for example in EXAMPLES if isinstance(example, Event)
}


@pytest.mark.parametrize("kind", sorted(EVENT_TYPES))
def test_every_event_kind_round_trips(kind: str) -> None:
    """An event published on its kind's subject decodes back to an equal message."""
    event = EVENTS[EVENT_TYPES[kind]]
    subject = Subjects("fleet").event("n1", kind)
    assert decode_event(subject, codec.encode(event)) == event


def test_unknown_kind_is_a_decode_error_naming_the_subject() -> None:
    """A kind the table does not know is refused like a malformed body."""
    subject = Subjects("fleet").event("n1", "gossip")
    with pytest.raises(DecodeError, match=r"fleet\.evt\.n1\.gossip"):
        decode_event(subject, b"{}")


def test_malformed_body_is_a_decode_error() -> None:
    """A body that is not its kind's Struct is a DecodeError, whatever the kind."""
    subject = Subjects("fleet").event("n1", EVENT_SAMPLE)
    with pytest.raises(DecodeError):
        decode_event(subject, b"not json")
    with pytest.raises(DecodeError):
        decode_event(subject, codec.encode(EVENTS[EVENT_TYPES[EVENT_STATE]]))
