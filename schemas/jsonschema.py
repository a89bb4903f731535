"""Export a JSON Schema for every wire type into ``schemas/json/``.

Run ``python -m schemas.jsonschema`` after changing a wire type; a test fails while the
files on disk differ from what this module would write.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from schemas import events, messages

JSON_DIR = Path(__file__).parent / "json"

WIRE_TYPES: tuple[type[msgspec.Struct], ...] = (
    messages.Heartbeat,
    events.Sample,
    events.Health,
    events.Latency,
    events.Engine,
    events.Interruption,
    events.NodeState,
    events.Inject,
    messages.Command,
    messages.CommandResult,
    messages.Alert,
    messages.Registration,
    messages.RegistrationReply,
    messages.Probe,
    messages.ProbeReply,
    messages.NodeRecord,
    messages.TrustEntry,
)


def render() -> dict[str, str]:
    """File name -> file text for every wire type."""
    files = {}
    for wire_type in WIRE_TYPES:
        schema: dict[str, Any] = msgspec.json.schema(wire_type)
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
        files[f"{wire_type.__name__}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return files


def write(directory: Path = JSON_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write():
        sys.stdout.write(f"wrote {path}\n")
