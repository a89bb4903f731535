"""How a node judges the fleet's settings entries, without a server: precedence of scopes
and of the node's own layers, items of threshold lists, values its config refuses, what
waits for a restart, and which stored entries it takes at all."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from actors.node.config import ENV_PREFIX, AgentConfig
from actors.node.settings.effective import judge
from actors.node.settings.entries import TAKEN, Held
from actors.node.settings.table import NOT_SETTABLE, PINNED
from actors.runtime.config import Layers, layers
from schemas import codec
from schemas.settings import FLEET_KEY, SettingsEntry, cluster_key, entry_key, selector_key
from schemas.signing import KeyPair

OPERATOR = KeyPair.generate()
NODE = KeyPair.generate()


def entry(values: dict[str, str], revision: int = 1, **scope: object) -> SettingsEntry:
    kind = "selector" if scope.get("selector") else "cluster" if scope.get("cluster") else "fleet"
    return SettingsEntry(
        scope=kind,  # type: ignore[arg-type]  # one of the three, as chosen above
        revision=revision,
        issued_at=time.time(),
        values=values,
        **scope,  # type: ignore[arg-type]  # cluster or selector
    )


def keyed(*entries: SettingsEntry) -> list[tuple[str, SettingsEntry]]:
    return [(entry_key(one), one) for one in entries]


def own(**settings: object) -> Layers[AgentConfig]:
    return Layers.of(AgentConfig(node_id="n1", cluster="c1", **settings))  # type: ignore[arg-type]


def test_the_most_specific_scope_wins_and_names_its_entry() -> None:
    """fleet < cluster < selector, a selector naming more labels over one naming fewer,
    and each applied key names the entry it came from; entries for other clusters or
    labels do not reach the node."""
    entries = keyed(
        entry({"sample_interval": "7", "probe_interval": "7", "health_interval": "7"}, 1),
        entry({"sample_interval": "8", "probe_interval": "8"}, 2, cluster="c1"),
        entry({"sample_interval": "9"}, 3, selector={"pool": "a"}),
        entry({"sample_interval": "4"}, 4, selector={"pool": "a", "rack": "r1"}),
        entry({"health_interval": "1"}, 5, cluster="c2"),
        entry({"health_interval": "2"}, 6, selector={"pool": "b"}),
    )
    outcome = judge(own(), entries, {"pool": "a", "rack": "r1"})
    config = outcome.config
    assert (config.sample_interval, config.probe_interval, config.health_interval) == (4, 8, 7)
    assert outcome.status.applied == {
        "sample_interval": selector_key({"pool": "a", "rack": "r1"}),
        "probe_interval": cluster_key("c1"),
        "health_interval": FLEET_KEY,
    }
    assert outcome.status.revision == 4
    assert outcome.live["sample_interval"] == 4.0


def test_the_nodes_flags_and_environment_beat_the_fleet_and_say_so() -> None:
    """A setting the node's flags or environment set is refused as pinned; one its file
    sets is overridden by the fleet."""
    toml = {"probe_interval": 5.0, "health_interval": 5.0}
    given = layers(
        AgentConfig,
        ENV_PREFIX,
        env={"NODE_AGENT_SAMPLE_INTERVAL": "2"},
        flags={"probe_interval": "3"},
        base=toml,
    )
    values = {"sample_interval": "9", "probe_interval": "9", "health_interval": "9"}
    outcome = judge(given, keyed(entry(values)), {})
    assert outcome.status.refused == {"probe_interval": PINNED, "sample_interval": PINNED}
    assert (outcome.config.sample_interval, outcome.config.probe_interval) == (2, 3)
    assert outcome.config.health_interval == 9
    assert outcome.status.applied == {"health_interval": FLEET_KEY}


def test_refused_values_are_named_with_why_and_the_rest_taken() -> None:
    """A value the config refuses alone, one it refuses beside the node's own settings,
    a setting the fleet may not set, an unknown threshold item and a period under the
    fleet's floor are each refused with why; the valid ones are taken."""
    values = {
        "sample_interval": "1ms",
        "heartbeat_interval": "soon",
        "stale_after": "5s",
        "trust_operators": OPERATOR.public_key,
        "gpu_thresholds.hot": "80",
        "engine_interval": "3s",
    }
    outcome = judge(own(heartbeat_interval=10.0, stale_after=30.0), keyed(entry(values)), {})
    refused = outcome.status.refused
    assert refused["heartbeat_interval"] == (
        "heartbeat_interval: 'soon' is not a duration (use 30, 30s, 500ms, 2m, 1h)"
    )
    assert refused["stale_after"] == "stale_after (5s) must be longer than heartbeat_interval (10s)"
    assert refused["trust_operators"] == NOT_SETTABLE
    assert refused["gpu_thresholds.hot"].startswith("gpu threshold 'hot' is not one of")
    assert refused["sample_interval"] == "sample_interval: below 1s, the shortest the fleet may set"
    assert outcome.status.applied == {"engine_interval": FLEET_KEY}
    assert outcome.config.engine_interval == 3.0


