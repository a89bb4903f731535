"""deploy/prometheus/ against the real programs: promtool checks and unit-tests the rules,
and a real Prometheus scraping an agent and an aggregator fires FleetNodeStale for a
node whose agent was SIGKILLed."""

from __future__ import annotations

import signal
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage.registry import approve
from schemas import signing
from schemas.subjects import Subjects
from tests.support.fleet import Fleet, new_aggregator, new_fleet_api, wait_for, wait_record
from tests.support.observability import (
    PROMETHEUS,
    agent_process,
    program,
    running,
    wait_ready,
)
from tests.support.ports import free_port

DEPLOY = Path(__file__).parents[2] / "deploy" / "prometheus"


def check(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=DEPLOY)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_rules_config_and_alertmanager_example_pass_the_programs_own_checks() -> None:
    """promtool checks the rules and the scrape config and runs the rules' unit tests;
    amtool checks the Alertmanager example."""
    promtool = program("promtool")
    assert "SUCCESS" in check(promtool, "check", "rules", "rules.yml")
    assert "SUCCESS" in check(promtool, "test", "rules", "rules_test.yml")
    assert "SUCCESS" in check(promtool, "check", "config", "prometheus.yml")
    amtool = program("amtool")
    assert "SUCCESS" in check(amtool, "check-config", "alertmanager.yml")


async def query(url: str, path: str, **params: str) -> Any:
    async with aiohttp.ClientSession() as session:
        async with session.get(
            f"{url}{path}", params=params, timeout=aiohttp.ClientTimeout(total=5)
        ) as answer:
            body = await answer.json()
            assert body["status"] == "success", body
            return body["data"]


async def test_prometheus_fires_stale_for_a_sigkilled_agent(fleet: Fleet, tmp_path: Path) -> None:
    """A real Prometheus scrapes an agent (its process and build series too) and an
    aggregator with the shipped rules; SIGKILL of the agent fires FleetNodeStale for that
    node."""
    binary = program(PROMETHEUS)
    aggregator = new_aggregator(fleet.bus, fleet.prefix)
    metrics = aggregator.metrics
    assert isinstance(metrics, AggregatorMetrics)
    api = new_fleet_api(fleet.bus, fleet.prefix, metrics, live=aggregator.view)
    await fleet.start_supervisor(aggregator, api)
    node = fleet.config("n1")
    key = signing.load_or_create_key_file(node.key_path)
    await approve(fleet.bus, Subjects(fleet.prefix), node.node_id, key.public_key)
    port_file = Path(node.state_dir) / "http.port"
    with agent_process(node, tmp_path / "agent.log") as agent:
        await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active", 30)
        await wait_for(port_file.exists)
        agent_port = int(port_file.read_text())
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: [{DEPLOY / 'rules.yml'}]\n"
            "scrape_configs:\n"
            f"  - job_name: fleet-aggregator\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{api.port}']}}]\n"
            f"  - job_name: node-agent\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{agent_port}']}}]\n"
        )
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        with running(argv, tmp_path / "prometheus.log"):
            await wait_ready(f"{url}/-/ready")

            async def scraped(expr: str) -> list[Any]:
                found: list[Any] = (await query(url, "/api/v1/query", query=expr))["result"]
                return found

            for expr in (
                'node_agent_build_info{job="node-agent"}',
                'process_cpu_seconds_total{job="node-agent"}',
                'node_agent_node_info{node="n1",cluster="c1"}',
                'fleet_aggregator_build_info{job="fleet-aggregator"}',
                'fleet_node_state{node="n1",state="active"}',
            ):
                await wait_for(partial(scraped, expr), interval=0.5)
            agent.send_signal(signal.SIGKILL)
            agent.wait(10)

            async def firing() -> list[dict[str, Any]]:
                alerts = (await query(url, "/api/v1/alerts"))["alerts"]
                return [
                    alert
                    for alert in alerts
                    if alert["labels"]["alertname"] == "FleetNodeStale"
                    and alert["state"] == "firing"
                ]

            (alert,) = await wait_for(firing, interval=0.5)
            assert alert["labels"]["node"] == "n1" and alert["labels"]["severity"] == "warning"
