"""Shared fixtures: model runners (tiny random-init and the real packaged model) and a running core."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from chatd import config
from chatd.config import ModelSettings, Settings
from chatd.engine.model.runner import ModelRunner
from chatd.service.core import Chatd
from tests import support


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return support.tiny_model_dir()


@pytest.fixture(scope="session")
def real_dir() -> Path:
    return support.packaged_model_dir()


@pytest.fixture(scope="session")
def tiny_runner(tiny_dir: Path) -> ModelRunner:
    return ModelRunner.load(ModelSettings(source=str(tiny_dir), threads=1), tiny_dir)


@pytest.fixture(scope="session")
def real_runner(real_dir: Path) -> ModelRunner:
    # float32: the tests compare greedy replies with transformers' own forward token for token.
    return ModelRunner.load(ModelSettings(source=str(real_dir), weights="float32"), real_dir)


@pytest.fixture(scope="session")
def real_reference(real_dir: Path) -> torch.nn.Module:
    """The real model loaded plainly by transformers (default attention), for from-scratch references."""
    return AutoModelForCausalLM.from_pretrained(real_dir, dtype=torch.float32).eval()


@pytest.fixture
def make_settings(tmp_path: Path) -> Callable[..., Settings]:
    def make(model_dir: Path, **sections: dict[str, Any]) -> Settings:
        overrides: dict[str, Any] = {"data_dir": str(tmp_path / "data")}
        overrides["model"] = {"source": str(model_dir), **sections.pop("model", {})}
        overrides["cache"] = {"persist_idle_s": 0, "idle_evict_s": 0, **sections.pop("cache", {})}
        overrides.update(sections)
        return config.load(env={}, overrides=overrides)
    return make


@pytest.fixture
async def tiny_core(make_settings: Callable[..., Settings], tiny_dir: Path,
                    tiny_runner: ModelRunner) -> AsyncIterator[Chatd]:
    async with Chatd.open(make_settings(tiny_dir), runner=tiny_runner, background=False) as core:
        yield core


@pytest.fixture
async def real_core(make_settings: Callable[..., Settings], real_dir: Path,
                    real_runner: ModelRunner) -> AsyncIterator[Chatd]:
    async with Chatd.open(make_settings(real_dir), runner=real_runner, background=False) as core:
        yield core


# ----------------------------------------------------------------------------- the reliability suite


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="reliability suite at full size (10,000+ fuzzed frames, more kills, races and cycles); "
                          "CHATD_RELIABILITY_LONG=1 does the same")


@pytest.fixture(scope="session")
def long_mode(request: pytest.FixtureRequest) -> bool:
    """True when the reliability suite runs at full size (``--long`` or CHATD_RELIABILITY_LONG=1)."""
    return bool(request.config.getoption("--long")) or os.environ.get("CHATD_RELIABILITY_LONG", "") not in ("", "0")


@pytest.fixture(scope="session")
def figures() -> Callable[..., None]:
    """Record a reliability figure: ``figures("fuzz", frames=2000, internal=0)``. With CHATD_RELIABILITY_FIGURES
    set to a path, each call appends one JSON line there (docs/reliability.md's table comes from them)."""
    path = os.environ.get("CHATD_RELIABILITY_FIGURES")

    def record(name: str, **values: object) -> None:
        line = json.dumps({"test": name, **values})
        print(f"reliability figures: {line}")
        if path:
            with open(path, "a", encoding="utf-8") as out:
                out.write(line + "\n")
    return record


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    """torch (and the native kernels, which take its thread count) on 2 threads for the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
