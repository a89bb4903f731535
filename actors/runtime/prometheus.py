"""The series every program of this project exports whatever it does: the process's own
(``process_*``: CPU, memory, descriptors, start time), the interpreter's
(``python_info``) and ``<program>_build_info`` (version, Python), so a Prometheus user can
join any series to the build that produced it and alert on a program that restarts."""

from __future__ import annotations

import platform

from prometheus_client import CollectorRegistry, Info, PlatformCollector, ProcessCollector

from schemas.version import AGENT_VERSION


def standard_series(registry: CollectorRegistry, program: str) -> None:
    """Register the process, platform and ``<program>_build_info`` series in ``registry``
    (one registry per program: several share a process under ``fleetctl up``, each with
    its own copy, as each is scraped on its own port)."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    build = Info(f"{program}_build", f"The {program} build serving these series", registry=registry)
    build.info({"version": AGENT_VERSION, "python": platform.python_version()})
