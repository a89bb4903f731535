"""Export a JSON Schema for every wire type into ``schemas/json/``, and the field tables
of the README's wire contract.

Run ``python -m schemas.jsonschema`` after changing a wire type; tests fail while the files
on disk or the README's tables differ from what this module would write.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from schemas import events, fleet_index, inventory, messages, placement, remediation, settings
from schemas.base import SIGNED_TYPE

JSON_DIR = Path(__file__).parent / "json"
README = Path(__file__).parent.parent / "docs" / "wire-contract.md"
TABLES_START = "<!-- wire-fields:start (python -m schemas.jsonschema) -->"
TABLES_END = "<!-- wire-fields:end -->"

WIRE_TYPES: tuple[type[msgspec.Struct], ...] = (
    messages.Heartbeat,
    events.Sample,
    events.Health,
    events.Latency,
    events.Engine,
    events.Interruption,
    events.NodeState,
    events.Inject,
    events.Workloads,
    events.Gateway,
    events.WorkloadOrder,
    events.CloudFacts,
    events.Scheduler,
    messages.Command,
    messages.CommandResult,
    messages.Alert,
    messages.Registration,
    messages.RegistrationReply,
    messages.Forget,
    messages.ForgetReply,
    messages.Maintenance,
    messages.MaintenanceWindow,
    messages.MaintenanceReply,
    messages.PolicyRequest,
    messages.PolicyReply,
    messages.Probe,
    messages.ProbeReply,
    messages.NodeRecord,
    messages.TrustEntry,
    messages.EnrollClaims,
    messages.EnrollRecord,
    messages.AggregatorLease,
    fleet_index.PartitionIndex,
    remediation.PolicyRecord,
    placement.PlacedWorkload,
    inventory.NodeInventory,
    settings.SettingsEntry,
    settings.Settings,
)


def render() -> dict[str, str]:
    """File name -> file text for every wire type."""
    files = {}
    for wire_type in WIRE_TYPES:
        schema: dict[str, Any] = _schema(wire_type)
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
        files[f"{wire_type.__name__}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return files


def _schema(wire_type: type[msgspec.Struct]) -> dict[str, Any]:
    """msgspec's JSON Schema of ``wire_type``, with the signed-type tag (``SIGNED_TYPE``)
    optional as it is when decoding (msgspec lists a struct's tag as required): a body of
    an earlier version has none. Every description is a cleaned docstring
    (``inspect.cleandoc``), as msgspec 0.23 makes them and 0.22 did not."""
    schema: dict[str, Any] = _cleaned(msgspec.json.schema(wire_type))
    for definition in schema.get("$defs", {}).values():
        if SIGNED_TYPE in definition.get("required", []):
            definition["required"].remove(SIGNED_TYPE)
            definition["properties"][SIGNED_TYPE]["description"] = (
                "what this signed body is; written always, optional when read (a body "
                "naming another type is refused)"
            )
    return schema


def _cleaned(value: Any) -> Any:
    """``value`` (a schema or a part of one) with every description cleaned."""
    if isinstance(value, dict):
        return {
            key: inspect.cleandoc(item)
            if key == "description" and isinstance(item, str)
            else _cleaned(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_cleaned(item) for item in value]
    return value


def write(directory: Path = JSON_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


def _type_of(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        return str(prop["$ref"]).rsplit("/", 1)[-1]
    if "anyOf" in prop:
        return " or ".join(_type_of(option) for option in prop["anyOf"])
    if "enum" in prop:
        return " or ".join(f"`{value}`" for value in prop["enum"])
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list[{_type_of(prop.get('items', {}))}]"
    if kind == "object" and "additionalProperties" in prop:
        return f"map[string, {_type_of(prop['additionalProperties'])}]"
    names = {
        "string": "string",
        "integer": "int",
        "number": "number",
        "boolean": "bool",
        "null": "null",
        "object": "object",
    }
    return names.get(str(kind), str(kind))


BOUND_NOTES = (
    ("minimum", "≥ {}"),
    ("maximum", "≤ {}"),
    ("exclusiveMinimum", "> {}"),
    ("maxLength", "at most {} characters"),
    ("maxItems", "at most {} items"),
    ("maxProperties", "at most {} entries"),
)
"""How each JSON Schema bound reads in the README's field tables, so every bound a reader
must respect (string, list and map sizes included) is stated where the field is."""


def _notes(prop: dict[str, Any]) -> str:
    if "anyOf" in prop:
        options = [option for option in prop["anyOf"] if option.get("type") != "null"]
        return _notes(options[0]) if len(options) == 1 else ""
    notes = []
    if "description" in prop:
        notes.append(str(prop["description"]))
    if "pattern" in prop:
        notes.append(f"pattern `{prop['pattern']}`")
    bounds = [template.format(prop[key]) for key, template in BOUND_NOTES if key in prop]
    notes.extend(bounds)
    return "; ".join(notes)


def render_tables() -> str:
    """Markdown tables of every wire type and every type nested in one, in contract order."""
    definitions: dict[str, dict[str, Any]] = {}
    for wire_type in WIRE_TYPES:
        schema: dict[str, Any] = _schema(wire_type)
        definitions.setdefault(wire_type.__name__, schema["$defs"][wire_type.__name__])
        for name, definition in sorted(schema["$defs"].items()):
            definitions.setdefault(name, definition)
    parts = []
    for name, definition in definitions.items():
        required = set(definition.get("required", []))
        lines = [
            f"#### {name}",
            "",
            str(definition.get("description", "")).replace("``", "`"),
            "",
            "| field | type | required / default | notes |",
            "|---|---|---|---|",
        ]
        for field, prop in definition.get("properties", {}).items():
            presence = "required" if field in required else f"`{json.dumps(prop.get('default'))}`"
            if field == SIGNED_TYPE and field not in required:
                presence = "optional"
            lines.append(f"| `{field}` | {_type_of(prop)} | {presence} | {_notes(prop)} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def readme_with_tables(text: str) -> str:
    """``text`` (the README) with the generated tables between the markers."""
    start = text.index(TABLES_START) + len(TABLES_START)
    end = text.index(TABLES_END)
    return text[:start] + "\n" + render_tables() + text[end:]


if __name__ == "__main__":
    for path in write():
        sys.stdout.write(f"wrote {path}\n")
    README.write_text(readme_with_tables(README.read_text()))
    sys.stdout.write(f"wrote the wire-contract tables of {README}\n")
