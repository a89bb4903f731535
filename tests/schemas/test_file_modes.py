"""One mode check for the files that give a program its identity or its orders: a key
others may read or write, a steering file others may write; warned once per mode."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from schemas.file_modes import warn_if_exposed


@pytest.mark.parametrize(
    ("mode", "key", "steering"),
    [
        (0o600, False, False),
        (0o644, True, False),
        (0o640, True, False),
        (0o620, True, True),
        (0o602, True, True),
        (0o666, True, True),
        (0o400, False, False),
    ],
)
def test_which_modes_expose_which_file(
    tmp_path: Path, mode: int, key: bool, steering: bool
) -> None:
    """A key is exposed by any right of group or others; a steering file by their write."""
    path = tmp_path / f"file-{mode:o}"
    path.write_text("x")
    path.chmod(mode)
    assert warn_if_exposed(path, "key") is key
    assert warn_if_exposed(path, "steering") is steering


def test_warned_once_per_mode(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file read again and again (a trust file, at every registration) is warned about
    once, and again after a chmod that still exposes it; the warning names file and mode."""
    path = tmp_path / "trusted"
    path.write_text("U...\n")
    path.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="schemas.file_modes"):
        for _ in range(3):
            assert warn_if_exposed(path, "steering")
        path.chmod(0o620)
        assert warn_if_exposed(path, "steering")
    assert [(r.path, r.mode) for r in caplog.records] == [  # type: ignore[attr-defined]
        (str(path), "0666"),
        (str(path), "0620"),
    ]
    assert str(path) in caplog.records[0].getMessage()


def test_a_missing_file_is_left_to_its_reader(tmp_path: Path) -> None:
    """No stat, no warning: the read that follows reports the missing file."""
    assert warn_if_exposed(tmp_path / "absent", "key") is False
