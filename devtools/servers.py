"""A real ``chatd serve`` in a child process on a loopback port, for the tests and the benchmarks."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import tomli_w

from devtools.models import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LoopbackServer:
    """A test server on a loopback port: its URLs and the admin token's header."""

    port: int
    admin_token: str

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}


class ServerProcess(LoopbackServer):
    """``chatd serve`` in a child process on a loopback port, with its own config file and data folder.

    ``start()`` waits until /healthz answers; ``kill()`` sends SIGKILL (a crash), ``stop()`` SIGTERM (a
    graceful shutdown). The same folder can be started again to test restarts.
    """

    def __init__(self, folder: Path, model_dir: Path, **sections: dict[str, object]) -> None:
        self.folder = folder
        self.port = free_port()
        self.admin_token = "test-admin-token"
        settings: dict[str, object] = {"data_dir": str(folder / "data"), "log_level": "info"}
        settings["model"] = {"source": str(model_dir), "threads": 1, **sections.pop("model", {})}
        settings["server"] = {"host": "127.0.0.1", "port": self.port, "admin_token": self.admin_token,
                              **sections.pop("server", {})}
        settings["cache"] = {"persist_idle_s": 0, "idle_evict_s": 0, **sections.pop("cache", {})}
        settings.update(sections)
        folder.mkdir(parents=True, exist_ok=True)
        self.config_path = folder / "config.toml"
        self.config_path.write_text(tomli_w.dumps(settings))
        self.log_path = folder / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> ServerProcess:
        log = self.log_path.open("ab")
        self.process = process = subprocess.Popen(
            [sys.executable, "-m", "chatd", "serve", "--config", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"chatd serve exited early:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.http_url}/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"chatd serve did not become healthy:\n{self.log_path.read_text()[-3000:]}")

    def wait_pool_populated(self, timeout: float = 120.0) -> None:
        """Wait until the server's KV pool is faulted in (``/admin/stats`` pool.populated), so that timings
        taken from now on do not share the cores with that."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            response = httpx.get(f"{self.http_url}/admin/stats", headers=self.admin_headers, timeout=10)
            response.raise_for_status()
            if response.json()["pool"]["populated"]:
                return
            time.sleep(0.2)
        raise RuntimeError("the server's KV pool was not populated in time")

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait: graceful shutdown. Returns the exit code."""
        if self.process is None or self.process.poll() is not None:
            return 0
        self.process.send_signal(signal.SIGTERM)
        return int(self.process.wait(timeout))

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")
