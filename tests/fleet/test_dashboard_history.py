"""The dashboard's history ring: what a point keeps, how the ring wraps, what is forgotten."""

from __future__ import annotations

import math

import msgspec

from actors.fleet.views.dashboard.fleet_history import GpuTotals, Kept, Share
from actors.fleet.views.dashboard.history import BLOCK_ROWS, SERIES, SHARE, History, Packing
from schemas.events import Health
from schemas.messages import Heartbeat
from tests.fleet.test_lean_state import SIM_BEAT


def beat(seq: int, ts: float, **gpu: float) -> Heartbeat:
    """The simulated 8-GPU heartbeat at ``seq``/``ts``, every GPU with ``gpu``'s figures."""
    sample = SIM_BEAT.sample
    assert sample is not None
    gpus = [msgspec.structs.replace(one, **gpu) for one in sample.gpus]
    health = Health(ts=ts, status="healthy", score=87)
    return msgspec.structs.replace(
        SIM_BEAT, seq=seq, ts=ts, health=health, sample=msgspec.structs.replace(sample, gpus=gpus)
    )


def test_a_point_keeps_each_figure_at_its_sources_precision() -> None:
    """Score, hottest °C, mean %, total W exactly as NVML's whole units give them; the
    interval seen since the last point in tenths of a second."""
    history = History(4)
    figures = {"temperature_c": 71.0, "utilization_pct": 93, "power_w": 699.6}
    history.begin(100.0)
    history.put("n1", beat(10, 1000.0, **figures))
    history.begin(130.0)
    history.put("n1", beat(20, 1030.0, **figures))
    score, hottest, utilisation, power, interval = history.series("n1")
    assert score == [(100.0, 87.0), (130.0, 87.0)]
    assert hottest == [(100.0, 71.0), (130.0, 71.0)]
    assert utilisation == [(100.0, 93.0), (130.0, 93.0)]
    assert power == [(100.0, 5597.0), (130.0, 5597.0)]  # 8 GPUs at 699.6 W, to the watt
    assert interval == [(130.0, 3.0)]  # 30 s over 10 seqs; the first point has none


def test_the_ring_keeps_the_last_points_oldest_first() -> None:
    """With 3 points and 5 rounds the first two are gone; a round whose heartbeat could
    not be read (blank) is a gap in its series, not a repeat of the point before."""
    history = History(3)
    for round_ in range(5):
        history.begin(float(round_))
        if round_ == 3:
            history.blank("n1")
        else:
            history.put("n1", beat(round_ + 1, 10.0 * round_, temperature_c=60.0 + round_))
    hottest = history.series("n1")[SERIES.index("hottest GPU °C")]
    assert hottest == [(2.0, 62.0), (4.0, 64.0)]


def test_figures_out_of_range_are_clamped_and_unsaid_ones_missing() -> None:
    """Above the top is kept as the top, below zero as zero, NaN and None as not said."""
    watts = Packing(16, 1.0)
    assert watts.pack(1e300) == watts.pack(math.inf) == 65_534
    assert watts.pack(-5.0) == 0
    assert watts.pack(math.nan) == watts.pack(None) == watts.missing
    assert watts.unpack(watts.missing) is None
    history = History(2)
    quiet = msgspec.structs.replace(SIM_BEAT, health=None, sample=None)
    history.begin(1.0)
    history.put("n1", quiet)
    assert history.series("n1") == [[] for _ in SERIES]


def test_a_restarted_agent_has_no_interval_until_its_seq_grows() -> None:
    """A seq lower than the last point's (a restart) gives no interval, not a negative."""
    history = History(3)
    history.begin(1.0)
    history.put("n1", beat(500, 100.0))
    history.begin(2.0)
    history.put("n1", beat(1, 101.0))
    history.begin(3.0)
    history.put("n1", beat(3, 105.0))
    assert history.series("n1")[SERIES.index("heartbeat interval s")] == [(3.0, 2.0)]


def test_nodes_no_longer_held_are_forgotten() -> None:
    """keep_only drops the others' rings; an unknown node has empty series."""
    history = History(2)
    history.begin(1.0)
    for node in ("n1", "n2"):
        history.put(node, beat(1, 1.0))
    history.keep_only({"n2"})
    assert history.series("n1") == [[] for _ in SERIES]
    assert history.series("n2")[0] == [(1.0, 87.0)]
    assert list(history.nodes) == ["n2"]


