"""``fleetctl settings set|unset|get|diff|history|rollback`` and ``fleetctl describe`` as an
operator types them, against a running agent that trusts the operator key."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from schemas import signing
from tests.support.fleet import Fleet
from tests.support.settings import wait_settings


def fleetctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.cli.fleetctl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NO_COLOR": "1"},
    )


async def run(*args: str) -> subprocess.CompletedProcess[str]:
    done = await asyncio.to_thread(fleetctl, *args)
    assert "Traceback" not in done.stderr, done.stderr
    return done


async def test_set_rollback_and_describe_show_each_value_and_its_source(
    fleet: Fleet, tmp_path: Path
) -> None:
    """set writes a signed revision the agent applies live; a second set moves it on;
    diff --to and rollback go back to the first revision's values as a new revision,
    which the agent applies; history lists all three; describe shows each value, the
    scope it comes from and what the node made of it (applied, refused and why)."""
    key_file = tmp_path / "operator.nk"
    operator = signing.create_key_file(key_file)
    await fleet.start_aggregator()
    config = fleet.config(
        trust_operators=[operator.public_key], settings_interval=0.2, stale_after=9.0
    )
    await fleet.start_agent(config)
    where = ("--server", fleet.url, "--prefix", fleet.prefix)
    signed = (*where, "--key-file", str(key_file))

    first = await run(
        "settings", "set", "--cluster", "c1", "heartbeat_interval=2s", "--reason", "calmer", *signed
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout == ("settings cluster c1: wrote revision 1\n  + heartbeat_interval 2s\n")
    await wait_settings(fleet.bus, fleet.prefix, "n1", lambda s, beat: beat.interval == 2.0)

    second = await run("settings", "set", "--cluster", "c1", "heartbeat_interval=1s", *signed)
    assert second.stdout == (
        "settings cluster c1: wrote revision 2\n  ~ heartbeat_interval 2s -> 1s\n"
    )
    await wait_settings(fleet.bus, fleet.prefix, "n1", lambda s, beat: beat.interval == 1.0)

    preview = await run("settings", "diff", "--cluster", "c1", "--to", "1", *where)
    assert preview.stdout == "settings cluster c1:\n  ~ heartbeat_interval 1s -> 2s\n"
    back = await run("settings", "rollback", "--cluster", "c1", *signed)
    assert back.returncode == 0, back.stderr
    assert back.stdout == (
        "settings cluster c1: rolled back to revision 3\n  ~ heartbeat_interval 1s -> 2s\n"
    )
    beat = await wait_settings(
        fleet.bus, fleet.prefix, "n1", lambda s, beat: s.revision == 3 and beat.interval == 2.0
    )
    assert beat.settings is not None and beat.settings.applied == {
        "heartbeat_interval": "cluster.c1"
    }

    history = await run("settings", "history", "--cluster", "c1", *where)
    lines = history.stdout.splitlines()
    assert lines[0].split() == ["REVISION", "WRITTEN", "SIGNED", "BY", "VALUES", "REASON"]
    assert [line.split()[0] for line in lines[1:]] == ["1", "2", "3"]
    assert "calmer" in lines[1] and "rollback to revision 1" in lines[3]
    fingerprint = signing.fingerprint(operator.public_key)
    assert all(fingerprint in line for line in lines[1:])

    # A fleet value the node's own config refuses beside the cluster's heartbeat_interval.
    refused = await run("settings", "set", "stale_after=1s", "probe_interval=3s", *signed)
    assert refused.returncode == 0, refused.stderr
    await wait_settings(fleet.bus, fleet.prefix, "n1", lambda s, _: "probe_interval" in s.applied)
    described = await run("describe", "n1", *where)
    assert described.returncode == 0, described.stderr
    text = described.stdout
    assert "Settings:        revision 4\n" in text
    rows = {line.split()[0]: line.split(maxsplit=3)[1:] for line in text.splitlines()[:-4]}
    assert rows["heartbeat_interval"] == ["2s", "cluster", "c1  applied"]
    assert rows["probe_interval"] == ["3s", "fleet", "applied"]
    assert rows["stale_after"] == [
        "1s",
        "fleet",
        "refused: stale_after (1s) must be longer than heartbeat_interval (2s)",
    ]
    assert "every other setting is the node's own" in text

    listed = await run("settings", "get", "--json", *where)
    entries = {entry["key"]: entry for entry in json.loads(listed.stdout)}
    assert entries["cluster.c1"]["entry"]["values"] == {"heartbeat_interval": "2s"}
    assert entries["fleet"]["signer"] == operator.public_key


async def test_a_value_no_node_takes_is_refused_before_it_is_signed(
    fleet: Fleet, tmp_path: Path
) -> None:
    """A setting the fleet may not set, a misspelt one, a value of the wrong kind, an
    unknown GPU threshold, a period under the fleet's floor and two scopes at once are
    one-line errors, and nothing is written."""
    key_file = tmp_path / "operator.nk"
    signing.create_key_file(key_file)
    await fleet.start_aggregator()
    where = ("--server", fleet.url, "--prefix", fleet.prefix)
    signed = (*where, "--key-file", str(key_file))
    cases = {
        ("trust_operators=UABC",): "error: trust_operators: not settable from the fleet",
        ("hearbeat_interval=5s",): "did you mean 'heartbeat_interval'?",
        ("heartbeat_interval=soon",): "'soon' is not a duration",
        ("gpu_thresholds.hot=80",): "gpu threshold 'hot' is not one of",
        ("settings_interval=1s",): "below 5s, the shortest the fleet may set",
        ("-l", "pool=a", "--cluster", "c1", "sample_interval=1s"): "one scope at a time",
    }
    for args, said in cases.items():
        done = await run("settings", "set", *args, *signed)
        assert done.returncode == 1 and said in done.stderr, (args, done.stderr)
        assert done.stderr.count("\n") == 1
    nothing = await run("settings", "get", *where)
    assert nothing.stdout == "no fleet settings\n"
    unset = await run("settings", "unset", "sample_interval", *signed)
    assert unset.returncode == 1 and "fleet does not set sample_interval" in unset.stderr
