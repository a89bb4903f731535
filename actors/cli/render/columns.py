"""kubectl's listing habits for node records: ``--sort-by`` (a column or a JSON path),
label columns (``-L KEY[,KEY]``, ``--show-labels``) and ``-o custom-columns=NAME:.path,...``.
Pure: records in, values and cells out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from schemas.errors import FleetError
from schemas.messages import NodeRecord

Column = tuple[str, Callable[[NodeRecord], str]]
"""A header and what it shows of a record."""

SORT_FIELDS = {
    "node": "node_id",
    "cluster": "cluster",
    "state": "state",
    "sched": "schedulability",
    "health": "health_score",
    "gpus": "gpus_total",
    "last-seen": "last_seen",
    "age": "created",
    "version": "agent_version",
    "seq": "last_seq",
}
"""``--sort-by`` column names (as the table heads them, lower case, ``-`` for a space) and
the record field each sorts by."""
CUSTOM_PREFIX = "custom-columns="


class ListingError(FleetError):
    """A sort key or column spec that names nothing a record has, in one line."""


def path_of(text: str) -> list[str]:
    """``.heartbeat.sample.hostname`` (kubectl's JSON path, ``{}`` optional) or a column
    name, as the record's keys to walk."""
    bare = text.strip().removeprefix("{").removesuffix("}").strip()
    if not bare.startswith("."):
        field = SORT_FIELDS.get(bare.lower().replace(" ", "-"))
        if field is None:
            names = ", ".join(SORT_FIELDS)
            raise ListingError(
                f"--sort-by {text!r}: use a column ({names}) or a path like .cluster"
            )
        return [field]
    keys = [key for key in bare.split(".") if key]
    if not keys:
        raise ListingError(f"{text!r}: an empty path")
    return keys


def value_at(record: NodeRecord, keys: list[str]) -> Any:
    """The value at ``keys`` in the record as JSON shows it (None where it has none)."""
    value: Any = msgspec.to_builtins(record)
    for key in keys:
        if isinstance(value, dict):
            value = value.get(key)
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return None
    return value


def sort_records(records: list[NodeRecord], key: str) -> list[NodeRecord]:
    """``records`` ordered by ``key`` (ascending, as kubectl's; those without a value
    last, numbers before text)."""
    keys = path_of(key)

    def order(record: NodeRecord) -> tuple[int, float, str]:
        value = value_at(record, keys)
        if value is None:
            return (2, 0.0, "")
        if isinstance(value, bool | int | float):
            return (0, float(value), "")
        return (1, 0.0, str(value))

    return sorted(records, key=order)


def cell(value: Any) -> str:
    if value is None:
        return "<none>"
    if isinstance(value, dict | list):
        return msgspec.json.encode(value).decode()
    return str(value)


def label_columns(keys: list[str], show_labels: bool) -> list[Column]:
    """A column per ``-L`` key (headed by the key in capitals) and, with
    ``--show-labels``, a LABELS column of every label."""
    columns: list[Column] = [(key.upper(), _label(key)) for key in keys]
    if show_labels:
        columns.append(
            (
                "LABELS",
                lambda record: (
                    ",".join(f"{k}={v}" for k, v in sorted(record.labels.items())) or "<none>"
                ),
            )
        )
    return columns


def _label(key: str) -> Callable[[NodeRecord], str]:
    return lambda record: record.labels.get(key, "")


def _at(keys: list[str]) -> Callable[[NodeRecord], str]:
    return lambda record: cell(value_at(record, keys))


def label_keys(given: list[str]) -> list[str]:
    """``-L a,b -L c`` as [a, b, c]."""
    return [key for text in given for key in text.split(",") if key]


def custom_columns(spec: str) -> list[Column]:
    """``custom-columns=NAME:.path,NAME:.path`` as columns; a part without ``:`` or
    path is refused."""
    columns: list[Column] = []
    for part in spec.removeprefix(CUSTOM_PREFIX).split(","):
        name, colon, path = part.partition(":")
        if not colon or not name or not path.strip():
            raise ListingError(f"-o custom-columns: {part!r}: use NAME:.path")
        keys = path_of(path if path.strip().startswith((".", "{")) else "." + path)
        columns.append((name, _at(keys)))
    return columns


def grid_text(records: list[NodeRecord], columns: list[Column]) -> str:
    """Aligned columns, newline-terminated."""
    rows = [tuple(name for name, _ in columns)]
    rows += [tuple(show(record) for _, show in columns) for record in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "".join(
        "  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip()
        + "\n"
        for row in rows
    )
