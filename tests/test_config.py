"""Settings: defaults, the shipped config.toml, env overrides, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatd import config
from chatd.errors import ConfigError
from tests.support import ROOT


def test_shipped_config_equals_the_defaults() -> None:
    shipped = config.load(ROOT / "config.toml", env={})
    defaults = config.load(env={})
    assert shipped.model_dump(exclude={"base_dir"}) == defaults.model_dump(exclude={"base_dir"})


def test_env_overrides_and_paths(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text('data_dir = "state"\n[server]\nport = 9000\n')
    s = config.load(tmp_path / "c.toml", env={"CHATD_SERVER__PORT": "9100", "CHATD_SERVER__API_KEYS": '["a", "b"]',
                                             "CHATD_CACHE__DEVICE_BUDGET_MB": "64", "CHATD_LOG_LEVEL": "debug",
                                             "CHATD_TEST_CACHE": "/not/a/setting"})
    assert s.server.port == 9100 and s.server.api_keys == ["a", "b"] and s.cache.device_budget_mb == 64
    assert s.log_level == "debug"
    assert s.data_path == tmp_path / "state"  # relative to the config file, not the working directory
    assert s.snapshot_path == tmp_path / "state" / "snapshots"
    assert s.store_url == f"sqlite+aiosqlite:///{tmp_path / 'state' / 'chatd.db'}"


@pytest.mark.parametrize(("text", "env", "needle"), [
    ("[server]\nprot = 1\n", {}, "server.prot"),
    ("[server]\nport = 70000\n", {}, "server.port"),
    ("[server]\nallowed_hosts = [\"evil.example; x\"]\n", {}, "server.allowed_hosts"),
    ("[server]\nallowed_hosts = [\"http://chat.example\"]\n", {}, "server.allowed_hosts"),
    ("[cache]\ndevice_budget_mb = -1\n", {}, "cache.device_budget_mb"),
    ("[model]\ndevice = \"tpu\"\n", {}, "model.device"),
    ("[model]\ndtype = \"int4\"\n", {}, "model.dtype"),
    ("[cache]\nzstd_level = \"fast\"\n", {}, "cache.zstd_level"),
    ("[cache]\nzstd_level = 23\n", {}, "cache.zstd_level"),
    ("[server\n", {}, "cannot read config file"),
    ("", {"CHATD_SERVER__PROT": "1"}, "server.prot"),
    ("", {"CHATD_SERVR__PORT": "8001"}, "CHATD_SERVR__PORT: there is no [servr] section"),
    ("", {"CHATD_SERVER__LOG_FORMAT": "xml"}, "server.log_format"),
])
def test_bad_settings_are_refused_with_the_key(tmp_path: Path, text: str, env: dict[str, str], needle: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        config.load(path, env=env)
    assert needle in info.value.message


def test_an_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        config.load(tmp_path / "missing.toml", env={})
