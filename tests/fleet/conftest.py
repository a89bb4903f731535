"""Fixtures of the fleet's tests beyond the shared ones: a headless browser."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.support.dashboard import launched_browser


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    """Headless Chromium, or a skip saying why there is none."""
    async with launched_browser() as launched:
        yield launched
