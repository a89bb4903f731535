"""Whether a workload is ready: its ``/health`` answers 200 and its ``/v1/models`` names
the model it was deployed with (by path, or by file name: engines list either)."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp


async def readiness(session: aiohttp.ClientSession, port: int, model: str) -> str:
    """``ready``, or what the endpoints say while loading ("" while nothing answers)."""
    base = f"http://127.0.0.1:{port}"
    try:
        async with session.get(f"{base}/health") as response:
            if response.status != 200:
                return f"/health: HTTP {response.status}"
        async with session.get(f"{base}/v1/models") as response:
            if response.status != 200:
                return f"/v1/models: HTTP {response.status}"
            body = json.loads(await response.text())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return ""
    try:
        ids = [str(item["id"]) for item in body["data"]]
    except (KeyError, TypeError):
        return "/v1/models: not an OpenAI model list"
    if not model and ids:
        return "ready"
    if any(served == model or Path(served).name == Path(model).name for served in ids):
        return "ready"
    return f"/v1/models does not name {model}"
