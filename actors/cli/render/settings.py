"""``fleetctl describe``'s settings section: every value the fleet's settings give a node,
with the entry it comes from and what the node made of it (its heartbeat's
``settings``: applied, waiting for a restart, refused and why), and whether the node has
reached the latest revision that concerns it. Every other setting is the node's own."""

from __future__ import annotations

from actors.cli.render.tables import grid
from actors.fleet.storage.settings import StoredEntry
from schemas.messages import NodeRecord
from schemas.settings import FLEET_KEY, SettingsEntry, in_force, reaches, selector_text

OWN = "  every other setting is the node's own: its file, environment, flags or defaults"


def source_text(key: str, entries: dict[str, SettingsEntry]) -> str:
    """An entry's bucket key as operators name its scope."""
    entry = entries.get(key)
    if entry is None:
        return "fleet" if key == FLEET_KEY else key
    if entry.scope == "cluster":
        return f"cluster {entry.cluster}"
    if entry.scope == "selector":
        return f"selector {selector_text(entry.selector)}"
    return "fleet"


def settings_lines(record: NodeRecord, stored: list[StoredEntry]) -> list[str]:
    """The section's lines for ``record`` given the bucket's current entries."""
    status = record.heartbeat.settings if record.heartbeat is not None else None
    valid = {found.key: found.entry for found in stored if found.entry is not None}
    force = in_force(valid.items(), record.cluster, record.labels)
    latest = max(
        (e.revision for e in valid.values() if reaches(e, record.cluster, record.labels)),
        default=0,
    )
    if status is None:
        said = "not reported (an agent that predates fleet settings, or no heartbeat yet)"
        return [f"Settings:        {said}", OWN] if force else [f"Settings:        {said}"]
    behind = "" if status.revision >= latest else f", behind: the latest for it is {latest}"
    head = f"Settings:        revision {status.revision}{behind}"
    keys = sorted(force.keys() | status.applied.keys() | status.refused.keys() | {*status.restart})
    if not keys:
        return [f"{head}; the fleet sets nothing here", OWN]
    rows: list[tuple[str, ...]] = [("SETTING", "VALUE", "SOURCE", "ON THE NODE")]
    for key in keys:
        found = force.get(key)
        value = found.value if found is not None else "-"
        source = status.applied.get(key) or (found.source if found is not None else "")
        if key in status.applied:
            state = "applied"
        elif key in status.restart:
            state = "at the next start" if found is not None else "its own, at the next start"
        elif key in status.refused:
            state = f"refused: {status.refused[key]}"
        else:
            state = "not taken yet"
        rows.append((key, value, source_text(source, valid) if source else "-", state))
    return [head, *grid(rows), OWN]
