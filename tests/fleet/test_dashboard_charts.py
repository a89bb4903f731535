"""The dashboard's charts as drawn on the server: axes with units and clock labels, the
value axis never stretching noise to full height, thresholds in range, gaps, the
readout's data; and the fleet's history they draw from, bounded per fleet."""

from __future__ import annotations

import dataclasses
import math
import re

from actors.fleet.views.dashboard import charts
from actors.fleet.views.dashboard.charts import Chart, Series, value_range
from actors.fleet.views.dashboard.fleet_history import (
    COLUMNS,
    FleetHistory,
    Kept,
    points_for,
    share_of,
)
from tests.fleet.test_dashboard_history import beat

START = 1_699_999_200.0
"""A whole hour (UTC), so the time labels fall on known minutes."""


def hot_chart(*values: float) -> Chart:
    points = [(START + 60.0 * (i + 1), value) for i, value in enumerate(values)]
    return Chart(
        key="hottest",
        title="hottest GPU",
        how="last hour, per minute: max of GPUs",
        unit="°C",
        series=[Series("hottest GPU", points)],
        thresholds=[(85.0, "85 °C: hot")],
        least_span=20,
    )


def test_a_one_degree_change_is_not_drawn_full_height() -> None:
    """52 and 53 °C with the 85 °C threshold: the axis reaches past the threshold, so the
    two points sit close; without a threshold the least span still holds."""
    bottom, top, _ = value_range(hot_chart(52.0, 53.0))
    assert bottom <= 52 and top >= 85 and (top - bottom) >= 30
    plain = Chart(key="k", title="t", how="h", unit="W", series=[Series("s", [(1.0, 300.0)])],
                  least_span=100)  # fmt: skip
    low, high, _ = value_range(plain)
    assert high - low >= 100 and low <= 300 <= high and low >= 0
    fixed = Chart(key="k", title="t", how="h", unit="%", series=[], low=0, high=100)
    assert value_range(fixed)[:2] == (0, 100)


def test_a_chart_has_axes_units_thresholds_and_readout_data() -> None:
    """Clock labels every 15 minutes over an hour (UTC), value labels with the unit, the dashed
    threshold with its label, the points' times and values for the hover readout, and a
    caption saying what it shows and its value now."""
    chart = hot_chart(52.0, 53.0, 97.0)
    drawn = charts.render(
        dataclasses.replace(chart, now="97 °C (live heartbeat, 1s ago)", now_value=97.0),
        START,
        START + 3600,
    )
    labels = re.findall(r'class="axis-x" [^>]*>([0-9:]+)<', drawn)
    assert labels == ["22:00", "22:15", "22:30", "22:45"], "23:00 would run off the plot"
    assert "°C</text>" in drawn and 'class="axis-x unit"' in drawn
    assert 'class="threshold"' in drawn and ">85 °C: hot<" in drawn
    assert 'data-values="52,53,97"' in drawn
    times = re.search(r'data-times="([^"]+)"', drawn)
    assert times is not None and times.group(1).split(",")[0] == f"{START + 60:.0f}"
    assert "last hour, per minute: max of GPUs" in drawn
    assert 'data-now="97"' in drawn and "now 97 °C (live heartbeat, 1s ago)" in drawn


def test_a_gap_breaks_the_line_and_a_lone_point_is_a_dot() -> None:
    """Points a minute apart, then a missing quarter hour, then one point: one line and
    one dot."""
    points = [(START + 60.0 * i, 50.0) for i in range(1, 5)] + [(START + 1800.0, 60.0)]
    chart = Chart(key="k", title="t", how="h", unit="%", series=[Series("s", points)],
                  low=0, high=100)  # fmt: skip
    drawn = charts.render(chart, START, START + 3600)
    assert drawn.count("<polyline") == 1 and drawn.count("<circle") == 1


def test_the_fleet_history_is_per_fleet_and_says_a_day() -> None:
    """A point adds the states' groups, the held GPUs' mean utilisation and power and
    the heartbeats a second since the point before; a day at a minute is 1,440 points
    of a fixed number of columns, whatever the fleet's size."""
    history = FleetHistory(points_for(60.0))
    assert history.points == 1440
    first = Kept()
    first.add(share_of(beat(10, 1000.0, utilization_pct=40, power_w=300.0)))
    history.add(START, {"active": 3, "stale": 2, "offline": 1, "cordoned": 1}, first.totals(0))
    second = Kept()
    second.add(share_of(beat(40, 1060.0, utilization_pct=60, power_w=500.0)))
    history.add(START + 60, {"active": 4}, second.totals(30))
    assert history.series("active", 0.0) == [(START, 3.0), (START + 60, 4.0)]
    assert history.series("stale or offline", 0.0) == [(START, 3.0), (START + 60, 0.0)]
    assert history.series("cordoned or draining", START + 30) == [(START + 60, 0.0)]
    assert history.series("GPU utilisation %", 0.0) == [(START, 40.0), (START + 60, 60.0)]
    assert history.latest("GPU power W") == 4000.0  # 8 GPUs at 500 W
    assert history.series("heartbeats /s", 0.0) == [(START + 60, 0.5)]  # 30 in 60 s
    assert set(history.columns) == set(COLUMNS)
    assert all(len(column) == 1440 for column in history.columns.values())
    assert all(math.isnan(value) for value in history.times[2:])
