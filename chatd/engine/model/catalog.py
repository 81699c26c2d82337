"""What a model source holds, without loading it: ``chatd models`` prints this for the configured source.

A GGUF file (or ``packaged``, the packaged GGUF) is read through its metadata and tensor headers; a transformers
folder through its ``config.json`` and the safetensors headers. Both give the architecture, the parameter count,
the context length, the quantisation (or dtype) per tensor kind, the KV bytes per token at each KV dtype, and
whether the compact forward runs it.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chatd.engine.model.gguf_file import describe_gguf
from chatd.engine.model.gguf_file import is_vector_kind as _vector_kind
from chatd.engine.model.gguf_weights import how_type_runs
from chatd.engine.model.packaged import PACKAGED_GGUF, packaged_model_dir
from chatd.engine.model.quantise import q4_blocks_problem
from chatd.engine.model.weights import LlamaShape
from chatd.engine.pool.paged import kv_bytes_per_token

KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
_HF_LAYER = re.compile(r"^(?:model\.)?layers\.\d+\.(.+?)(?:\.weight)?$")
_ARCHITECTURES = {"llama": "llama"}  # GGUF architecture -> transformers model_type the compact forward runs


@dataclass(frozen=True)
class SourceFacts:
    """A model source as ``chatd models`` reports it."""

    source: str
    path: str
    format: str
    """``gguf`` or ``transformers``."""
    architecture: str
    name: str
    parameters: int
    context_length: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tensor_types: dict[str, str] = field(default_factory=dict)
    compact_forward: str | None = None
    """None when the compact forward runs the model, else why it does not (transformers' forward runs it)."""
    q4_blocks: str | None = None
    """GGUF only: None when ``weights = "q4"`` runs the file's blocks as they are, else why it quantises on load."""

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return kv_bytes_per_token(dtype, self.num_layers, self.num_kv_heads, self.head_dim)

    def q4_runs_as(self) -> dict[str, str]:
        """GGUF only: each quantised matrix kind -> how ``weights = "q4"`` runs its blocks."""
        def how(kind: str, type_name: str) -> str:
            if kind in ("token_embd", "output") and type_name in ("Q4_0", "Q4_1", "Q4_K"):
                return f"{type_name} requantised to Q8_0 (lossy)"  # the row lookup and the head run Q8_0
            return f"{type_name} {how_type_runs(type_name)}"

        return {kind: "; ".join(how(kind, t) for t in types.split("+"))
                for kind, types in self.tensor_types.items() if self.format == "gguf" and not _vector_kind(kind)}

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source, "path": self.path, "format": self.format, "architecture": self.architecture,
            "name": self.name, "parameters": self.parameters, "context_length": self.context_length,
            "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "tensor_types": dict(self.tensor_types),
            "kv_bytes_per_token": {str(d).removeprefix("torch."): self.kv_bytes_per_token(d) for d in KV_DTYPES},
            "compact_forward": self.compact_forward is None, "compact_forward_why_not": self.compact_forward,
            "q4_blocks_as_they_are": self.format == "gguf" and self.q4_blocks is None,
            "q4_why_quantised": self.q4_blocks,
            "q4_runs_as": self.q4_runs_as() if self.q4_blocks is None else {},
        }

    def describe(self) -> str:
        """Human-readable lines."""
        kv = ", ".join(f"{str(d).removeprefix('torch.')} {self.kv_bytes_per_token(d):,} B"
                       for d in KV_DTYPES)
        lines = [
            f"{self.name}  ({self.format}, {self.path})",
            f"  architecture     {self.architecture}",
            f"  parameters       {self.parameters:,}",
            f"  context          {self.context_length:,} tokens",
            f"  KV per token     {kv}",
            "  compact forward  " + ("yes" if self.compact_forward is None
                                    else f"no ({self.compact_forward}): transformers' forward runs it"),
        ]
        if self.format == "gguf" and self.q4_blocks is None:
            lines.append("  weights = q4     runs the file's blocks:")
            lines.extend(f"    {kind:<15}{how}" for kind, how in self.q4_runs_as().items())
        elif self.format == "gguf":
            lines.append(f"  weights = q4     quantises on load ({self.q4_blocks})")
        lines.append("  tensors          " + ", ".join(f"{k} {t}" for k, t in self.tensor_types.items()))
        return "\n".join(lines)


def describe_source(source: str) -> SourceFacts:
    """The facts of ``[model] source``: ``packaged``, a ``.gguf`` file or a transformers folder. Raises
    ValueError for anything else (a hub id is not looked up)."""
    path = packaged_model_dir() / PACKAGED_GGUF if source == "packaged" else Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_facts(source, path)
    if path.is_dir() and (path / "config.json").exists():
        return _folder_facts(source, path)
    raise ValueError(f"{source!r} is not 'packaged', a .gguf file or a transformers model folder")


def _gguf_facts(source: str, path: Path) -> SourceFacts:
    summary = describe_gguf(path)
    why_not = None
    if summary.architecture not in _ARCHITECTURES:
        why_not = f"architecture {summary.architecture!r} is not on the compact forward yet"
    return SourceFacts(
        source=source, path=str(path), format="gguf", architecture=summary.architecture, name=summary.name,
        parameters=summary.parameters, context_length=summary.context_length, num_layers=summary.num_layers,
        num_kv_heads=summary.num_kv_heads, head_dim=summary.head_dim, tensor_types=summary.tensor_types,
        compact_forward=why_not, q4_blocks=q4_blocks_problem(summary.architecture, summary.tensor_types))


def _folder_facts(source: str, folder: Path) -> SourceFacts:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder).get_text_config()
    why_not = None
    try:
        LlamaShape.from_config(config)
    except ValueError as exc:
        why_not = str(exc)
    heads = config.num_attention_heads
    kinds: dict[str, list[str]] = {}
    parameters = 0
    for name, dtype, count in _safetensors_entries(folder):
        parameters += count
        found = _HF_LAYER.match(name)
        kind = found.group(1) if found else name.removesuffix(".weight")
        seen = kinds.setdefault(kind, [])
        if dtype not in seen:
            seen.append(dtype)
    return SourceFacts(
        source=source, path=str(folder), format="transformers", architecture=str(config.model_type),
        name=folder.name, parameters=parameters, context_length=int(getattr(config, "max_position_embeddings", 0)),
        num_layers=config.num_hidden_layers, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        tensor_types={k: "+".join(v) for k, v in sorted(kinds.items())}, compact_forward=why_not)


def _safetensors_entries(folder: Path) -> list[tuple[str, str, int]]:
    """``(name, dtype, element count)`` of every tensor in the folder's safetensors files, from their headers."""
    entries = []
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for size in entry["shape"]:
                count *= int(size)
            entries.append((name, str(entry["dtype"]), count))
    return entries
