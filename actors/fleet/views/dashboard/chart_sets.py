"""Which charts each page draws, with their units, thresholds and titles: a node's last
hour (:func:`node_charts`, from :mod:`.history`; each "now" from the node's live
heartbeat, labelled so) and the fleet's last hour or day (:func:`fleet_charts`, from
:mod:`.fleet_history`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from actors.fleet.views.dashboard import charts
from actors.fleet.views.dashboard.charts import Chart, Series
from actors.fleet.views.dashboard.fleet_history import STATE_GROUPS, FleetHistory
from actors.fleet.views.dashboard.history import point
from actors.runtime.spans import age
from schemas.health_limits import DEGRADED_BELOW, HOT_GPU_C, UNHEALTHY_BELOW
from schemas.messages import Heartbeat

HOUR = 3600.0
DAY = 86_400.0
KILO = 10_000.0
"""Power from this many watts up is drawn in kW."""


def per_point(interval: float) -> str:
    """How often a point is taken, in words: ``per minute``, ``every 30 s``."""
    if interval == 60:
        return "per minute"
    return f"every {interval:g} s" if interval < 120 else f"every {interval / 60:g} min"


def node_charts(
    series: Sequence[Sequence[tuple[float, float]]],
    beat: Heartbeat | None,
    stored: float | None,
    now: float,
    interval: float,
) -> str:
    """The node's five charts of the last hour (``series`` in :data:`.history.SERIES`'s
    order); ``beat`` is its live heartbeat, stored at ``stored``, whose figures are each
    chart's "now"."""
    score, hottest, utilisation, power, cadence = series
    figures = point(beat, None) if beat is not None else None
    said = f"live heartbeat, {age(now - stored)}" if stored is not None else "live heartbeat"
    every = per_point(interval)

    def now_text(value: float | None, unit: str) -> tuple[str, float | None]:
        if value is None:
            return ("", None) if figures is None else (f"- ({said})", None)
        return f"{value:.0f} {unit} ({said})".replace("  ", " "), round(value)

    gpus = beat.sample.gpus if beat is not None and beat.sample is not None else []
    limits = [gpu.power_limit_w for gpu in gpus if not gpu.lost and gpu.power_limit_w]
    made = [
        Chart(
            key="score",
            title="health score",
            how=f"last hour, {every}: the node's score",
            unit="",
            series=[Series("score", score)],
            thresholds=[
                (DEGRADED_BELOW, f"degraded below {DEGRADED_BELOW}"),
                (UNHEALTHY_BELOW, f"unhealthy below {UNHEALTHY_BELOW}"),
            ],
            low=0,
            high=100,
        ),
        Chart(
            key="hottest",
            title="hottest GPU",
            how=f"last hour, {every}: max of GPUs",
            unit="°C",
            series=[Series("hottest GPU", hottest)],
            thresholds=[(HOT_GPU_C, f"{HOT_GPU_C:g} °C: hot")],
            least_span=20,
        ),
        Chart(
            key="utilisation",
            title="GPU utilisation",
            how=f"last hour, {every}: mean of GPUs",
            unit="%",
            series=[Series("utilisation", utilisation)],
            low=0,
            high=100,
        ),
        Chart(
            key="power",
            title="GPU power",
            how=f"last hour, {every}: sum of GPUs",
            unit="W",
            series=[Series("power", power)],
            thresholds=[(sum(limits), f"limit {sum(limits):g} W")] if limits else [],
            low=0,
            least_span=100,
        ),
        Chart(
            key="interval",
            title="heartbeat interval",
            how=f"last hour, {every}: mean time between beats, at most one beat a "
            "configured interval counted",
            unit="s",
            series=[Series("interval", cadence)],
            thresholds=[
                (beat.interval, f"configured {beat.interval:g} s"),
                (beat.stale_after, f"stale after {beat.stale_after:g} s"),
            ]
            if beat is not None
            else [],
            low=0,
            least_span=2,
            digits=1,
        ),
    ]
    nows = {
        "score": now_text(figures.score if figures else None, ""),
        "hottest": now_text(figures.hottest if figures else None, "°C"),
        "utilisation": now_text(figures.utilisation if figures else None, "%"),
        "power": now_text(figures.power if figures else None, "W"),
        "interval": (f"configured {beat.interval:g} s", None) if beat is not None else ("", None),
    }
    start = now - HOUR
    return "".join(
        charts.render(
            dataclasses.replace(chart, now=nows[chart.key][0], now_value=nows[chart.key][1]),
            start,
            now,
        )
        for chart in made
    )


def fleet_charts(
    history: FleetHistory, now: float, interval: float, day: bool, held_note: str
) -> str:
    """The fleet's nodes by state, its GPUs' mean utilisation and power and heartbeats a
    second, over the last hour (or day); ``held_note`` says which nodes the GPU figures
    cover."""
    span = DAY if day else HOUR
    since = now - span
    what = "last day" if day else "last hour"
    every = per_point(interval)
    power = history.series("GPU power W", since)
    unit = "W"
    if power and max(value for _, value in power) >= KILO:
        power, unit = [(ts, value / 1000) for ts, value in power], "kW"
    made = [
        Chart(
            key="states",
            title="nodes by state",
            how=f"{what}, {every}: every node of the fleet",
            unit="",
            series=[Series(group, history.series(group, since)) for group in STATE_GROUPS],
            low=0,
            least_span=4,
        ),
        Chart(
            key="fleet-utilisation",
            title="GPU utilisation",
            how=f"{what}, {every}: mean of the GPUs {held_note}",
            unit="%",
            series=[Series("utilisation", history.series("GPU utilisation %", since))],
            low=0,
            high=100,
        ),
        Chart(
            key="fleet-power",
            title="GPU power",
            how=f"{what}, {every}: sum of the GPUs {held_note}",
            unit=unit,
            series=[Series("power", power)],
            low=0,
            least_span=1 if unit == "kW" else 100,
            digits=1 if unit == "kW" else 0,
        ),
        Chart(
            key="beats",
            title="heartbeats",
            how=f"{what}, {every}: a second, {held_note}",
            unit="/s",
            series=[Series("heartbeats", history.series("heartbeats /s", since))],
            low=0,
            least_span=1,
            digits=1,
        ),
    ]
    return "".join(charts.render(chart, since, now) for chart in made)