def test_values_that_only_go_together_are_taken_together() -> None:
    """heartbeat_interval above the node's stale_after is fine when the same entry raises
    stale_after too (the loader's rules over the whole, not key by key)."""
    values = {"heartbeat_interval": "60s", "stale_after": "180s"}
    outcome = judge(own(heartbeat_interval=10.0, stale_after=30.0), keyed(entry(values)), {})
    assert outcome.status.refused == {}
    assert (outcome.config.heartbeat_interval, outcome.config.stale_after) == (60, 180)


def test_threshold_items_compose_over_the_nodes_own_list() -> None:
    """Items set by different scopes each replace their own item of the node's list; the
    node's other items stay."""
    entries = keyed(
        entry({"gpu_thresholds.temperature": "88"}, 1),
        entry({"gpu_thresholds.pcie_replays_per_min": "20"}, 2, cluster="c1"),
        entry({"xid_thresholds.13": "5/600"}, 3, cluster="c1"),
    )
    node = own(gpu_thresholds=["persistence_off=off", "temperature=80"])
    outcome = judge(node, entries, {})
    assert outcome.config.gpu_thresholds == [
        "persistence_off=off",
        "temperature=88",
        "pcie_replays_per_min=20",
    ]
    assert outcome.config.xid_thresholds == ["13=5/600"]
    assert set(outcome.status.applied) == {
        "gpu_thresholds.temperature",
        "gpu_thresholds.pcie_replays_per_min",
        "xid_thresholds.13",
    }


def test_a_setting_read_at_start_waits_for_the_next_start() -> None:
    """A restart-only value that differs from what the agent started with is listed as
    waiting, not applied; judged at start (or once running with it) it is applied; one
    the fleet no longer sets waits too, for the node's own value."""
    values = {"shutdown_timeout": "5s", "sample_interval": "2s"}
    started = AgentConfig(node_id="n1", cluster="c1")
    running = judge(own(), keyed(entry(values)), {}, started=started)
    assert running.status.restart == ["shutdown_timeout"]
    assert running.status.applied == {"sample_interval": FLEET_KEY}
    at_start = judge(own(), keyed(entry(values)), {})
    assert at_start.status.restart == [] and at_start.config.shutdown_timeout == 5.0
    dropped = judge(own(), keyed(entry({}, 2)), {}, started=at_start.config)
    assert dropped.status.restart == ["shutdown_timeout"]


