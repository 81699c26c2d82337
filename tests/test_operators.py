"""The operator's side of ``chatd serve`` and ``chatd chat``, in real processes on real sockets: one-line
start-up errors with their exit codes, config checked before any heavy import, the readiness split
(/livez, /readyz, ``unavailable``), one JSON log format with a line per turn, and the terminal chat's
error paths and Ctrl+C under a pseudo-terminal."""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import termios
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tomli_w
from websockets.asyncio.client import connect

from chatd.client import ChatClient
from chatd.client.terminal import websocket_url
from chatd.domain import CLOSE_TRY_AGAIN_LATER
from chatd.engine.kernels.cpu import ISA_ENV
from chatd.server.gate import Readiness, conversion_progress
from tests.support import ROOT, ServerProcess, free_port, tiny_model_dir

HEAVY = ("torch", "transformers", "uvicorn", "fastapi")
# Runs the CLI and reports which heavy modules were imported by the time it returned.
CLI_PROBE = ("import sys; from chatd.cli import main; rc = main(sys.argv[1:]); "
             f"print('heavy:', [m for m in {HEAVY!r} if m in sys.modules]); sys.exit(rc)")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATD_") or k in ("CHATD_TEST_CACHE", ISA_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def _config(folder: Path, **sections: dict[str, object]) -> Path:
    settings: dict[str, object] = {"data_dir": str(folder / "data"), "log_level": "info"}
    settings["model"] = {"source": str(tiny_model_dir()), "threads": 1, **sections.pop("model", {})}
    settings["server"] = {"host": "127.0.0.1", "port": free_port(), "admin_token": "t",
                          **sections.pop("server", {})}
    settings.update(sections)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.toml"
    path.write_text(tomli_w.dumps(settings))
    return path


def _serve(config: Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CLI_PROBE, "serve", "--config", str(config), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env or _env())


def _one_line_error(run: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("chatd: "), run.stderr
    return last


# ----------------------------------------------------------------------------- start-up errors


@pytest.mark.parametrize(("env", "needle"), [
    ({"CHATD_STORE__URL": "postgresql://chatd:secret@127.0.0.1:5432/chatd"}, "write postgresql+asyncpg://"),
    ({"CHATD_STORE__URL": "sqlite:///x.db"}, "write sqlite+aiosqlite://"),
    ({"CHATD_STORE__URL": "mysql://x/y"}, "not a supported database URL"),
    ({"CHATD_MODEL__SOURCE": "/no/such/model"}, "no model folder at /no/such/model"),
    ({"CHATD_MODEL__SOURCE": "/no/such/model.gguf"}, "no GGUF file at /no/such/model.gguf"),
    ({"CHATD_SERVR__PORT": "8001"}, "CHATD_SERVR__PORT: there is no [servr] section"),
    ({"CHATD_SERVER__PORT": "http"}, "server.port"),
    ({ISA_ENV: "avx9"}, f"{ISA_ENV}='avx9': expected one of native, avx512, avx2"),
])
def test_config_errors_are_one_line_exit_2_before_any_heavy_import(tmp_path: Path, env: dict[str, str],
                                                                   needle: str) -> None:
    run = _serve(_config(tmp_path), env=_env(**env))
    assert run.returncode == 2, run.stderr
    line = _one_line_error(run)
    assert needle in line
    assert "secret" not in run.stderr  # a password in the store URL is never shown
    assert "heavy: []" in run.stdout


def test_data_dir_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    run = _serve(_config(tmp_path, data_dir=str(blocker / "data")))  # type: ignore[arg-type]
    assert run.returncode == 2
    line = _one_line_error(run)
    assert f"data_dir '{blocker / 'data'}' cannot be created" in line and "heavy: []" in run.stdout


def test_port_in_use_fails_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = _serve(_config(tmp_path, server={"port": port}))
    assert run.returncode == 1
    line = _one_line_error(run)
    assert f"cannot listen on 127.0.0.1:{port}: the address is already in use" in line
    assert "listening" not in run.stderr and "heavy: []" in run.stdout


def test_unreachable_store_is_one_line_exit_1(tmp_path: Path) -> None:
    closed = free_port()  # nothing listens there
    url = f"postgresql+asyncpg://chatd:secret@127.0.0.1:{closed}/chatd"
    run = _serve(_config(tmp_path, store={"url": url}))
    assert run.returncode == 1, run.stderr
    line = _one_line_error(run)
    assert f"cannot open the store postgresql+asyncpg://chatd:***@127.0.0.1:{closed}/chatd" in line
    assert "[store] url" in line and "secret" not in run.stderr and "chatd ready" not in run.stderr


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    run = _serve(_config(tmp_path, store={"url": "postgresql://x/y"}), "--debug")
    assert run.returncode == 2
    assert "Traceback" in run.stderr and run.stderr.strip().splitlines()[-1].startswith("chatd: ")


# ----------------------------------------------------------------------------- readiness and logs

# Holds ``import transformers`` on the start-up thread (not the main thread's find_spec checks before the
# port opens) until the release file exists, so the test sees the server in its loading phase for as long
# as it needs, on any machine.
HOLD_IMPORT = '''
import os, sys, threading, time
class _Hold:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" and threading.current_thread() is not threading.main_thread():
            while not os.path.exists(os.environ["CHATD_TEST_RELEASE"]):
                time.sleep(0.05)
            sys.meta_path.remove(self)
        return None
sys.meta_path.insert(0, _Hold())
'''


@pytest.fixture
def held_server(tmp_path: Path) -> Iterator[tuple[ServerProcess, Path]]:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_IMPORT)
    release = tmp_path / "release"
    proc = ServerProcess(tmp_path / "server", tiny_model_dir(), server={"log_format": "json"})
    env = _env(CHATD_TEST_RELEASE=str(release))
    env["PYTHONPATH"] = os.pathsep.join([str(hook), env["PYTHONPATH"]])
    proc.process = subprocess.Popen([sys.executable, "-m", "chatd", "serve", "--config", str(proc.config_path)],
                                    stdout=proc.log_path.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        yield proc, release
    finally:
        release.touch()
        proc.stop()


def _wait_for(url: str, status: int, timeout: float = 120) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            answer = httpx.get(url, timeout=5)
            if answer.status_code == status:
                return answer
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} never answered {status}"
        time.sleep(0.1)


