"""Shared pieces of the benchmark suite: run plans, the run context, figure records, machine facts,
timers and the text the figures feed the model.

Every figure is a :class:`Figure`: a table of rows (raw numbers, never pre-formatted), a few headline
values for the summary table, and notes. Figures compare two things measured in the same run on the
same machine, so the ratios stay meaningful on a noisy machine where absolute times do not.
"""

from __future__ import annotations

import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatd.engine.kernels.cpu import cpu_features

if TYPE_CHECKING:
    import torch

    from chatd.config import Settings
    from chatd.engine.model.runner import ModelRunner
    from chatd.service.core import Chatd

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_VERSION = 1

# The figures of a complete run, in report order. tests/test_benchmarks.py checks this list.
FIGURE_KEYS = (
    "restore_vs_prefill",
    "snapshot_codecs",
    "ttft_vs_history",
    "edit_cost",
    "decode_overhead",
    "concurrency",
    "memory",
    "shared_prefix",
    "openai_resend",
)


# ----------------------------------------------------------------------------- plans


@asynccontextmanager
async def open_chatd(settings: Settings, runner: ModelRunner) -> AsyncIterator[Chatd]:
    """An in-process chatd over the run's loaded model (no background maintenance), yielded once the KV pool it
    gets is faulted in: timings taken in it do not share the cores with that thread (a new pool of a few GB
    takes seconds to populate on two cores, and a first turn beside it ran several times slower)."""
    import asyncio

    from chatd.service.core import Chatd

    async with Chatd.open(settings, runner=runner, background=False) as core:
        await asyncio.to_thread(core.kv.pool.wait_populated)
        yield core


@dataclass(frozen=True)
class Plan:
    """How big each figure's workload is. One plan per mode (and device)."""

    name: str
    restore_tokens: tuple[int, ...]
    """Cache lengths for restore vs re-prefill."""
    codec_tokens: int
    """Length of the real KV cache the codec settings are measured on."""
    zstd_levels: tuple[int, ...]
    repeats: int
    """Timed repetitions where a measurement is cheap enough to repeat (the median is reported)."""
    history_tokens: tuple[int, ...]
    """History lengths at which a turn's time to first token is measured."""
    reply_tokens: int
    """max_tokens of every turn in the conversation figures (greedy)."""
    edit_messages: int
    edit_history_tokens: int
    decode_tokens: int
    decode_runs: int
    concurrency: tuple[int, ...]
    concurrency_tokens: int
    concurrency_min_samples: int
    """Rounds are repeated until each level has at least this many TTFT samples."""
    memory_model: str
    """"tiny" (random-init 2-layer model with the real tokenizer) or "real"."""
    memory_sessions: int
    memory_turns: int
    memory_budget_tokens: int
    memory_parallel: int
    peer_turns: int
    shared_prefix_sessions: tuple[int, ...] = (1, 10, 100)
    """Session counts for the shared-system-prompt figure (each its own run)."""
    shared_prefix_tokens: int = 1000


PLANS: dict[str, Plan] = {
    "quick": Plan(
        name="quick", restore_tokens=(256, 512, 1024, 2048, 4096), codec_tokens=2048, zstd_levels=(1, 3, 9), repeats=3,
        history_tokens=(256, 512, 1024, 2048), reply_tokens=8, edit_messages=8, edit_history_tokens=2048,
        decode_tokens=256, decode_runs=5, concurrency=(1, 4, 8, 16), concurrency_tokens=32,
        concurrency_min_samples=4, memory_model="tiny", memory_sessions=100, memory_turns=2,
        memory_budget_tokens=1600, memory_parallel=4, peer_turns=4,
    ),
    "full": Plan(
        name="full", restore_tokens=(256, 512, 1024, 2048, 4096, 8192), codec_tokens=2048, zstd_levels=(1, 3, 9),
        repeats=5,
        history_tokens=(256, 512, 1024, 2048, 4096, 8000), reply_tokens=16, edit_messages=8,
        edit_history_tokens=2048, decode_tokens=256, decode_runs=5, concurrency=(1, 4, 8, 16), concurrency_tokens=32,
        concurrency_min_samples=16, memory_model="real", memory_sessions=100, memory_turns=3,
        memory_budget_tokens=2400, memory_parallel=4, peer_turns=6, shared_prefix_sessions=(1, 10, 100),
    ),
    # The quick suite sized for a GPU (benchmarks/gpu.sh): larger caches, more clients, the real model
    # for the memory workload; it must finish well inside 8 minutes on one GPU.
    "quick-cuda": Plan(
        name="quick-cuda", restore_tokens=(512, 2048, 4096, 8192), codec_tokens=4096, zstd_levels=(1, 3, 9),
        repeats=5, history_tokens=(256, 512, 1024, 2048, 4096, 8000), reply_tokens=16, edit_messages=8,
        edit_history_tokens=4096, decode_tokens=128, decode_runs=3, concurrency=(1, 4, 8, 16, 32),
        concurrency_tokens=32, concurrency_min_samples=8, memory_model="real", memory_sessions=100,
        memory_turns=2, memory_budget_tokens=2400, memory_parallel=8, peer_turns=6,
        shared_prefix_sessions=(1, 10, 100),
    ),
}


