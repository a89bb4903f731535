"""Local stand-ins for the clouds' instance metadata services, answering as documented.

- AWS: "Use IMDSv2" (PUT /latest/api/token with X-aws-ec2-metadata-token-ttl-seconds; 401
  for a missing or expired token) and "Spot Instance interruption notices"
  (/latest/meta-data/spot/instance-action: 404 until a notice, then
  {"action": "terminate", "time": "2026-...Z"}; /latest/meta-data/events/recommendations/
  rebalance: {"noticeTime": "..."}).
- GCP: "Detect if a VM was preempted" and "Getting live migration notices"
  (/computeMetadata/v1/instance/preempted TRUE/FALSE, .../maintenance-event NONE /
  TERMINATE_ON_HOST_MAINTENANCE / MIGRATE_ON_HOST_MAINTENANCE; Metadata-Flavor: Google
  required; ?wait_for_change=true&last_etag=E&timeout_sec=N hangs until the value's ETag
  differs from E or N seconds pass).
- Placement facts (labels): AWS "Instance metadata categories" (placement/region,
  placement/availability-zone, instance-type, instance-life-cycle: ``spot`` / ``on-demand``,
  plain text); GCP "View and query VM metadata" (instance/zone and instance/machine-type as
  ``projects/N/zones/Z`` / ``projects/N/machineTypes/T``, instance/scheduling/
  provisioning-model ``SPOT`` / ``STANDARD``); Azure IMDS GET /metadata/instance/compute?
  api-version=2021-02-01 (JSON: location, zone, vmSize, priority ``Spot`` / ``Regular``).
- Azure: "Azure Instance Metadata Service" (GET /metadata/instance/compute/name?api-version=
  2021-02-01&format=text with Metadata: true: the VM name) and "Scheduled Events for Linux
  VMs" (GET /metadata/scheduledevents?api-version=
  2020-07-01 with Metadata: true; {"DocumentIncarnation", "Events": [{"EventId",
  "EventType", "ResourceType", "Resources", "EventStatus", "NotBefore" (RFC 1123),
  "Description", "EventSource", "DurationInSeconds"}]}; POST {"StartRequests": [...]}).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from email.utils import formatdate
from typing import Any, Self

from aiohttp import web


class FakeServer:
    """An aiohttp app on a free loopback port; ``failures`` are served before real answers."""

    def __init__(self) -> None:
        self.app = web.Application()
        self.failures: list[int | float] = []
        """Statuses to answer with (int), or seconds to hang (float), one per request."""
        self.requests = 0
        self.url = ""

    async def start(self) -> Self:
        # Hanging gets must not hold up shutdown (aiohttp waits for handlers otherwise).
        self.runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def failure(self) -> web.Response | None:
        self.requests += 1
        if not self.failures:
            return None
        failure = self.failures.pop(0)
        if isinstance(failure, float):
            await asyncio.sleep(failure)
            return web.Response(status=504)
        return web.Response(status=failure, text="injected")


class FakeAws(FakeServer):
    def __init__(self) -> None:
        super().__init__()
        self.tokens: set[str] = set()
        self.issued = 0
        self.action: dict[str, str] | None = None
        self.rebalance: dict[str, str] | None = None
        self.facts = {
            "placement/region": "us-east-1",
            "placement/availability-zone": "us-east-1a",
            "instance-type": "p5.48xlarge",
            "instance-life-cycle": "spot",
        }
        self.app.router.add_put("/latest/api/token", self.token)
        self.app.router.add_get("/latest/meta-data/{path:.*}", self.meta)

    def expire_tokens(self) -> None:
        self.tokens.clear()

    async def token(self, request: web.Request) -> web.Response:
        if "X-aws-ec2-metadata-token-ttl-seconds" not in request.headers:
            return web.Response(status=400)
        self.issued += 1
        token = f"token-{self.issued}"
        self.tokens.add(token)
        return web.Response(text=token)

    async def meta(self, request: web.Request) -> web.Response:
        failed = await self.failure()
        if failed is not None:
            return failed
        if request.headers.get("X-aws-ec2-metadata-token") not in self.tokens:
            return web.Response(status=401)
        path = request.match_info["path"]
        if path in self.facts:
            return web.Response(text=self.facts[path])
        document = {
            "spot/instance-action": self.action,
            "events/recommendations/rebalance": self.rebalance,
        }.get(path)
        if document is None:
            return web.Response(status=404, text="Not Found")
        return web.json_response(document)


class FakeGcp(FakeServer):
    def __init__(self) -> None:
        super().__init__()
        self.values = {
            "preempted": "FALSE",
            "maintenance-event": "NONE",
            "id": "1234",
            "zone": "projects/1234/zones/us-central1-a",
            "machine-type": "projects/1234/machineTypes/a3-highgpu-8g",
            "scheduling/provisioning-model": "STANDARD",
        }
        self.changed = asyncio.Condition()
        self.app.router.add_get("/computeMetadata/v1/instance/{key:.*}", self.get)

    async def set(self, key: str, value: str) -> None:
        async with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def etag(self, key: str) -> str:
        return hashlib.sha1(self.values[key].encode()).hexdigest()[:16]

    async def get(self, request: web.Request) -> web.Response:
        if request.headers.get("Metadata-Flavor") != "Google":
            return web.Response(status=403)
        failed = await self.failure()
        if failed is not None:
            return failed
        key = request.match_info["key"]
        if key not in self.values:
            return web.Response(status=404)
        if request.query.get("wait_for_change") == "true":
            last = request.query.get("last_etag", "")
            wait = float(request.query.get("timeout_sec", "60"))
            async with self.changed:
                try:
                    await asyncio.wait_for(
                        self.changed.wait_for(lambda: self.etag(key) != last), wait
                    )
                except TimeoutError:
                    pass
        return web.Response(text=self.values[key], headers={"ETag": self.etag(key)})


class FakeAzure(FakeServer):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []
        self.incarnation = itertools.count(1)
        self.started: list[str] = []
        self.vm = "vm1"
        self.app.router.add_get("/metadata/scheduledevents", self.get)
        self.app.router.add_get("/metadata/instance/compute/name", self.name)
        self.compute = {
            "location": "eastus",
            "zone": "2",
            "vmSize": "Standard_ND96isr_H100_v5",
            "priority": "Spot",
            "name": "vm1",
        }
        self.app.router.add_get("/metadata/instance/compute", self.instance)
        self.app.router.add_post("/metadata/scheduledevents", self.post)

    async def name(self, request: web.Request) -> web.Response:
        if request.headers.get("Metadata") != "true":
            return web.Response(status=400)
        return web.Response(text=self.vm)

    async def instance(self, request: web.Request) -> web.Response:
        if request.headers.get("Metadata") != "true":
            return web.Response(status=400)
        if request.query.get("api-version") != "2021-02-01":
            return web.Response(status=400, text="Bad request: api-version")
        return web.json_response(self.compute)

    def schedule(self, event_type: str, event_id: str, not_before: float, vm: str = "vm1") -> None:
        self.events.append(
            {
                "EventId": event_id,
                "EventStatus": "Scheduled",
                "EventType": event_type,
                "ResourceType": "VirtualMachine",
                "Resources": [vm],
                "NotBefore": formatdate(not_before, usegmt=True),
                "Description": "Virtual machine is being preempted.",
                "EventSource": "Platform",
                "DurationInSeconds": -1,
            }
        )

    def _check(self, request: web.Request) -> web.Response | None:
        if request.headers.get("Metadata") != "true":
            return web.Response(status=400, text="Bad request: Metadata header required")
        if request.query.get("api-version") != "2020-07-01":
            return web.Response(status=400, text="Bad request: api-version")
        return None

    async def get(self, request: web.Request) -> web.Response:
        refused = self._check(request)
        if refused is not None:
            return refused
        failed = await self.failure()
        if failed is not None:
            return failed
        return web.json_response(
            {"DocumentIncarnation": next(self.incarnation), "Events": self.events}
        )

    async def post(self, request: web.Request) -> web.Response:
        refused = self._check(request)
        if refused is not None:
            return refused
        body = await request.json()
        self.started.extend(item["EventId"] for item in body["StartRequests"])
        return web.Response(status=200)