async def _first_frame_and_close(url: str) -> tuple[dict[str, object], int | None]:
    async with connect(url) as ws:
        frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
        await asyncio.wait_for(ws.wait_closed(), 10)
        return frame, ws.close_code


async def _two_turns(url: str) -> str:
    async with await ChatClient.connect(url) as client:
        info = await client.create_session()
        for text in ("Hello", "Again"):
            await (await client.send(info.session_id, text, max_tokens=4, temperature=0)).result()
        return info.session_id


def test_readiness_split_and_json_logs(held_server: tuple[ServerProcess, Path]) -> None:
    server, release = held_server
    base = server.http_url
    # The port answers while the libraries and the model are still loading.
    live = _wait_for(f"{base}/livez", 200, timeout=30)
    assert live.json()["status"] == "alive"
    ready = httpx.get(f"{base}/readyz")
    assert ready.status_code == 503 and ready.json() == {"status": "starting", "phase": "loading libraries"}
    health = httpx.get(f"{base}/healthz")
    assert health.status_code == 503 and health.json()["status"] == "starting"
    admin = httpx.get(f"{base}/admin/stats", headers=server.admin_headers)
    assert admin.status_code == 503 and admin.json()["error"]["code"] == "unavailable"
    assert "readyz" in admin.json()["error"]["message"]
    openai = httpx.get(f"{base}/v1/models")
    assert openai.status_code == 503 and openai.json()["error"]["type"]  # OpenAI's error shape
    assert httpx.get(f"{base}/", headers={"Host": "evil.example"}).status_code == 400  # the Host rule holds
    frame, close_code = asyncio.run(_first_frame_and_close(server.ws_url))
    assert frame["type"] == "error" and frame["code"] == "unavailable" and close_code == CLOSE_TRY_AGAIN_LATER

    release.touch()
    assert _wait_for(f"{base}/readyz", 200).json() == {"status": "ready"}
    assert httpx.get(f"{base}/healthz").status_code == 200
    session_id = asyncio.run(_two_turns(server.ws_url))
    assert server.stop() in (0, -signal.SIGTERM)

    lines = server.log_text().strip().splitlines()
    records = [json.loads(line) for line in lines]  # every line, uvicorn's too, is one JSON object
    assert {"ts", "level", "logger", "message"} <= set(records[0])
    assert any(r["logger"].startswith("uvicorn") for r in records)
    assert not any("Deprecat" in r["message"] or "Warning" in r["message"] for r in records), lines
    phases = [r["message"] for r in records if r["logger"] == "chatd.startup"]
    assert any("loading model" in p for p in phases) and any("warming up" in p for p in phases)
    turns = [r for r in records if r.get("event") == "turn"]
    assert len(turns) == 2
    second = turns[1]
    assert second["session"] == session_id[:8] and second["tier"] == "device"
    assert second["cached_tokens"] > 0 and second["cached_tokens"] + second["prefill_tokens"] == second["input_tokens"]
    assert second["output_tokens"] >= 1 and second["ttft_ms"] > 0 and "decode_tokens_per_s" in second


