"""The benchmark suite's quick mode runs to the end and writes a complete report.

This checks completeness, never speed: every figure is present and succeeded, every number in the
JSON is finite, the machine / software / model / dtype / device fields are there, the correctness
checks the suite makes while measuring (bit-exact restores, lossless codec round trips) held, and
the Markdown has every figure and the peer line. Timings vary with the machine and are not asserted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.common import FIGURE_KEYS, PLANS, ROOT
from chatd.engine.kernels.cpu import cpu_features

pytestmark = pytest.mark.real_model


def _numbers(value: Any, path: str = "$") -> Iterator[tuple[str, float]]:
    """Every int/float in a JSON value, with its path (booleans are not numbers here)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{path}[{index}]")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, str]:
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ)
    env.pop("LLAMA_SERVER", None)  # the peer section must say it was skipped, and why
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-6000:]}"
    report = json.loads((out / "results.json").read_text())
    return report, (out / "results.md").read_text(), done.stdout


@pytest.mark.timeout(1600)
def test_quick_report_is_complete(quick_run: tuple[dict[str, Any], str, str]) -> None:
    report, _, _ = quick_run
    assert report["complete"] is True
    assert report["mode"] == "quick"
    assert report["failed"] == []
    machine = report["machine"]
    assert machine["cpu_model"] and machine["cpu_cores"] > 0 and machine["ram_bytes"] > 0
    assert machine["cpu_features"] == cpu_features().describe()
    software = report["software"]
    for name in ("python", "torch", "transformers", "numpy", "zstandard", "chatd"):
        assert software[name], name
    model = report["model"]
    for name in ("name", "dtype", "device"):
        assert model[name], name
    assert model["kv_bytes_per_token"] > 0
    settings = report["settings"]
    assert settings["device"] == "cpu" and settings["dtype"]
    assert settings["torch_threads"] >= 1 and "threads" in settings

    assert set(FIGURE_KEYS) <= set(report["figures"])
    for key in FIGURE_KEYS:
        fig = report["figures"][key]
        assert fig["status"] == "ok", (key, fig.get("error"))
        assert fig["title"] and fig["measures"], key
        assert fig["rows"], key
        assert fig["headline"], key
        for row in fig["rows"]:
            missing = [c["key"] for c in fig["columns"] if c["key"] not in row]
            assert not missing, (key, missing)

    not_finite = [(path, value) for path, value in _numbers(report) if not math.isfinite(value)]
    assert not not_finite, not_finite


@pytest.mark.timeout(1600)
def test_quick_report_correctness_checks(quick_run: tuple[dict[str, Any], str, str]) -> None:
    figures = quick_run[0]["figures"]
    restore = figures["restore_vs_prefill"]
    assert [r["tokens"] for r in restore["rows"]] == list(PLANS["quick"].restore_tokens)
    assert all(r["bit_exact"] for r in restore["rows"])
    codecs = figures["snapshot_codecs"]["rows"]
    lossless = [r for r in codecs if r["stored_dtype"] == quick_run[0]["model"]["dtype"]]
    assert lossless and all(r["lossless"] and r["max_rel_error"] == 0 for r in lossless)
    assert {r["codec"] for r in codecs} == {"chatd", "plain zstd"}
    assert {r["level"] for r in codecs} == {1, 3, 9}
    for row in figures["ttft_vs_history"]["rows"]:
        # The kept session reuses its history; the twin recomputes all of it.
        assert row["kept_cached_tokens"] > 0 and row["recompute_cached_tokens"] == 0
        assert row["direct_ms"] > 0 and row["recompute_vs_direct"] > 0
    shared = figures["shared_prefix"]["rows"]
    assert [r["sessions"] for r in shared] == list(PLANS["quick"].shared_prefix_sessions)
    for row in shared[1:]:
        # Every later session starts from the shared system prompt instead of prefilling it.
        assert row["prefix_shares"] == row["sessions"] - 1
        assert row["later_cached_tokens"] >= 0.9 * PLANS["quick"].shared_prefix_tokens
        # The prompt's blocks are held once: N sessions take far less than N times one session's KV.
        assert row["kv_vs_one"] < 0.25 * row["sessions"]
    memory = figures["memory"]["rows"][0]
    assert memory["evictions"] > 0 and memory["restores"] > 0 and memory["within_budget"]
    assert [r["clients"] for r in figures["concurrency"]["rows"]] == [1, 4, 8, 16]


@pytest.mark.timeout(1600)
def test_quick_markdown_has_every_figure_and_the_peer_line(quick_run: tuple[dict[str, Any], str, str]) -> None:
    report, markdown, stdout = quick_run
    for key in FIGURE_KEYS:
        assert report["figures"][key]["title"] in markdown, key
    assert "peer: skipped, LLAMA_SERVER not set" in markdown
    assert report["peer"] == {"status": "skipped", "reason": "LLAMA_SERVER not set"}
    for fact in (report["machine"]["cpu_model"], report["software"]["torch"], report["model"]["name"]):
        assert fact in markdown
    assert markdown.strip() in stdout  # the Markdown is also printed at the end


def test_plans_name_every_mode() -> None:
    from benchmarks.common import plan_for

    assert plan_for("quick", "cpu") is PLANS["quick"]
    assert plan_for("quick", "cuda") is PLANS["quick-cuda"]
    assert plan_for("full", "cpu") is PLANS["full"]
    assert Path(ROOT / "benchmarks" / "gpu.sh").stat().st_mode & 0o111
