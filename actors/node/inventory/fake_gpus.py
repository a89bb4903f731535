"""Simulated H100-like GPUs for development, demos and tests (``--fake-gpus N``).

Readings drift slowly; faults injected at runtime (``node-agent inject``) override them
per GPU or for all GPUs: temperature, utilization, an XID, a lost GPU, or clear.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from typing import Final

from actors.node.gpu.xid import count_xid, in_code_order
from schemas.events import Gpu, Inject, XidCount

H100_MEMORY = 85_520_809_984
"""What NVML gives an H100 80GB HBM3 as its memory total (81559 MiB, as recorded on one in
tests/support/data/h100-sxm-580.json), so a simulated node's ``gpu.memory`` label is a
real one's."""
NAME = "NVIDIA H100 80GB HBM3"
"""NVML's product name of that GPU (``nvmlDeviceGetName``): ``gpu.product`` selects
simulated and real H100 nodes alike; the sample's ``gpu_source`` says which is which."""


class FakeGpus:
    """N devices whose readings drift slowly and deterministically per device."""

    source: Final = "fake"
    error: Final = ""
    versions: Final = ("", "")

    def __init__(self, count: int, node_id: str) -> None:
        self.count = count
        self.node_id = node_id
        self._started = time.monotonic()
        # read() runs in a worker thread while apply() runs on the event loop.
        self._lock = threading.Lock()
        self._temperature: dict[int, float] = {}
        self._utilization: dict[int, float] = {}
        self._lost: set[int] = set()
        self._xids: dict[int, dict[int, XidCount]] = {}

    def _uuid(self, index: int) -> str:
        digest = hashlib.sha256(f"{self.node_id}:{index}".encode()).hexdigest()
        return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"

    def apply(self, inject: Inject) -> None:
        """Apply one fault; ``clear`` also forgets injected XIDs. Bad input: ValueError."""
        if inject.gpu is not None and inject.gpu >= self.count:
            raise ValueError(f"no GPU {inject.gpu} (this node simulates {self.count})")
        if inject.fault in ("temp", "util", "xid") and inject.value is None:
            raise ValueError(f"fault {inject.fault} needs a value")
        targets = range(self.count) if inject.gpu is None else [inject.gpu]
        value = inject.value or 0.0
        with self._lock:
            for index in targets:
                if inject.fault == "temp":
                    self._temperature[index] = value
                elif inject.fault == "util":
                    self._utilization[index] = min(100.0, max(0.0, value))
                elif inject.fault == "xid":
                    count_xid(self._xids.setdefault(index, {}), int(value), time.time())
                elif inject.fault == "gpu-lost":
                    self._lost.add(index)
                elif inject.fault == "clear":
                    self._temperature.pop(index, None)
                    self._utilization.pop(index, None)
                    self._lost.discard(index)
                    self._xids.pop(index, None)

    def read(self) -> list[Gpu]:
        elapsed = time.monotonic() - self._started
        gpus = []
        with self._lock:
            for index in range(self.count):
                gpus.append(self._read_one(index, elapsed))
        return gpus

    def _read_one(self, index: int, elapsed: float) -> Gpu:
        xids = in_code_order(self._xids.get(index, {}))
        uuid = self._uuid(index)
        pci_bus_id = f"00000000:{0x18 + index:02X}:00.0"
        if index in self._lost:
            # A lost device answers nothing: its identity from before, no readings.
            return Gpu(
                index=index,
                uuid=uuid,
                name=NAME,
                pci_bus_id=pci_bus_id,
                memory_total=H100_MEMORY,
                memory_used=0,
                xids=xids,
                lost=True,
            )
        wave = math.sin(elapsed / 60.0 + index)
        return Gpu(
            index=index,
            uuid=uuid,
            name=NAME,
            pci_bus_id=pci_bus_id,
            memory_total=H100_MEMORY,
            memory_used=int(H100_MEMORY * (0.3 + 0.1 * wave)),
            temperature_c=self._temperature.get(index, round(45.0 + 8.0 * wave, 1)),
            power_w=round(300.0 + 150.0 * wave, 1),
            power_limit_w=700.0,
            utilization_pct=self._utilization.get(index, round(40.0 + 20.0 * wave, 1)),
            ecc_corrected=0,
            ecc_uncorrected=0,
            xids=xids,
        )

    def hung(self, deadline: float) -> str:
        """Simulated devices never hang."""
        return ""

    def close(self) -> None:
        """Nothing to free: simulated devices hold nothing."""
