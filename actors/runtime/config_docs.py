"""What each setting means and what it defaults to, read from the settings Struct itself:
the docstring under each field (``ast`` of the class's source) and its default, so
``--help``, docs/settings.md and the code say the same thing.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from collections.abc import Mapping
from typing import Any

import msgspec

from actors.runtime.config import duration_fields, list_fields

MIB = 1024 * 1024

_SENTENCE_END = re.compile(r"(?<=[a-z0-9)`'\"]\.)\s+(?=[A-Z`(])")


@functools.cache
def setting_docs(config_type: type[msgspec.Struct]) -> Mapping[str, str]:
    """Each field's docstring (the string literal right under it) on one line, its
    reStructuredText ````code```` written as Markdown's `code`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(config_type)))
    [definition] = tree.body
    assert isinstance(definition, ast.ClassDef)
    found: dict[str, str] = {}
    for statement, after in zip(definition.body, definition.body[1:], strict=False):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[statement.target.id] = " ".join(after.value.value.split()).replace("``", "`")
    return found


def plain(text: str) -> str:
    """``text`` on one line without code quotes, for a terminal."""
    return " ".join(text.replace("`", "").split())


def summary(text: str) -> str:
    """The first sentence of ``text`` (``--help`` shows it; the docs the whole text)."""
    return _SENTENCE_END.split(text, maxsplit=1)[0].rstrip(".;") + "."


@functools.cache
def _fields_by_name(config_type: type[msgspec.Struct]) -> Mapping[str, msgspec.structs.FieldInfo]:
    """``config_type``'s fields by name, read once per type (a parser asks for each)."""
    return {field.name: field for field in msgspec.structs.fields(config_type)}


def default_text(config_type: type[msgspec.Struct], name: str) -> str:
    """The default of setting ``name`` as a person writes it: ``10s``, ``none``, ``off``,
    ``3 x heartbeat_interval``; a default computed at start (the hostname) in the
    words of its factory's docstring, so the text does not depend on the machine."""
    derived: Mapping[str, tuple[str, float]] = getattr(config_type, "derived_defaults", {})
    if name in derived:
        source, factor = derived[name]
        return f"{factor:g} x {source}"
    field = _fields_by_name(config_type)[name]
    if field.default_factory is not msgspec.NODEFAULT:
        factory: Any = field.default_factory
        value = factory()
        if not isinstance(value, list | dict) and factory.__doc__:
            return plain(factory.__doc__)
    else:
        value = field.default
    if name in duration_fields(config_type) and isinstance(value, int | float):
        return duration_text(float(value))
    if name.endswith("_bytes") and isinstance(value, int) and value >= MIB and not value % MIB:
        return f"{value} ({value // MIB} MiB)"
    return value_text(value)


def value_text(value: object) -> str:
    if value is None or value == [] or value == {}:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if value == "":
        return "empty"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ",".join(str(item) for item in value)
    return str(value)


def duration_text(seconds: float) -> str:
    """``86400`` as ``1d``, ``300`` as ``5m``, ``0.5`` as ``0.5s``: the largest unit that
    writes it exactly, in the form every duration setting accepts back."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def flag_help(config_type: type[msgspec.Struct], name: str, env_prefix: str) -> str:
    """One flag's ``--help`` line: what the setting means, its default, its variable (and
    for a list setting that the flag repeats or takes items comma-separated)."""
    meaning = plain(summary(setting_docs(config_type).get(name, "")))
    env = f"{env_prefix}{name.upper()}"
    items = " Repeatable, or items comma-separated." if name in list_fields(config_type) else ""
    return f"{meaning}{items} Default: {default_text(config_type, name)}. Env {env}."