def plan_for(mode: str, device: str) -> Plan:
    if mode == "quick" and device == "cuda":
        return PLANS["quick-cuda"]
    return PLANS[mode]


# ----------------------------------------------------------------------------- figures


@dataclass
class Column:
    key: str
    header: str
    fmt: str = "{}"


@dataclass
class Figure:
    """One figure: what it measures, its table, headline values and notes."""

    key: str
    title: str
    measures: str
    columns: list[Column] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    headline: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    status: str = "ok"
    error: str = ""
    elapsed_s: float = 0.0

    def add_headline(self, label: str, value: float, fmt: str) -> None:
        self.headline.append({"label": label, "value": value, "fmt": fmt})

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "title": self.title, "measures": self.measures, "status": self.status,
            "elapsed_s": round(self.elapsed_s, 3),
            "columns": [{"key": c.key, "header": c.header} for c in self.columns],
            "rows": self.rows, "headline": [{"label": h["label"], "value": h["value"]} for h in self.headline],
            "summary": self.summary, "notes": self.notes,
        }
        if self.error:
            data["error"] = self.error
        return data


# ----------------------------------------------------------------------------- run context


@dataclass
class Bench:
    """Everything a figure needs: the plan, the device, the thread setting and a shared model runner."""

    plan: Plan
    mode: str
    device: str
    dtype: str
    threads: int
    out_dir: Path
    scratch: Path
    llama_server: str | None
    log: Callable[[str], None]
    _runner: ModelRunner | None = None
    results: dict[str, Figure] = field(default_factory=dict)
    on_figure: Callable[[], None] = lambda: None
    """Called after each figure (the suite writes partial results there)."""

    def model_dir(self) -> Path:
        from devtools.models import packaged_model_dir

        return packaged_model_dir()

    def runner(self) -> ModelRunner:
        """The packaged model, loaded once per run with the run's device, dtype and threads."""
        if self._runner is None:
            from chatd.config import ModelSettings
            from chatd.engine.model.runner import ModelRunner

            folder = self.model_dir()
            self._runner = ModelRunner.load(
                ModelSettings(source=str(folder), device=self.device, dtype=self.dtype,  # type: ignore[arg-type]
                              threads=self.threads), folder)
            self._runner.pool.wait_populated()  # timed steps do not share the cores with it
        return self._runner

    def model_settings(self) -> dict[str, Any]:
        """The [model] section every chatd instance of this run gets (in-process and servers alike)."""
        return {"source": str(self.model_dir()), "device": self.device, "dtype": self.dtype, "threads": self.threads}

    def sync(self) -> None:
        """Wait for queued device work, so a timer reads finished work (no-op on the CPU)."""
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def subdir(self, name: str) -> Path:
        path = self.scratch / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path


# ----------------------------------------------------------------------------- timing and statistics


