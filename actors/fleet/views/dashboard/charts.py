"""The dashboard's charts: server-rendered SVG with a time axis (clock labels, UTC), a
value axis with its unit, threshold lines where a limit exists, one line per series and
the data the page's script reads for the hover readout (``data-times`` on the figure,
``data-values`` on each line). No library: a chart is a few dozen elements.

The value axis never stretches a small change to full height: a chart has a fixed range
(percent, the health score) or a least span (°C, W), and its thresholds are always in
range. A gap in the points (a minute the node did not report) breaks the line."""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from actors.runtime.spans import clock

WIDTH, HEIGHT = 330, 130
LEFT, RIGHT, TOP, BOTTOM = 52, 8, 8, 22
"""The plot's margins inside the SVG: value labels on the left, time labels below."""
TIME_STEPS = (60, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
"""Seconds between time labels, the first giving at most five labels on the axis."""
EDGE = 14
"""A time label this close to the plot's right end is left out (it would be cut)."""
MAX_DRAWN = 360
"""Points drawn per line at most: a longer series is thinned to every n-th point."""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


@dataclass(frozen=True)
class Series:
    """One line: its name (the legend and the readout) and its (time, value) points."""

    name: str
    points: Sequence[tuple[float, float]]


@dataclass(frozen=True)
class Chart:
    """What one chart shows and how its value axis is drawn."""

    key: str
    """Names the chart in the page (``data-chart``)."""
    title: str
    """What it shows, e.g. ``hottest GPU``."""
    how: str
    """How a point is made, e.g. ``last hour, per minute: max of GPUs``."""
    unit: str
    series: Sequence[Series]
    thresholds: Sequence[tuple[float, str]] = ()
    """(value, label) of each limit drawn as a dashed line."""
    low: float | None = None
    """A fixed bottom of the value axis (else from the values)."""
    high: float | None = None
    """A fixed top of the value axis (else from the values)."""
    least_span: float = 1.0
    """The value axis covers at least this much, so noise is not drawn as a cliff."""
    digits: int = 0
    now: str = ""
    """The value now and where it comes from, e.g. ``97 °C, live heartbeat 2s ago``."""
    now_value: float | None = None
    extra: dict[str, str] = field(default_factory=dict)
    """More ``data-`` attributes of the figure (tests and scripts read them)."""


def nice_step(span: float, ticks: int = 4) -> float:
    """A step of 1, 2 or 5 times a power of ten giving about ``ticks`` steps over ``span``."""
    raw = max(span, 1e-9) / ticks
    power = 10.0 ** math.floor(math.log10(raw))
    return next(step * power for step in (1.0, 2.0, 5.0, 10.0) if step * power >= raw)


def value_range(chart: Chart) -> tuple[float, float, float]:
    """(bottom, top, tick step) of the value axis: the values and thresholds in range,
    the chart's fixed ends kept, at least ``least_span`` wide, rounded out to ticks."""
    values = [value for series in chart.series for _, value in series.points]
    values += [value for value, _ in chart.thresholds]
    if chart.now_value is not None:
        values.append(chart.now_value)
    low = chart.low if chart.low is not None else min(values, default=0.0)
    high = chart.high if chart.high is not None else max(values, default=chart.least_span)
    if high - low < chart.least_span:
        middle = (high + low) / 2
        low, high = middle - chart.least_span / 2, middle + chart.least_span / 2
        if chart.low is not None and low < chart.low:
            low, high = chart.low, chart.low + chart.least_span
        if low < 0 <= min(values, default=0.0):
            low, high = 0.0, high - low
    step = nice_step(high - low)
    bottom = chart.low if chart.low is not None else math.floor(low / step) * step
    top = chart.high if chart.high is not None else math.ceil(high / step) * step
    return bottom, max(top, bottom + step), step


def render(chart: Chart, start: float, end: float) -> str:
    """The chart as a ``<figure>``: caption (title, how, now), the SVG, a readout line."""
    bottom, top, step = value_range(chart)
    x0, x1, y0, y1 = LEFT, WIDTH - RIGHT, TOP, HEIGHT - BOTTOM

    def x(ts: float) -> float:
        return x0 + (ts - start) / max(end - start, 1e-9) * (x1 - x0)

    def y(value: float) -> float:
        clamped = min(max(value, bottom), top)
        return y1 - (clamped - bottom) / (top - bottom) * (y1 - y0)

    parts = [f'<rect class="plot" x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}"/>']
    tick = bottom
    while tick <= top + step / 1000:
        parts.append(
            f'<line class="grid" x1="{x0}" x2="{x1}" y1="{y(tick):.1f}" y2="{y(tick):.1f}"/>'
            f'<text class="axis-y" x="{x0 - 4}" y="{y(tick) + 3:.1f}">'
            f"{esc(f'{tick:g} {chart.unit}'.strip())}</text>"
        )
        tick += step
    parts += _time_axis(start, end, x, y1)
    for value, label in chart.thresholds:
        parts.append(
            f'<line class="threshold" x1="{x0}" x2="{x1}" y1="{y(value):.1f}" '
            f'y2="{y(value):.1f}"><title>{esc(label)}</title></line>'
            f'<text class="threshold-label" x="{x1 - 2}" y="{y(value) - 2:.1f}">{esc(label)}</text>'
        )
    times = sorted({ts for series in chart.series for ts, _ in series.points})
    drawn = _thinned(times)
    gap = _gap(times)
    for number, series in enumerate(chart.series):
        values = dict(series.points)
        parts.append(_line(number, series.name, drawn, values, gap, x, y, chart.digits))
    parts.append(f'<line class="guide" x1="{x0}" x2="{x0}" y1="{y0}" y2="{y1}" data-reader/>')
    legend = ""
    if len(chart.series) > 1:
        legend = '<ul class="legend">' + "".join(
            f'<li class="s{number}">{esc(series.name)}</li>'
            for number, series in enumerate(chart.series)
        )
        legend += "</ul>"
    extra = "".join(f' data-{esc(name)}="{esc(value)}"' for name, value in chart.extra.items())
    now = f' <span class="now">now {esc(chart.now)}</span>' if chart.now else ""
    if not any(series.points for series in chart.series):
        now += ' <span class="empty">no points yet</span>'
    points = sum(len(series.points) for series in chart.series)
    now_value = "" if chart.now_value is None else f' data-now="{chart.now_value:g}"'
    return (
        f'<figure class="chart" data-chart="{esc(chart.key)}" data-points="{points}" '
        f'data-unit="{esc(chart.unit)}" data-times="{",".join(f"{t:.0f}" for t in drawn)}" '
        f'data-start="{start:.0f}" data-end="{end:.0f}" data-x0="{x0}" data-x1="{x1}"'
        f"{now_value}{extra}>"
        f"<figcaption><b>{esc(chart.title)}</b> <small>{esc(chart.how)}</small>{now}"
        f'</figcaption><svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img"><title>{esc(chart.title)}, {esc(chart.how)}</title>{"".join(parts)}</svg>'
        f'{legend}<output class="readout" data-reader></output></figure>'
    )


Scale = Callable[[float], float]


def _time_axis(start: float, end: float, x: Scale, y1: float) -> list[str]:
    step = next((s for s in TIME_STEPS if (end - start) / s <= 5), TIME_STEPS[-1])
    fmt = "%H:%M" if step < 86400 else "%m-%d"
    parts = []
    first = math.ceil(start / step) * step
    for when in range(int(first), int(end) + 1, step):
        position = x(when)
        if position > WIDTH - RIGHT - EDGE:
            continue  # its label would run off the plot
        parts.append(
            f'<line class="tick" x1="{position:.1f}" x2="{position:.1f}" y1="{y1}" '
            f'y2="{y1 + 3}"/><text class="axis-x" x="{position:.1f}" y="{y1 + 14}">'
            f"{esc(clock(when, fmt))}</text>"
        )
    parts.append(f'<text class="axis-x unit" x="{LEFT - 4}" y="{y1 + 14}">UTC</text>')
    return parts


def _thinned(times: list[float]) -> list[float]:
    every = max(1, math.ceil(len(times) / MAX_DRAWN))
    return times[::every] if every > 1 else times


def _gap(times: list[float]) -> float:
    """A step between two points longer than this is a gap (1.5 times the usual step)."""
    steps = sorted(b - a for a, b in itertools.pairwise(times))
    return 1.5 * steps[len(steps) // 2] if steps else math.inf


def _line(
    number: int,
    name: str,
    times: list[float],
    values: dict[float, float],
    gap: float,
    x: Scale,
    y: Scale,
    digits: int,
) -> str:
    """One series: polylines broken at gaps (a lone point is a dot), and its values at
    ``times`` for the readout ("" where it has none)."""
    runs: list[list[tuple[float, float]]] = []
    last: float | None = None
    for ts in times:
        if ts not in values:
            last = None
            continue
        if last is None or ts - last > gap:
            runs.append([])
        runs[-1].append((ts, values[ts]))
        last = ts
    shapes = []
    for run in runs:
        if len(run) == 1:
            ts, value = run[0]
            shapes.append(f'<circle cx="{x(ts):.1f}" cy="{y(value):.1f}" r="2"/>')
        else:
            coords = " ".join(f"{x(ts):.1f},{y(value):.1f}" for ts, value in run)
            shapes.append(f'<polyline points="{coords}"/>')
    data = ",".join(f"{values[ts]:.{digits}f}" if ts in values else "" for ts in times)
    return (
        f'<g class="series s{number}" data-name="{esc(name)}" data-values="{data}">'
        f"{''.join(shapes)}</g>"
    )
