"""The cloud's instance metadata service: which cloud this is, and where the node runs.

AWS (IMDSv2: a token, then plain-text paths), GCP (``Metadata-Flavor: Google``) and
Azure (IMDS, ``Metadata: true``). The spot watcher reads notices through it and publishes
the facts (region, zone, instance type, spot or on-demand) once; ``node-agent register``
reads the facts once for the identity its registration carries. Every call has a
timeout; the service is not trusted to be well (:data:`RETRYABLE`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Literal

import aiohttp

from actors.node.config import AgentConfig
from schemas.events import CloudFacts

log = logging.getLogger(__name__)

Provider = Literal["aws", "gcp", "azure"]

DEFAULT_BASE = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
AWS_TOKEN_TTL = 21600
"""Seconds an IMDSv2 token lives (the documented maximum); refreshed at 80 %."""
AZURE_API = "api-version=2020-07-01"
AZURE_NAME_API = "api-version=2021-02-01"
LIFECYCLE = {
    "spot": "spot",
    "on-demand": "on-demand",
    "normal": "on-demand",
    "standard": "on-demand",
    "regular": "on-demand",
    "low": "spot",
}
"""The clouds' words for spot and on-demand (AWS instance-life-cycle, GCP provisioning
model, Azure priority), lower-cased, as the ``lifecycle`` label."""
DETECT_TIMEOUT = 1.0


class MetadataError(Exception):
    """The metadata service answered, but not usefully; retried like a network error."""


RETRYABLE = (aiohttp.ClientError, TimeoutError, MetadataError, ValueError, LookupError, TypeError)
"""Network failures, and documents that are not what the documentation says."""


def require_ok(response: aiohttp.ClientResponse, what: str) -> None:
    """Anything but 200 from the metadata service is a MetadataError naming ``what``."""
    if response.status != 200:
        raise MetadataError(f"{what}: HTTP {response.status}")


class Metadata:
    """One node's view of its metadata service: the base URL per cloud (``metadata_url``
    or the cloud's usual one) and, for AWS, the IMDSv2 token."""

    def __init__(self, config: AgentConfig, timeout: aiohttp.ClientTimeout) -> None:
        self.config = config
        self.timeout = timeout
        self._token = ""
        self._token_expires = 0.0

    def base(self, provider: Provider) -> str:
        return (self.config.metadata_url or DEFAULT_BASE[provider]).rstrip("/")

    async def detect(self, session: aiohttp.ClientSession) -> Provider | None:
        """Ask each provider's metadata endpoint once, briefly; the first to answer wins."""
        timeout = aiohttp.ClientTimeout(total=DETECT_TIMEOUT)
        probes: list[tuple[Provider, str, str, dict[str, str]]] = [
            ("aws", "PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"}),
            ("gcp", "GET", "/computeMetadata/v1/instance/id", {"Metadata-Flavor": "Google"}),
            ("azure", "GET", f"/metadata/scheduledevents?{AZURE_API}", {"Metadata": "true"}),
        ]
        for provider, method, path, headers in probes:
            try:
                async with session.request(
                    method, self.base(provider) + path, headers=headers, timeout=timeout
                ) as response:
                    if response.status == 200:
                        log.info("cloud detected", extra={"provider": provider})
                        return provider
            except (aiohttp.ClientError, TimeoutError):
                continue
        log.info("no cloud metadata service answered")
        return None

    async def facts(self, session: aiohttp.ClientSession, provider: Provider) -> CloudFacts:
        """Region, zone, instance type and spot/on-demand from ``provider``'s metadata."""
        base = self.base(provider)
        if provider == "aws":
            get = self.aws_text
            zone = await get(session, "placement/availability-zone")
            return CloudFacts(
                ts=time.time(),
                provider="aws",
                region=await get(session, "placement/region"),
                zone=zone,
                instance_type=await get(session, "instance-type"),
                lifecycle=LIFECYCLE.get(await get(session, "instance-life-cycle"), ""),
            )
        if provider == "gcp":
            headers = {"Metadata-Flavor": "Google"}

            async def value(key: str) -> str:
                url = f"{base}/computeMetadata/v1/instance/{key}"
                async with session.get(url, headers=headers, timeout=self.timeout) as response:
                    require_ok(response, key)
                    return (await response.text()).strip()

            zone = (await value("zone")).rsplit("/", 1)[-1]
            model = await value("scheduling/provisioning-model")
            return CloudFacts(
                ts=time.time(),
                provider="gcp",
                region=zone.rsplit("-", 1)[0],
                zone=zone,
                instance_type=(await value("machine-type")).rsplit("/", 1)[-1],
                lifecycle=LIFECYCLE.get(model.lower(), ""),
            )
        async with session.get(
            f"{base}/metadata/instance/compute?{AZURE_NAME_API}",
            headers={"Metadata": "true"},
            timeout=self.timeout,
        ) as response:
            require_ok(response, "instance/compute")
            compute = json.loads(await response.text())
        return CloudFacts(
            ts=time.time(),
            provider="azure",
            region=str(compute["location"]),
            zone=str(compute.get("zone", "")),
            instance_type=str(compute["vmSize"]),
            lifecycle=LIFECYCLE.get(str(compute.get("priority", "")).lower(), ""),
        )

    async def aws_fetch(self, session: aiohttp.ClientSession, path: str) -> str | None:
        """The text at ``path`` of IMDSv2, or None on 404. A 401 means the token expired
        or was revoked: a new one is fetched next time."""
        token = await self._aws_token(session)
        async with session.get(
            f"{self.base('aws')}/latest/meta-data/{path}",
            headers={"X-aws-ec2-metadata-token": token},
            timeout=self.timeout,
        ) as response:
            if response.status == 404:
                return None
            if response.status == 401:
                self._token = ""
                raise MetadataError(f"{path}: HTTP 401, token refreshed")
            require_ok(response, path)
            return (await response.text()).strip()

    async def aws_text(self, session: aiohttp.ClientSession, path: str) -> str:
        text = await self.aws_fetch(session, path)
        if text is None:
            raise MetadataError(f"{path}: HTTP 404")
        return text

    async def aws_get(self, session: aiohttp.ClientSession, path: str) -> Any:
        """The JSON document at ``path``, or None on 404 (no notice)."""
        text = await self.aws_fetch(session, path)
        return None if text is None else json.loads(text)

    async def _aws_token(self, session: aiohttp.ClientSession) -> str:
        if not self._token or time.monotonic() > self._token_expires:
            async with session.put(
                f"{self.base('aws')}/latest/api/token",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL)},
                timeout=self.timeout,
            ) as response:
                require_ok(response, "IMDSv2 token")
                self._token = (await response.text()).strip()
            self._token_expires = time.monotonic() + 0.8 * AWS_TOKEN_TTL
        return self._token


async def read_facts(config: AgentConfig, timeout: float) -> CloudFacts | None:
    """Where this node runs, read once within about ``timeout`` seconds (the cloud found
    first when ``spot_provider`` is ``auto``): the facts ``node-agent register`` puts in
    the node's identity. None with ``spot_provider`` none, or when no metadata service
    answers in time (on-premises): a registration never waits on one."""
    provider = config.spot_provider
    if provider == "none":
        return None
    metadata = Metadata(config, aiohttp.ClientTimeout(total=timeout))
    try:
        async with asyncio.timeout(timeout), aiohttp.ClientSession() as session:
            found = provider if provider != "auto" else await metadata.detect(session)
            return None if found is None else await metadata.facts(session, found)
    except RETRYABLE as exc:
        log.warning("cloud facts not read", extra={"reason": str(exc) or type(exc).__name__})
        return None
