"""What tests share: model folders and the server process (from devtools) and a from-scratch reference
decoder (devtools.reference), the same ones the benchmarks use; an in-process server for fault
injection; a reader of a process's resources."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import uvicorn

from chatd.config import Settings
from chatd.engine.model.runner import ModelRunner
from chatd.server.app import create_app
from chatd.server.transport import WebSocketProtocol
from chatd.service.core import Chatd
from devtools.models import CACHE_DIR, ROOT, packaged_model_dir, tiny_model_dir
from devtools.reference import reference_greedy
from devtools.servers import LoopbackServer, ServerProcess, free_port

__all__ = ["CACHE_DIR", "ROOT", "InProcessServer", "ServerProcess", "free_port", "packaged_model_dir",
           "proc_resources", "reference_greedy", "tiny_model_dir"]


class InProcessServer(LoopbackServer):
    """uvicorn serving ``create_app`` on a loopback port, in a thread of this process, so a test can inject
    faults into the running core while real websocket clients talk to it."""

    def __init__(self, settings: Settings, runner: ModelRunner) -> None:
        self.port = free_port()
        self.admin_token = "test-admin-token"
        # The Host allow-list names the configured port.
        server = settings.server.model_copy(update={"port": self.port, "admin_token": self.admin_token})
        settings = settings.model_copy(update={"server": server})
        self.app = create_app(settings, runner=runner)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, ws=WebSocketProtocol, log_level="warning",
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    @property
    def core(self) -> Chatd:
        return self.app.state.core  # type: ignore[no-any-return]

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        for _ in range(600):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn exited")
            threading.Event().wait(0.05)
        raise RuntimeError("uvicorn did not start")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def proc_resources(pid: int) -> dict[str, int]:
    """Resident memory (KiB), open file descriptors and threads of process ``pid``, from /proc."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_kib": int(status["VmRSS"].split()[0]), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"])}