def test_a_node_costs_its_ring_and_no_more() -> None:
    """60 points: the (ts, seq), the heartbeat's share of the totals (12 bytes), the
    round of its last point written (9 bytes) and 60 points of 7 bytes, a row of a block
    shared with other nodes; a forgotten node's row is the next node's, and the blocks go
    with the last node."""
    history = History(60)
    history.begin(1.0)
    history.put("n1", beat(1, 1.0))
    assert history.bytes_per_node() == 16 + 12 + 9 + 60 * 7
    nodes = [f"n{index}" for index in range(BLOCK_ROWS + 1)]
    history.begin(2.0)
    for node in nodes:
        history.put(node, beat(2, 2.0))
    assert len(history._blocks) == 2
    freed = history.nodes["n0"]
    history.keep_only(set(nodes[1:]))
    history.put("new", beat(7, 2.0))
    assert len(history._blocks) == 2 and history.nodes["new"] == freed
    assert history.series("new")[0] == [(2.0, 87.0)]
    assert history.series(nodes[-1])[0] == [(2.0, 87.0)]
    history.keep_only(set())
    assert history._blocks == [] and history.bytes_per_node() == 0


def test_a_node_that_sent_nothing_since_repeats_its_point_untouched() -> None:
    """A round that does not touch the node repeats its last point without an interval,
    and its heartbeat's share stays in the totals, as a decode of it would give; once it
    beats again (a new seq) it is put, not repeated."""
    history = History(4)
    figures = {"temperature_c": 71.0, "utilization_pct": 50, "power_w": 300.0}
    history.begin(100.0)
    history.put("n1", beat(10, 1000.0, **figures))
    history.begin(130.0)
    history.put("n1", beat(20, 1030.0, **figures))
    history.begin(160.0)
    assert history.current("n1", 20)
    assert history.kept.totals(0) == GpuTotals(
        nodes=1, gpus=8, utilisation=400.0, reporting=8, power=2400.0, beats=0
    )
    _, hottest, _, power, interval = history.series("n1")
    assert hottest == [(100.0, 71.0), (130.0, 71.0), (160.0, 71.0)]
    assert power == [(100.0, 2400.0), (130.0, 2400.0), (160.0, 2400.0)]
    assert [when for when, _ in interval] == [130.0]
    assert not history.current("n1", 21) and not history.current("n2", 1)
    history.begin(190.0)
    assert history.put("n1", beat(22, 1090.0, temperature_c=80.0)) == 2
    assert history.series("n1")[1][-2:] == [(160.0, 71.0), (190.0, 80.0)]


def test_a_node_untouched_longer_than_the_ring_repeats_in_every_slot() -> None:
    """Rounds beyond the ring's length that never touched a node leave its last point in
    every slot (the page draws the flat line it drew), read or next put."""
    history = History(3)
    history.begin(1.0)
    history.put("n1", beat(5, 1.0, temperature_c=66.0))
    for round_ in range(2, 9):
        history.begin(float(round_))
    assert history.series("n1")[1] == [(6.0, 66.0), (7.0, 66.0), (8.0, 66.0)]
    history.begin(9.0)
    history.blank("n1")
    history.begin(10.0)
    assert history.series("n1")[1] == [(8.0, 66.0)]
    assert history.kept.totals(0).nodes == 0


def test_the_kept_totals_come_back_exactly_after_any_changes() -> None:
    """Shares added and taken in any order leave no drift: the sums are exact."""
    kept = Kept()
    shares = [Share(8, 8, 0.1 * i, 700.3 + i / 3) for i in range(1000)]
    stored = [Share(*SHARE.unpack(SHARE.pack(*share))) for share in shares]
    for share in stored:
        kept.add(share)
    for share in reversed(stored[1:]):
        kept.take(share)
    assert kept.totals(0) == GpuTotals(
        nodes=1, gpus=8, utilisation=stored[0].utilisation, reporting=8, power=stored[0].power
    )


def test_immediate_beats_do_not_shorten_the_interval() -> None:
    """A node beating every 2 s that also beat at once after two health changes shows 2 s
    (the configured cadence), not 60 s over 32 beats; a node that missed beats shows the
    longer interval it kept."""
    history = History(3)
    cadence = {"interval": 2.0}
    history.begin(1.0)
    history.put("n1", msgspec.structs.replace(beat(100, 1000.0), **cadence))
    history.begin(2.0)
    history.put("n1", msgspec.structs.replace(beat(132, 1060.0), **cadence))
    history.begin(3.0)
    history.put("n1", msgspec.structs.replace(beat(152, 1120.0), **cadence))
    intervals = history.series("n1")[SERIES.index("heartbeat interval s")]
    assert intervals == [(2.0, 2.0), (3.0, 3.0)]
