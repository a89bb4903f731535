"""deploy/build.py's rules, without building: the lock is every bundled distribution at
its installed version, a lock that differs refuses the build, and a dependency that is
missing or at a version outside the requirement is one line, not a half-built file."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from deploy.build import BuildError, check_lock, closure, lock_lines


def test_the_lock_pins_every_installed_dependency_transitively() -> None:
    """nats-py[nkeys] brings nkeys, and aiohttp brings yarl: each at its installed version."""
    dists = closure([Requirement("nats-py[nkeys]>=2.11"), Requirement("aiohttp>=3.9")])
    lines = lock_lines(dists)
    for name in ("nats-py", "nkeys", "aiohttp", "yarl", "multidict"):
        assert f"{name}=={importlib.metadata.version(name)}" in lines
    assert lines == sorted(lines)


def test_a_lock_that_differs_refuses_the_build(tmp_path: Path) -> None:
    """One version changed: the build stops, naming both versions."""
    lines = lock_lines(closure([Requirement("msgspec")]))
    lock = tmp_path / "lock.txt"
    lock.write_text("# a comment line is ignored\n" + "\n".join(lines) + "\n")
    check_lock(lock, lines)
    lock.write_text("msgspec==0.0.1\n")
    with pytest.raises(BuildError, match=r"differs from the lock .*msgspec==0\.0\.1.*msgspec=="):
        check_lock(lock, lines)


@pytest.mark.parametrize(
    ("requirement", "says"),
    [
        ("no-such-distribution-here", "no-such-distribution-here is not installed here"),
        ("msgspec<0.1", "msgspec .* is installed; msgspec<0.1 needed"),
    ],
)
def test_a_missing_or_wrong_dependency_is_one_line(requirement: str, says: str) -> None:
    """Nothing is downloaded to make up for it: the build names what to install."""
    with pytest.raises(BuildError, match=says):
        closure([Requirement(requirement)])
