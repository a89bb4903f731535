"""No test sleeps to wait for something: a test waits for the condition it needs
(tests/support/fleet.py's ``wait_for``/``poll``, a subscription, a process's exit), and a
``sleep(`` with a duration is written only where time itself is the subject, each listed
here with its reason. A new one fails this test until it is replaced by a wait, or listed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
SLEEP = re.compile(r"\bsleep\((?!\s*0\s*\))")
"""A sleep with a duration (``sleep(0)``, a yield to the loop, waits for nothing)."""

OUTSIDE = {
    "tests/bench": "benchmarks pace their load and measure over time; the suite runs none",
}
"""Folders of tests/ the rule does not cover, each with its reason."""

ABSENCE = "nothing may happen for a while: the window is the subject (an absence has no event)"
PACE = "the pace of a load or an attacker is the subject, not a wait"
HARNESS = (
    "the fault harness's own clock: a fault's length, the gaps between faults, the pace of "
    "its retries and of its polls of a condition"
)
STAND_IN = "a stand-in server's behaviour: answering late, or never, is what it plays"

ALLOWED: dict[tuple[str, str], str] = {
    ("tests/support/fleet.py", "await asyncio.sleep(interval)"): "wait_for's own poll",
    ("tests/support/fleet.py", "time.sleep(interval)"): "poll's own poll",
    ("tests/support/metadata_fakes.py", "await asyncio.sleep(failure)"): STAND_IN,
    ("tests/support/llamacpp_standin.py", "time.sleep(delay * len(WORDS))"): STAND_IN,
    ("tests/support/llamacpp_standin.py", "time.sleep(delay)"): STAND_IN,
    (
        "tests/support/llamacpp_standin.py",
        'code = "import time\\nwhile True: time.sleep(1)"',
    ): "a child process that never ends by itself, for the stand-in to leave behind",
    ("tests/support/llamacpp_standin.py", "time.sleep(args.crash_after)"): STAND_IN,
    ("tests/cli/test_node_status.py", "await asyncio.sleep(0.2)  # the slow agent's pace"): PACE,
    ("tests/fleet/test_dashboard_attention.py", "time.sleep(self.took)"): (
        "a stand-in view's read of every record takes its time: that time is the subject"
    ),
    (
        "tests/fleet/test_outage.py",
        "await asyncio.sleep(2.0)  # the outage itself: 6 s at least, three times the bound",
    ): "the outage's length against bus_outage_max is the subject",
    (
        "tests/runtime/test_sniff.py",
        "await asyncio.sleep(0.3)  # slower than the loopback wait (0.15 s)",
    ): STAND_IN,
    ("tests/faults/cluster.py", "time.sleep(0.1)"): HARNESS,
    ("tests/faults/collect.py", "await asyncio.sleep(1.0 + attempt)"): HARNESS,
    ("tests/faults/collect.py", "await asyncio.sleep(1.0)"): (
        "the event loop's lag is measured as a 1 s sleep's overrun"
    ),
    ("tests/faults/nemesis.py", "await asyncio.sleep(0.25)"): HARNESS,
    ("tests/faults/nemesis.py", "await asyncio.sleep(plan.length)"): HARNESS,
    ("tests/faults/nemesis.py", "await asyncio.sleep(self.rng.uniform(*GAP))"): HARNESS,
    ("tests/faults/operator.py", "await asyncio.sleep(0.5)"): HARNESS,
    ("tests/faults/run.py", "await asyncio.sleep(0.5)"): HARNESS,
    ("tests/fleet/test_silence.py", "await asyncio.sleep(0.5)"): (
        "simulated nodes beat at their pace (two a second)"
    ),
    ("tests/fleet/test_silence.py", "await asyncio.sleep(0.5)  # the nodes' own pace"): (
        "simulated nodes beat at their pace (two a second)"
    ),
    ("tests/fleet/test_outage.py", "await asyncio.sleep(0.5)  # the node's own pace"): (
        "a simulated node beats at its pace (two a second)"
    ),
    ("tests/fleet/test_outage.py", "await asyncio.sleep(0.5)  # the nodes' own pace"): (
        "simulated nodes beat at their pace (two a second)"
    ),
    (
        "tests/node/test_latency.py",
        "time.sleep(block)  # noqa: ASYNC251  # holds the loop on purpose: what is simulated",
    ): "a busy event loop is what is simulated: the block is the subject",
    (
        "tests/system/test_bus_restart.py",
        "await asyncio.sleep(max(0.0, OUTAGE - (time.monotonic() - stopped)))  # the outage",
    ): "the server stays down for the outage's length: that length is the subject",
    ("tests/node/test_latency.py", "await asyncio.sleep(30)"): STAND_IN,
    ("tests/node/test_engine.py", "await asyncio.sleep(30)"): STAND_IN,
    (
        "tests/fleet/test_remediation_hooks.py",
        '([sys.executable, "-c", "import time; time.sleep(60)"], 0.5, "still running after 0.5s"),',
    ): "a hook that outlives its timeout: the timeout is the subject",
    (
        "tests/fleet/test_ownership.py",
        "await asyncio.sleep(INTERVAL)",
    ): "a simulated node beats at its interval",
    ("tests/fleet/test_ownership.py", "await asyncio.sleep(1.0)"): (
        "a slow KV page read: the API must keep serving while one takes this long"
    ),
    ("tests/fleet/test_sequence_gaps.py", "await asyncio.sleep(INTERVAL)"): (
        "a beat sent one interval after the last: the gap between beats is the subject"
    ),
    ("tests/fleet/test_sequence_gaps.py", "await asyncio.sleep(0.01)"): (
        "two beats with distinct timestamps: their order in time is the subject"
    ),
    (
        "tests/fleet/test_aggregator.py",
        "await asyncio.sleep(1.5)  # past offline_after and several sweeps",
    ): ABSENCE,
    (
        "tests/runtime/test_runtime.py",
        "await asyncio.sleep(0.01)  # its work, a tick every 10 ms",
    ): ("the actor's own work, ticking"),
    ("tests/runtime/test_notify.py", "await asyncio.sleep(0.3)"): (
        "watchdog pings stop while an actor backs off: their absence over a window"
    ),
    ("tests/cli/test_rolling.py", "await asyncio.sleep(0.3)"): (
        "a node's work takes a while to finish: the rollout must wait for it"
    ),
    (
        "tests/cli/test_fleetctl_listing.py",
        "await asyncio.sleep(0.05)  # listings spread over the load, not back to back",
    ): PACE,
    (
        "tests/security/test_under_attack.py",
        "await asyncio.sleep(0.2)  # the attacker's pace: five rounds a second",
    ): PACE,
    (
        "tests/security/test_limits.py",
        "await asyncio.sleep(max(0.0, started + (sent + 1) / 300 - time.monotonic()))",
    ): PACE,
    (
        "tests/security/test_nesting.py",
        "await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))",
    ): PACE,
    ("tests/security/test_local_surfaces.py", "await asyncio.sleep(0.1)"): (
        "a slow-loris client, one header byte per 0.1 s: its pace is the attack"
    ),
    ("tests/security/test_inboxes.py", "await asyncio.sleep(1.0)"): (
        "answers per one-second window: more must not come in the next window"
    ),
    ("tests/security/test_monitor.py", "await asyncio.sleep(0.2)"): (
        "published again until heard: the pace of the retries"
    ),
    ("tests/security/test_monitor.py", "await asyncio.sleep(SETTLE)"): ABSENCE,
    ("tests/security/test_permissions.py", "await asyncio.sleep(SETTLE)"): ABSENCE,
    ("tests/security/test_signed_events.py", "await asyncio.sleep(QUIET_S)"): ABSENCE,
    ("tests/security/test_signed_events.py", "await asyncio.sleep(QUIET_S / 3)"): PACE,
    ("tests/security/test_signed_events.py", "await asyncio.sleep(QUIET_S / 2)"): ABSENCE,
    ("tests/security/test_command_replay.py", "time.sleep(0.1)"): (
        "a command's 0.05 s expiry passes: the expiry is the subject"
    ),
}
"""Each sleep with a duration in tests/: (file, the line as written) -> why time is its
subject there."""


def sleeps(text: str) -> list[str]:
    """The lines of ``text`` that sleep with a duration, stripped."""
    return [line.strip() for line in text.splitlines() if SLEEP.search(line)]


def found() -> set[tuple[str, str]]:
    """(file, line) of every sleep with a duration in tests/, outside OUTSIDE's folders
    and this file (whose list and examples name sleeps)."""
    lines: set[tuple[str, str]] = set()
    for path in sorted(TESTS.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if path == Path(__file__) or any(name.startswith(f"{folder}/") for folder in OUTSIDE):
            continue
        lines.update((name, line) for line in sleeps(path.read_text()))
    return lines


def test_no_test_sleeps_to_wait() -> None:
    """Every sleep with a duration in tests/ is on the allow-list, and every entry of the
    list still names one (a sleep replaced by a wait leaves the list too)."""
    lines = found()
    unlisted = sorted(lines - ALLOWED.keys())
    assert not unlisted, f"wait for the condition instead of sleeping (or list it): {unlisted}"
    gone = sorted(ALLOWED.keys() - lines)
    assert not gone, f"allow-list entries with no such sleep any more: {gone}"
    assert all(reason.strip() for reason in [*ALLOWED.values(), *OUTSIDE.values()])


def test_the_sleep_check_finds_a_sleep_and_passes_a_yield() -> None:
    """A sleep with a duration is found, in either spelling; ``sleep(0)`` and a word that
    merely ends in sleep are not."""
    assert sleeps("await asyncio.sleep(2.0)\n") == ["await asyncio.sleep(2.0)"]
    assert sleeps("    time.sleep(interval)\n") == ["time.sleep(interval)"]
    assert sleeps("await asyncio.sleep(0)\nawait oversleep(3)\n") == []
