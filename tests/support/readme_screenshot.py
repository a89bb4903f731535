"""The README's screenshot of the dashboard, made from ``fleetctl up`` as shipped.

Runs ``fleetctl up`` (3 agents, 8 simulated GPUs each) in a temporary store, waits for
its nodes to be active and the fleet's charts to have a point, makes GPU 0 of node-1 hot
with ``node-agent inject temp 97`` (signed with the store's operator key), waits for the
page to show node-1 degraded without a reload, and saves the first screen to
``docs/images/dashboard.png`` (or ``--out``). Needs Debian's ``chromium`` and the
``playwright`` package (the test extra). Regenerate with::

    python -m tests.support.readme_screenshot

``tests/system/test_readme_screenshot.py`` runs it into a temporary file.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tests.support.dashboard import chromium_at, chromium_or_exit

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "images" / "dashboard.png"
WIDTH, HEIGHT = 1400, 1000
"""The first screen the screenshot shows."""
HANG = 120.0
"""Seconds any one wait may take before the script gives up (a hang, not a target)."""


def banner(process: subprocess.Popen[str]) -> dict[str, str]:
    """The ``name: value`` lines ``fleetctl up`` prints until it says how to stop."""
    found: dict[str, str] = {}
    assert process.stdout is not None
    for line in process.stdout:
        name, sep, value = line.partition(": ")
        if sep:
            found[name.strip()] = value.strip()
        if line.startswith("Ctrl-C to stop"):
            return found
    raise SystemExit(f"error: fleetctl up stopped before it was ready: {found}")


async def shoot(url: str, server: str, key: Path, out: Path) -> str:
    """Screenshot the first screen once node-1 shows degraded; the page's headline."""
    async with chromium_at(chromium_or_exit()) as browser:
        page = await browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        await page.goto(url)
        hang = HANG * 1000
        await page.wait_for_function(
            "document.querySelectorAll('#rows tr[data-node] .badge.ok').length === 3",
            timeout=hang,
        )
        charted = "figure[data-chart=states] g.series :is(circle, polyline)"
        await page.wait_for_selector(charted, timeout=hang)
        inject = [
            *(sys.executable, "-m", "actors.cli.node_agent", "inject", "temp", "97"),
            *("--gpu", "0", "--node-id", "node-1", "--server", server),
            *("--key-file", str(key)),
        ]
        await asyncio.to_thread(
            subprocess.run, inject, check=True, capture_output=True, timeout=HANG
        )
        await page.wait_for_selector("tr[data-node='node-1'] .badge.warn", timeout=hang)
        # the counts follow the rows within one refresh of the fleet's snapshot
        await page.wait_for_selector(".headline:has-text('needs a person:')", timeout=hang)
        await page.wait_for_selector("#live.on", timeout=hang)
        out.parent.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(out))
        return str(await page.inner_text(".headline"))


def make(out: Path) -> str:
    """Run ``fleetctl up``, make the screenshot at ``out``, stop the fleet; the headline
    the page showed."""
    with tempfile.TemporaryDirectory() as store:
        command = [sys.executable, "-m", "actors.cli.fleetctl", "up", "--port", "0"]
        process = subprocess.Popen(
            [*command, "--store", store],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            lines = banner(process)
            # The live table goes on being printed: read it, so fleetctl up never blocks.
            assert process.stdout is not None
            drain = threading.Thread(target=process.stdout.read, daemon=True)
            drain.start()
            url, server = lines["dashboard"], lines["NATS"]
            return asyncio.run(shoot(url, server, Path(store) / "operator.nk", out))
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to save (default {OUT})")
    args = parser.parse_args()
    headline = make(args.out)
    sys.stdout.write(f"saved {args.out} ({headline})\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