def test_conversion_progress_reports_percent() -> None:
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    readiness = Readiness()
    seen: list[str] = []
    readiness.set_phase = lambda phase, quiet=False: seen.append(phase)  # type: ignore[method-assign]
    runner_log = logging.getLogger("chatd.engine.model.runner")
    runner_log.setLevel(logging.INFO)  # as under the default log_level
    with conversion_progress(readiness):
        runner_log.info("converting %s to safetensors in %s (once)", "x.gguf", "folder")
        assert list(gguf_utils.tqdm(range(10), desc="Converting")) == list(range(10))
        runner_log.info("converted in %.1f s", 1.0)
    runner_log.setLevel(logging.NOTSET)
    assert seen[:2] == ["converting model: reading the GGUF", "converting model 0 %"]
    assert "converting model 50 %" in seen and seen[-2:] == ["converting model: saving", "loading model"]
    assert gguf_utils.tqdm.__module__.startswith("tqdm")  # restored


# ----------------------------------------------------------------------------- the terminal chat


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("ops"), tiny_model_dir()).start()
    yield proc
    proc.stop()


def _own_terminal() -> None:
    """In the child: a new session whose controlling terminal is the pty (so Ctrl+C there is SIGINT)."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """``chatd chat`` on a pseudo-terminal: what a person at a terminal sees and types (Ctrl+C included)."""

    def __init__(self, *args: str) -> None:
        master, slave = pty.openpty()
        self.master = master
        self.process = subprocess.Popen([sys.executable, "-m", "chatd", "chat", *args], stdin=slave, stdout=slave,
                                        stderr=slave, cwd=ROOT, env=_env(), preexec_fn=_own_terminal)
        os.close(slave)
        self.output = ""

    def read_until(self, needle: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while needle not in self.output:
            left = deadline - time.monotonic()
            assert left > 0, f"{needle!r} not seen in {self.output!r}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    self.output += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    assert needle in self.output, f"{needle!r} not seen in {self.output!r}"
        return self.output

    def read_more(self, num_chars: int, timeout: float = 60) -> None:
        """Wait until at least ``num_chars`` more characters have been printed."""
        target = len(self.output) + num_chars
        deadline = time.monotonic() + timeout
        while len(self.output) < target:
            left = deadline - time.monotonic()
            assert left > 0, f"no more output after {self.output!r}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                self.output += os.read(self.master, 4096).decode(errors="replace")

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def interrupt(self) -> None:
        os.write(self.master, b"\x03")  # the terminal turns it into SIGINT, as a person's Ctrl+C

    def wait(self, timeout: float = 30) -> int:
        code = self.process.wait(timeout)
        with_rest = self.output
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:
                break
            if not chunk:
                break
            with_rest += chunk.decode(errors="replace")
        self.output = with_rest
        os.close(self.master)
        return code


def test_terminal_unknown_session_is_one_line(server: ServerProcess) -> None:
    term = Terminal("--url", server.ws_url, "--session", "A" * 24)
    assert term.wait() == 1
    assert f"no session '{'A' * 24}'" in term.output and "Traceback" not in term.output


@pytest.mark.parametrize(("path", "note"), [("", "chatd's websocket is at /ws"), ("/", "chatd's websocket is at /ws")])
def test_terminal_http_url_is_converted(server: ServerProcess, path: str, note: str) -> None:
    term = Terminal("--url", f"{server.http_url}{path}")
    term.read_until("> ")
    assert f"connecting to {server.ws_url}" in term.output and "http:// is the HTTP address" in term.output
    assert note in term.output and "new session" in term.output
    term.type("/quit\n")
    assert term.wait() == 0 and "Traceback" not in term.output


def test_terminal_wrong_path_says_where_the_websocket_is(server: ServerProcess) -> None:
    term = Terminal("--url", f"ws://127.0.0.1:{server.port}/chat")
    assert term.wait() == 1
    assert "chatd's websocket path is /ws" in term.output and "Traceback" not in term.output


def test_terminal_nothing_listening(server: ServerProcess) -> None:
    term = Terminal("--url", f"ws://127.0.0.1:{free_port()}/ws")
    assert term.wait() == 1
    assert "is chatd serve running?" in term.output and "Traceback" not in term.output


def test_terminal_ctrl_c_stops_the_reply_then_quits(server: ServerProcess) -> None:
    term = Terminal("--url", server.ws_url, "--max-tokens", "3000", "--temperature", "1", "--system", "Be long.")
    term.read_until("> ")
    session_id = term.output.split("new session ", 1)[1].split()[0]
    term.type("Tell me a long story\n")
    term.read_more(len("Tell me a long story\n") + 40)  # the echo, then some of the reply
    term.interrupt()
    term.read_until("(cancelled)")
    term.read_until("> ", timeout=30)
    assert term.process.poll() is None  # the program goes on
    term.interrupt()  # at the prompt: quits
    assert term.wait() == 130
    assert "Traceback" not in term.output and "KeyboardInterrupt" not in term.output
    detail = httpx.get(f"{server.http_url}/admin/sessions/{session_id}", headers=server.admin_headers).json()
    assert detail["messages"][0]["content"] == "Be long."
    assert detail["messages"][-1]["finish_reason"] == "cancelled"


@pytest.mark.parametrize(("url", "expected"), [
    ("ws://h:1/ws", ("ws://h:1/ws", None)),
    ("http://h:1", ("ws://h:1/ws", "note: connecting to ws://h:1/ws (http:// is the HTTP address; using ws://; "
                                   "chatd's websocket is at /ws)")),
    ("https://h/ws", ("wss://h/ws", "note: connecting to wss://h/ws (https:// is the HTTP address; using wss://)")),
    ("h:8000", ("ws://h:8000/ws", "note: connecting to ws://h:8000/ws (added ws://; chatd's websocket is at /ws)")),
])
def test_websocket_url(url: str, expected: tuple[str, str | None]) -> None:
    assert websocket_url(url) == expected


def test_websocket_url_refuses_other_schemes() -> None:
    with pytest.raises(ValueError, match="ws:// or wss://"):
        websocket_url("ftp://h/ws")


# ----------------------------------------------------------------------------- installs


def test_the_client_installs_and_runs_without_the_server_packages(server: ServerProcess) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {re.split(r"[<>=~!\[ ;]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]}
    assert base == {"websockets", "pydantic"}
    server_extra = " ".join(project["optional-dependencies"]["server"])
    assert all(name in server_extra for name in ("torch", "transformers", "fastapi", "uvicorn"))
    # `chatd chat` with every server package unimportable, as in an install without the extra.
    blocked = ("torch", "transformers", "fastapi", "starlette", "uvicorn", "sqlalchemy", "numpy")
    code = (f"import sys; sys.modules.update(dict.fromkeys({blocked!r})); "
            "from chatd.cli import main; sys.exit(main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", code, "chat", "--url", server.ws_url, "--max-tokens", "3"],
                         input="Hi\n/usage\n/quit\n", capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env())
    assert run.returncode == 0, run.stderr
    assert "new session" in run.stdout and "cached 0/" in run.stdout
    # And `chatd serve` there says what to install, in one line.
    run = subprocess.run([sys.executable, "-c", code, "serve", "--config", str(server.config_path)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env())
    assert run.returncode == 1
    assert "pip install 'chatd[server]'" in _one_line_error(run)
