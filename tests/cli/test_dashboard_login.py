"""``fleetctl up --allow-ui-commands`` and ``fleetctl dashboard``: the banner's dashboard
line is a one-time login link, ``fleetctl dashboard`` prints more, each works once, and
without one the dashboard answers nothing but 401."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from actors.cli.fleetctl.up import UpOptions, dashboard_lines
from schemas import signing
from tests.support.dashboard import client
from tests.support.fleet import wait_for


async def fleetctl(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    """Run ``fleetctl ARGS`` to its end: exit status, stdout, stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "actors.cli.fleetctl", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def node_page(session: Any, url: str) -> str | None:
    """node-1's page for a logged-in ``session``; None while the dashboard knows no such
    node (404)."""
    async with session.get(url + "/ui/nodes/node-1") as page:
        if page.status == 404:
            return None
        assert page.status == 200, page.status
        text: str = await page.text()
        return text


async def test_up_prints_a_one_time_link_and_dashboard_another(tmp_path: Path) -> None:
    """The banner's link logs a client in once (a second use is 403); the dashboard
    without a login is 401; ``fleetctl dashboard`` with the printed URL and the
    operator key prints a link that works as well; a URL without a scheme is one line."""
    up = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "actors.cli.fleetctl",
        "up", "--allow-ui-commands", "--nodes", "1", "--port", "0",
        "--store", str(tmp_path), "--gpus-per-node", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert up.stdout is not None
    banner: list[str] = []
    try:
        while not banner or not banner[-1].startswith("Ctrl-C"):
            read = await asyncio.wait_for(up.stdout.readline(), timeout=60)
            assert read and len(banner) < 20, "".join(banner)
            banner.append(read.decode())
        (line,) = [line for line in banner if line.startswith("dashboard: ")]
        first = line.removeprefix("dashboard: ").strip()
        url = first.split("/ui/login?t=")[0]
        assert f"another: fleetctl dashboard --url {url})\n" in "".join(banner)
        env = {**os.environ, "FLEETCTL_KEY_FILE": str(tmp_path / "operator.nk")}
        status, out, err = await fleetctl("dashboard", "--url", url, env=env)
        assert status == 0, err
        second = out.strip()
        assert second.startswith(f"{url}/ui/login?t=") and second != first
        for link in (first, second):
            async with client() as session:
                async with session.get(url + "/") as anonymous:
                    assert anonymous.status == 401
                async with session.get(link) as page:
                    assert page.status == 200 and "GPU fleet" in await page.text()
                # The banner comes as the node starts: its page is there once the
                # dashboard has heard of it (its approval or first heartbeat).
                assert 'value="cordon"' in await wait_for(lambda: node_page(session, url))
            async with client() as session, session.get(link) as again:
                assert again.status == 403
        status, _, err = await fleetctl("dashboard", "--url", "127.0.0.1:9092", env=env)
        assert status == 1 and err.count("\n") == 1 and "--url" in err
        up.send_signal(signal.SIGINT)
        await asyncio.wait_for(up.communicate(), timeout=30)
    finally:
        if up.returncode is None:
            up.kill()
            await up.wait()
    assert up.returncode == 0


def test_a_read_only_banner_names_the_page() -> None:
    """Without --allow-ui-commands the banner's dashboard line is the page's URL, as before."""
    options = UpOptions(store=Path("/nonexistent"))
    line = dashboard_lines(9092, signing.KeyPair.generate(), options)
    assert line == "dashboard: http://127.0.0.1:9092/\n"