def test_the_workload_readiness_interval_is_set_at_start_above_its_floor() -> None:
    """workload_ready_interval, which the workload actor reads from the config it started
    with, waits for the next start; a value under 0.1 s (a typo, probing a starting
    workload every millisecond) is refused, also alone in its entry, where the config
    itself would take it."""
    started = AgentConfig(node_id="n1", cluster="c1")
    running = judge(own(), keyed(entry({"workload_ready_interval": "2s"})), {}, started=started)
    assert running.status.restart == ["workload_ready_interval"]
    at_start = judge(own(), keyed(entry({"workload_ready_interval": "2s"})), {})
    assert at_start.config.workload_ready_interval == 2.0
    typo = judge(own(), keyed(entry({"workload_ready_interval": "1ms"})), {})
    floor = "workload_ready_interval: below 0.1s, the shortest the fleet may set"
    assert typo.status.refused == {"workload_ready_interval": floor}
    assert typo.config.workload_ready_interval == 0.25


def stored(body: SettingsEntry, key: KeyPair | None = OPERATOR) -> tuple[dict[str, str], bytes]:
    data = codec.encode(body)
    return (key.headers(data) if key is not None else {}), data


@pytest.mark.parametrize(
    ("signer", "reason"),
    [(None, "unsigned"), (NODE, "node_key"), (KeyPair.generate(), "untrusted_key")],
    ids=["unsigned", "node-signed", "another key"],
)
def test_only_an_operator_signature_is_taken(
    tmp_path: Path, signer: KeyPair | None, reason: str
) -> None:
    """An entry without a signature, signed by the node's own key or by a key the node
    does not trust is ignored with its reason; the same entry signed by a trusted
    operator is taken."""
    held = Held(tmp_path, NODE.public_key)
    body = entry({"sample_interval": "2s"})
    headers, data = stored(body, signer)
    assert held.take(FLEET_KEY, 1, headers, data, {OPERATOR.public_key}) == reason
    assert held.entries == {}
    headers, data = stored(body)
    assert held.take(FLEET_KEY, 2, headers, data, {OPERATOR.public_key}) == TAKEN


def test_a_forged_misplaced_or_replayed_entry_is_ignored(tmp_path: Path) -> None:
    """A signature over other bytes, an entry stored under another key and an older
    revision stored again after a newer one are each ignored with their reason; a stored
    message is judged once; the newer entry stays held."""
    held = Held(tmp_path, NODE.public_key)
    trusted = {OPERATOR.public_key}
    old_headers, old = stored(entry({"sample_interval": "9s"}, 1))
    new_headers, new = stored(entry({"sample_interval": "2s"}, 2))
    assert held.take(FLEET_KEY, 1, old_headers, old, trusted) == TAKEN
    assert held.take(FLEET_KEY, 2, new_headers, new, trusted) == TAKEN
    assert held.take(FLEET_KEY, 3, old_headers, old, trusted) == "replayed"
    assert held.take(FLEET_KEY, 3, old_headers, old, trusted) == ""  # judged once
    forged = new.replace(b"2s", b"1s")
    assert held.take(FLEET_KEY, 4, new_headers, forged, trusted) == "bad_signature"
    assert held.take(cluster_key("c1"), 5, new_headers, new, trusted) == "misplaced"
    assert held.entries[FLEET_KEY][1].values == {"sample_interval": "2s"}


def test_held_revisions_survive_a_restart(tmp_path: Path) -> None:
    """What a node took is kept in its state dir: a new start holds it again (checked
    again), so the older entry replayed to the restarted node is still refused; an entry
    whose signer is no longer trusted is dropped at load."""
    trusted = {OPERATOR.public_key}
    held = Held(tmp_path, NODE.public_key)
    new_headers, new = stored(entry({"sample_interval": "2s"}, 5))
    assert held.take(FLEET_KEY, 9, new_headers, new, trusted) == TAKEN
    held.labels = {"pool": "a"}
    held.save()
    again = Held(tmp_path, NODE.public_key)
    again.load(trusted)
    assert again.entries[FLEET_KEY][1].revision == 5 and again.labels == {"pool": "a"}
    old_headers, old = stored(entry({"sample_interval": "9s"}, 4))
    assert again.take(FLEET_KEY, 10, old_headers, old, trusted) == "replayed"
    distrusting = Held(tmp_path, NODE.public_key)
    distrusting.load(set())
    assert distrusting.entries == {}