@contextmanager
def timed(bench: Bench | None = None) -> Iterator[list[float]]:
    """``with timed(bench) as t: ...`` then ``t[0]`` is the elapsed seconds (device work included)."""
    box: list[float] = []
    if bench is not None:
        bench.sync()
    started = time.perf_counter()
    try:
        yield box
    finally:
        if bench is not None:
            bench.sync()
        box.append(time.perf_counter() - started)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), as numpy's default."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, guarded so a zero or negative time never yields inf/NaN."""
    return numerator / max(denominator, 1e-9)


MB = 1e6  # throughputs are in decimal MB/s


# ----------------------------------------------------------------------------- text fed to the model


def corpus_text() -> str:
    """Real English and code text: the project's own documentation, configuration and sources, in a
    fixed order (prose first). Deterministic for a given checkout."""
    parts: list[Path] = sorted((ROOT / "docs").glob("*.md"))
    parts = [p for p in parts if p.name != "performance.md"]  # our own output would feed back into runs
    parts.append(ROOT / "config.toml")
    parts.extend(sorted((ROOT / "chatd").rglob("*.py")))
    return "\n\n".join(p.read_text(encoding="utf-8") for p in parts if p.is_file())


class Corpus:
    """Token ids of :func:`corpus_text` and text pieces of a chosen token length."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(tokenizer(corpus_text(), add_special_tokens=False).input_ids)
        self._cursor = 0

    def token_ids(self, n: int, offset: int = 0) -> list[int]:
        """``n`` ids starting at ``offset``, wrapping around when the corpus is shorter."""
        out: list[int] = []
        pos = offset % len(self.ids)
        while len(out) < n:
            take = min(n - len(out), len(self.ids) - pos)
            out.extend(self.ids[pos : pos + take])
            pos = 0
        return out

    def text(self, n: int) -> str:
        """The next ~``n`` tokens of text (consecutive calls continue where the last stopped), cut at
        a line break where one is near so messages read naturally."""
        ids = self.token_ids(n, self._cursor)
        self._cursor += n
        text: str = self.tokenizer.decode(ids)
        cut = text.rfind("\n", int(len(text) * 0.9))
        return (text[:cut] if cut > 0 else text).strip() or text


# ----------------------------------------------------------------------------- machine facts


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int:
    try:
        match = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
        if match:
            return int(match.group(1)) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_features": cpu_features().describe(),
        "cpu_cores": os.cpu_count() or 0,
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_bytes": _ram_bytes(),
        "platform": platform.platform(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else 0.0,
        "gpu": "",
    }
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_bytes"] = int(props.total_memory)
    return info


def software_info() -> dict[str, str]:
    import numpy
    import torch
    import transformers
    import zstandard

    import chatd

    return {
        "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
        "numpy": numpy.__version__, "zstandard": zstandard.__version__, "chatd": chatd.__version__,
        "cuda": str(torch.version.cuda or ""), "git_commit": _git_commit(),
    }


def model_info(runner: ModelRunner) -> dict[str, Any]:
    info = runner.info
    return {
        "name": info.name, "weights_hash": info.weights_hash[:16], "dtype": info.dtype_name,
        "device": str(info.device), "num_layers": info.num_layers, "num_kv_heads": info.num_kv_heads,
        "head_dim": info.head_dim, "kv_bytes_per_token": info.bytes_per_token, "max_context": info.max_context,
        "load_s": round(info.load_s, 3),
        "parameters": sum(p.numel() for p in runner.model.parameters()),
    }


# ----------------------------------------------------------------------------- process memory


def proc_status_bytes(field_name: str, pid: int | str = "self") -> int:
    """A ``kB`` field of /proc/<pid>/status (VmRSS, VmHWM) in bytes; 0 where unavailable."""
    try:
        match = re.search(rf"^{field_name}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return 0
    return int(match.group(1)) * 1024 if match else 0


def peak_rss_bytes() -> int:
    """Peak resident set of this process: VmHWM, else getrusage's ru_maxrss (kB on Linux)."""
    peak = proc_status_bytes("VmHWM")
    if peak:
        return peak
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def tensors_equal(a: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  b: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Bit-exact equality of two per-layer (K, V) lists."""
    import torch

    return len(a) == len(b) and all(
        torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va), (kb, vb) in zip(a, b, strict=True))
