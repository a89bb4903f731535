"""Simulated H100-like GPUs for development, demos and tests (``--fake-gpus N``)."""

from __future__ import annotations

import hashlib
import math
import time

from schemas.events import Gpu

H100_MEMORY = 80 * 1024**3


class FakeGpus:
    """N devices whose readings drift slowly and deterministically per device."""

    source = "fake"

    def __init__(self, count: int, node_id: str) -> None:
        self.count = count
        self.node_id = node_id
        self._started = time.monotonic()

    def _uuid(self, index: int) -> str:
        digest = hashlib.sha256(f"{self.node_id}:{index}".encode()).hexdigest()
        return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"

    def read(self) -> list[Gpu]:
        elapsed = time.monotonic() - self._started
        gpus = []
        for index in range(self.count):
            wave = math.sin(elapsed / 60.0 + index)
            utilization = 40.0 + 20.0 * wave
            gpus.append(
                Gpu(
                    index=index,
                    uuid=self._uuid(index),
                    name="NVIDIA H100 80GB HBM3 (fake)",
                    pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
                    memory_total=H100_MEMORY,
                    memory_used=int(H100_MEMORY * (0.3 + 0.1 * wave)),
                    temperature_c=round(45.0 + 8.0 * wave, 1),
                    power_w=round(300.0 + 150.0 * wave, 1),
                    power_limit_w=700.0,
                    utilization_pct=round(utilization, 1),
                    ecc_corrected=0,
                    ecc_uncorrected=0,
                )
            )
        return gpus
