"""``node-agent status``: the local agent's HTTP status read and drawn as text, with the
standard library alone (its HTTP client and json: no asyncio, msgspec or aiohttp), so it
answers at once (tests/bench/bench_startup.py). The agent's settings are read only
without ``--url``, to find the port the agent wrote in its state dir.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from actors.cli.parsing import fail
from schemas.errors import FleetError

DEFAULT_STATUS_URL = "http://127.0.0.1:9091"


def status_url(args: argparse.Namespace) -> str:
    """--url, else the port the agent wrote to its state dir, else the default port."""
    if args.url:
        return str(args.url).rstrip("/")
    from actors.node.config import ENV_PREFIX, HTTP_PORT_FILE, AgentConfig  # without --url only
    from actors.runtime.config import build

    state_dir = args.state_dir or Path(build(AgentConfig, ENV_PREFIX, file=args.config).state_dir)
    try:
        port = int((state_dir / HTTP_PORT_FILE).read_text())
    except FileNotFoundError:
        if args.state_dir:
            raise FleetError(
                f"no agent serves HTTP from {state_dir} (no {HTTP_PORT_FILE} there)"
            ) from None
        return DEFAULT_STATUS_URL
    except (OSError, ValueError) as exc:
        raise FleetError(f"cannot read {state_dir / HTTP_PORT_FILE}: {exc}") from None
    return f"http://127.0.0.1:{port}"


MAX_STATUS_BYTES = 4 * 1024 * 1024
"""The most of an answer ``node-agent status`` reads (an agent's is a few KB)."""


def get_status(url: str, timeout: float) -> tuple[int, bytes]:
    """GET ``url`` (no proxy: the agent is local), each socket operation bounded by
    ``timeout``, with the standard library's client (it starts in a tenth of aiohttp's
    time): the HTTP status and the body. Raises urllib's errors, or FleetError for an
    answer too large."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as response:
        status: int = response.status
        body: bytes = response.read(MAX_STATUS_BYTES + 1)
    if len(body) > MAX_STATUS_BYTES:
        raise FleetError(f"{url} answered more than {MAX_STATUS_BYTES} bytes")
    return status, body


def within(url: str, timeout: float) -> tuple[int, bytes]:
    """:func:`get_status` bounded by ``timeout`` in all, not only per socket operation: it
    runs in a daemon thread, so an agent answering a byte at a time cannot hold the
    command past it (TimeoutError)."""
    done: list[tuple[int, bytes] | BaseException] = []

    def fetch() -> None:
        try:
            done.append(get_status(url, timeout))
        except BaseException as exc:  # handed to the caller's thread
            done.append(exc)

    worker = threading.Thread(target=fetch, name="status", daemon=True)
    worker.start()
    worker.join(timeout)
    if not done:
        raise TimeoutError
    if isinstance(done[0], BaseException):
        raise done[0]
    return done[0]


def main(args: argparse.Namespace) -> int:
    """``node-agent status``; a known error is one line on stderr and exit 1."""
    try:
        return cmd_status(args)
    except FleetError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return 130


def cmd_status(args: argparse.Namespace) -> int:
    args.url = status_url(args)
    url = f"{args.url}/status"
    late = f"the agent at {args.url} did not answer within {args.timeout:g}s"
    try:
        code, body = within(url, args.timeout)
    except urllib.error.HTTPError as exc:
        code, body = exc.code, b""
    except TimeoutError:
        return fail(late)
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            return fail(late)
        reason = exc.reason if isinstance(exc.reason, str) else type(exc.reason).__name__
        return fail(f"cannot reach the agent at {args.url} ({reason}); is it running?")
    except (OSError, ValueError) as exc:
        return fail(f"cannot reach the agent at {args.url} ({exc}); is it running?")
    if code != 200:
        return fail(f"{url} answered HTTP {code}")
    try:
        status = json.loads(body)
    except ValueError:
        return fail(f"{url} did not answer JSON")
    if not isinstance(status, dict):
        return fail(f"{url} did not answer a JSON object")
    sys.stdout.write(body.decode() + "\n" if args.json else render_status(status))
    return 0


def render_status(status: dict[str, Any]) -> str:
    """The /status document as a few aligned lines for a terminal."""
    lines = [
        f"node      {status.get('node')} (cluster {status.get('cluster')}), "
        f"agent {status.get('agent_version')}, up {status.get('uptime_s', 0):.0f}s",
        f"state     {status.get('schedulability')}"
        + (f" ({status['schedulability_reason']})" if status.get("schedulability_reason") else ""),
        f"seq       {status.get('seq')}",
    ]
    if status.get("refused"):
        lines.append(f"REFUSED   {status['refused']}")
    health = status.get("health")
    if health:
        lines.append(f"health    {health['status']} {health['score']}/100")
        lines += _aligned(
            [p["name"], f"{p['points']}/{p['max_points']}", p["reason"]]
            for p in health.get("components", [])
        )
        lines += _aligned(
            [f"check {c['name']}", c["status"], c["reason"]] for c in health.get("checks", [])
        )
    else:
        lines.append("health    (not reported yet)")
    lines += _gpu_lines(status)
    engine = status.get("engine")
    if engine and engine.get("engines"):
        lines.append(f"engines   in flight {_n(engine.get('in_flight'))}")
        rows = []
        for item in engine["engines"]:
            state = "UNHEALTHY"
            if item["healthy"]:
                running, waiting = _n(item.get("in_flight")), _n(item.get("waiting"))
                state = f"healthy, running {running} waiting {waiting}"
            reason = f" - {item['reason']}" if item.get("reason") else ""
            rows.append([item["kind"], item["url"], state + reason])
        lines += _aligned(rows)
    else:
        lines.append("engines   none")
    latency = status.get("latency")
    if latency:
        lines.append(
            f"latency   nats {_us(latency.get('gateway_rtt_us'))}, "
            f"peers avg {_us(latency.get('avg_peer_rtt_us'))}, loss {latency.get('loss_pct')}%"
        )
        lines += _aligned(
            [peer["target_node_id"], _us(peer.get("rtt_us")), f"loss {peer['loss_pct']}%"]
            for peer in latency.get("peers", [])
        )
    else:
        lines.append("latency   (not measured yet)")
    scheduler = status.get("scheduler")
    if scheduler:
        if scheduler.get("reachable"):
            jobs = scheduler.get("jobs", {})
            reason = f" ({scheduler['state_reason']})" if scheduler.get("state_reason") else ""
            lines.append(
                f"slurm     {scheduler.get('node_name')} {scheduler.get('slurm_state')}{reason}, "
                f"running {_n(jobs.get('running_count'))} pending {_n(jobs.get('pending_count'))}"
            )
        else:
            lines.append(f"slurm     not answering: {scheduler.get('reason')}")
    workloads = status.get("workloads") or []
    lines.append(f"workloads {len(workloads) or 'none'}")
    lines += _aligned(
        [
            item["name"],
            item["state"] + (f" ({item['reason']})" if item.get("reason") else ""),
            f"{item['engine']} {item.get('model') or ''}".strip(),
            "gpus " + (",".join(map(str, item.get("gpus", []))) or "-"),
            f"port {item['port']}",
            f"restarts {item.get('restarts', 0)}",
            "placed" if item.get("placed") else "",
        ]
        for item in workloads
    )
    lines.append("actors")
    lines += _aligned(
        [
            name,
            actor["phase"],
            f"restarts {actor['restarts']}",
            f"last error: {actor['last_error']}" if actor.get("last_error") else "",
        ]
        for name, actor in status.get("actors", {}).items()
    )
    return "\n".join(lines) + "\n"


def _gpu_lines(status: dict[str, Any]) -> list[str]:
    """The GPUs of /status: a count and source, a row each (temperature, utilization,
    memory, lost), and the passthrough ones (vfio-pci) on a line of their own."""
    source = status.get("gpu_source")
    if source is None:
        return ["gpus      (not sampled yet)"]
    gpus = status.get("gpus") or []
    lines = [f"gpus      {len(gpus) or 'none'}" + (f" ({source})" if gpus else "")]
    lines += _aligned(
        [
            str(gpu["index"]),
            gpu["name"],
            "-" if gpu.get("temperature_c") is None else f"{gpu['temperature_c']:.0f}C",
            "-" if gpu.get("utilization_pct") is None else f"{gpu['utilization_pct']:.0f}%",
            f"{gpu['memory_used'] / 2**30:.1f}/{gpu['memory_total'] / 2**30:.1f} GiB",
            "LOST" if gpu.get("lost") else "",
        ]
        for gpu in gpus
    )
    passthrough = status.get("passthrough_gpus") or []
    if passthrough:
        named = ", ".join(
            f"{gpu['pci_bus_id']} {gpu['name'] or gpu['device_id']}" for gpu in passthrough
        )
        lines.append(f"passthrough {len(passthrough)} bound to vfio-pci (for VMs): {named}")
    return lines


def _aligned(rows: Iterable[list[str]]) -> list[str]:
    """Rows as indented lines whose columns line up, each as wide as its widest cell
    (names such as ``probe_freshness`` outgrow any fixed width)."""
    table = [[str(cell) for cell in row] for row in rows]
    if not table:
        return []
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    return [
        "  "
        + "  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]]).rstrip()
        for row in table
    ]


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def _us(value: int | None) -> str:
    return "-" if value is None else f"{value / 1000:.2f}ms"
