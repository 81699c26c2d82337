"""``python -m benchmarks.startup [--runs N] [--model packaged|tiny]``: how fast ``chatd serve`` tells an
operator something, in real processes.

* a bad configuration (an unknown ``CHATD_*`` section), a store URL without its driver: the time to the
  one-line error and exit status 2 (checked before torch is imported);
* a good configuration: the time until the port answers ``/livez``, and until ``/readyz`` is 200.

The packaged model is used already converted (the first start's conversion is a one-off, ~15-45 s more),
from the test cache's data folder when there is one. Prints a Markdown table (medians over ``--runs``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import tomli_w

from chatd.engine.kernels.cpu import ISA_ENV
from devtools.models import CACHE_DIR, ROOT, packaged_model_dir, tiny_model_dir
from devtools.servers import free_port


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATD_") or k == ISA_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra)
    return env


def _config(folder: Path, model: str) -> Path:
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    if model == "packaged":
        source = "packaged"
        converted = packaged_model_dir()  # converted once into the cache: link it, do not convert again
        (data / "models").mkdir(exist_ok=True)
        link = data / "models" / converted.name
        if not link.exists():
            link.symlink_to(converted)
    else:
        source = str(tiny_model_dir())
    path = folder / "config.toml"
    path.write_text(tomli_w.dumps({"data_dir": str(data), "model": {"source": source},
                                   "server": {"host": "127.0.0.1", "port": free_port(), "admin_token": "t"}}))
    return path


def time_to_error(config: Path, **env: str) -> float:
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "chatd", "serve", "--config", str(config)], env=_env(**env),
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    elapsed = time.monotonic() - started
    if run.returncode != 2:
        raise RuntimeError(f"expected exit status 2, got {run.returncode}: {run.stderr[-500:]}")
    return elapsed


def time_to_live_and_ready(config: Path) -> tuple[float, float]:
    port = int(config.read_text().split("port = ")[1].split()[0])
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "chatd", "serve", "--config", str(config)], env=_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    live: float | None = None
    try:
        while time.monotonic() - started < 300:
            if process.poll() is not None:
                raise RuntimeError(f"chatd serve exited with {process.returncode}")
            try:
                if live is None and httpx.get(f"{base}/livez", timeout=2).status_code == 200:
                    live = time.monotonic() - started
                if live is not None and httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    return live, time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("chatd serve did not become ready in 300 s")
    finally:
        process.terminate()
        process.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", choices=["packaged", "tiny"], default="packaged")
    args = parser.parse_args(argv)
    rows: list[tuple[str, list[float]]] = [("bad config (CHATD_SERVR__PORT) → one-line error, exit 2", []),
                                           ("store URL without its driver → one-line error, exit 2", []),
                                           ("good config → port answers /livez", []),
                                           ("good config → /readyz 200 (ready to chat)", [])]
    with tempfile.TemporaryDirectory(prefix="chatd-startup-") as tmp:
        for run in range(args.runs):
            config = _config(Path(tmp) / f"run{run}", args.model)
            rows[0][1].append(time_to_error(config, CHATD_SERVR__PORT="8001"))
            rows[1][1].append(time_to_error(config, CHATD_STORE__URL="postgresql://u@127.0.0.1/db"))
            live, ready = time_to_live_and_ready(config)
            rows[2][1].append(live)
            rows[3][1].append(ready)
    print(f"model: {args.model} (cache: {CACHE_DIR}); medians of {args.runs} runs\n")
    print("| what | seconds (median) | min | max |\n| --- | --- | --- | --- |")
    for label, values in rows:
        print(f"| {label} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
