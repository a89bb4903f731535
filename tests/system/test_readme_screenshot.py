"""The README's screenshot is made from ``fleetctl up`` as shipped, by the documented
command (``python -m tests.support.readme_screenshot``), here into a temporary file."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.readme_screenshot import HEIGHT, ROOT, WIDTH


def test_the_readme_screenshot_is_made_from_fleetctl_up(tmp_path: Path) -> None:
    """The command runs fleetctl up, makes a GPU hot, and saves the first screen as a PNG
    once the page shows that node degraded (what the README's caption says)."""
    if shutil.which("chromium") is None:
        pytest.skip("chromium is not installed (Debian package chromium; .ci/run installs it)")
    out = tmp_path / "dashboard.png"
    made = subprocess.run(
        [sys.executable, "-m", "tests.support.readme_screenshot", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert made.returncode == 0, made.stderr
    assert "(1 node needs a person: 1 degraded)" in made.stdout
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (WIDTH, HEIGHT)
