"""The XID table, threshold overrides and the count/window tracker."""

from __future__ import annotations

import pytest

from actors.node.config import ENV_PREFIX, AgentConfig
from actors.node.gpu.xid import XidTracker, parse_thresholds, rule_for
from actors.runtime.config import ConfigError, build
from schemas.events import Gpu, XidCount
from schemas.xid_catalog import XID_TABLE

NOW = 1_700_000_000.0


def gpu(index: int, *xids: tuple[int, int, float]) -> Gpu:
    return Gpu(
        index=index,
        uuid=f"GPU-{index}",
        name="test",
        pci_bus_id=f"00000000:{index:02X}:00.0",
        memory_total=1,
        memory_used=0,
        xids=[XidCount(code=code, count=count, last_at=at) for code, count, at in xids],
    )


def test_table_covers_required_codes() -> None:
    """Every XID code the brief names has a rule with a meaning and an action."""
    for code in (13, 31, 43, 45, 48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120):
        rule = XID_TABLE[code]
        assert rule.meaning and rule.action


@pytest.mark.parametrize(
    ("code", "status"),
    [(48, "unhealthy"), (79, "unhealthy"), (95, "unhealthy"), (94, "degraded"), (63, "degraded")],
)
def test_hardware_codes_are_findings_at_once(code: int, status: str) -> None:
    """A single hardware XID makes the xid check its table status, with the table's action."""
    tracker = XidTracker()
    tracker.observe([gpu(0, (code, 1, NOW))])
    check = tracker.check(NOW)
    assert check.status == status
    assert check.action == XID_TABLE[code].action
    assert f"XID {code} x1 on GPU 0" in check.reason


def test_application_code_needs_a_burst() -> None:
    """XID 13 below its count threshold is ok; at the threshold within the window, degraded."""
    tracker = XidTracker()
    threshold = XID_TABLE[13].count
    tracker.observe([gpu(0, (13, threshold - 1, NOW))])
    assert tracker.check(NOW).status == "ok"
    assert "below threshold" in tracker.check(NOW).reason
    tracker.observe([gpu(0, (13, threshold, NOW))])
    assert tracker.check(NOW).status == "degraded"


def test_window_expires_occurrences() -> None:
    """Occurrences older than the code's window no longer count."""
    tracker = XidTracker(parse_thresholds(["79=1/60"]))
    tracker.observe([gpu(0, (79, 1, NOW))])
    assert tracker.check(NOW + 59).status == "unhealthy"
    assert tracker.check(NOW + 61).status == "ok"


def test_threshold_override() -> None:
    """An operator override changes count and window of one code only."""
    thresholds = parse_thresholds(["13=2/30"])
    assert rule_for(13, thresholds).count == 2
    assert rule_for(13, thresholds).window_s == 30.0
    assert rule_for(31, thresholds).count == XID_TABLE[31].count
    tracker = XidTracker(thresholds)
    tracker.observe([gpu(0, (13, 2, NOW))])
    assert tracker.check(NOW).status == "degraded"


def test_bad_threshold_spec_is_refused() -> None:
    """A threshold that is not CODE=COUNT/WINDOW_S raises ValueError."""
    with pytest.raises(ValueError, match="CODE=COUNT/WINDOW_S"):
        parse_thresholds(["13:5"])


def test_counts_are_per_gpu_and_cleared_counts_forget() -> None:
    """Counts on different GPUs do not add up, and a dropped count forgets its history."""
    tracker = XidTracker(parse_thresholds(["13=2/300"]))
    tracker.observe([gpu(0, (13, 1, NOW)), gpu(1, (13, 1, NOW))])
    assert tracker.check(NOW).status == "ok"
    tracker.observe([gpu(0), gpu(1)])
    assert tracker.check(NOW).reason == "no XID errors in their windows"


def test_unknown_code_is_degraded() -> None:
    """A code missing from the table is still a finding, pointing at NVIDIA's catalog."""
    tracker = XidTracker()
    tracker.observe([gpu(3, (999, 1, NOW))])
    check = tracker.check(NOW)
    assert check.status == "degraded"
    assert "catalog" in check.action


def test_thresholds_from_config_layers() -> None:
    """xid_thresholds comes from flags/env as CODE=COUNT/WINDOW_S; other shapes are refused."""
    config = build(AgentConfig, ENV_PREFIX, env={"NODE_AGENT_XID_THRESHOLDS": "13=5/600,79=2/60"})
    assert parse_thresholds(config.xid_thresholds) == {13: (5, 600.0), 79: (2, 60.0)}
    with pytest.raises(ConfigError, match="xid_thresholds"):
        build(AgentConfig, ENV_PREFIX, env={}, flags={"xid_thresholds": ["13:5"]})


def test_the_check_names_the_gpus_at_fault() -> None:
    """A finding names its GPU index in the check's ``gpus`` (the failing ones, not all)."""
    tracker = XidTracker()
    tracker.observe([gpu(0), gpu(1), gpu(2, (79, 1, NOW))])
    check = tracker.check(NOW)
    assert check.status == "unhealthy" and check.gpus == [2]
