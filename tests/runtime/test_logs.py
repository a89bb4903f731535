"""Log lines: JSON and text carry the same fields; ``auto`` is text on a terminal only."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from actors.runtime import logs


def record() -> logging.LogRecord:
    made = logging.makeLogRecord(
        {"name": "actors.x", "levelno": logging.WARNING, "levelname": "WARNING", "msg": "hi"}
    )
    made.server = "nats://h:4222"
    made.reason = "connection refused"
    return made


def test_text_and_json_show_the_same_fields() -> None:
    same = record()  # one record: its time is what both lines show
    entry = json.loads(logs.JsonFormatter().format(same))
    text = logs.TextFormatter().format(same)
    assert text == (
        f'{entry["time"]} warning actors.x: hi server=nats://h:4222 reason="connection refused"'
    )
    assert set(entry) == {"time", "level", "logger", "msg", "server", "reason"}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("log_format", "stream", "expected"),
    [
        ("auto", Terminal(), logs.TextFormatter),
        ("auto", io.StringIO(), logs.JsonFormatter),
        ("text", io.StringIO(), logs.TextFormatter),
        ("json", Terminal(), logs.JsonFormatter),
    ],
)
def test_format_choice(log_format: logs.LogFormat, stream: io.StringIO, expected: type) -> None:
    assert type(logs.formatter(log_format, stream)) is expected


def test_setup_logs_to_stdout() -> None:
    logs.setup("info", "json")
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout
