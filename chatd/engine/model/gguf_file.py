"""A GGUF file as a model: what it holds, how it is identified, and a writer for the compact forward's architectures.

Reading and writing go through the maintained ``gguf`` package. A GGUF stores each matrix as ggml blocks of one
quantisation type; :func:`describe_gguf` names the type per tensor kind (``attn_q``, ``ffn_down``,
``token_embd``...) without reading the weights. :func:`write_gguf` writes a transformers model (Llama, Mistral,
Qwen2, Qwen3, Phi-3, Gemma 2 and 3) in llama.cpp's layout for its architecture with the matrices in one type:
chatd caches the weights it quantises on load this way (:mod:`chatd.engine.model.quantise`), and the tests write
their tiny checkpoints with it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from chatd.engine.model.rope import rope_freq_factors

# The matrix types write_gguf can produce (the ``gguf`` package quantises these in numpy).
WRITABLE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
_BLOCK_KIND = re.compile(r"^blk\.\d+\.(.+)\.(weight|bias)$")


def tensor_kind(name: str) -> str:
    """A tensor's kind, the same in every layer: ``blk.3.attn_q.weight`` -> ``attn_q``,
    ``blk.3.attn_q.bias`` -> ``attn_q.bias``, ``token_embd.weight`` -> ``token_embd``."""
    found = _BLOCK_KIND.match(name)
    if found:
        return found.group(1) + (".bias" if found.group(2) == "bias" else "")
    return name.removesuffix(".weight")


def file_identity(path: Path) -> str:
    """A hex digest naming a model file: its size and its first, middle and last MiB. A full hash of a
    multi-GB file at every start is not worth it; a file replaced in place changes these."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(f"{size}".encode())
    chunk = 1 << 20
    with path.open("rb") as f:
        for offset in (0, max(0, size // 2 - chunk // 2), max(0, size - chunk)):
            f.seek(offset)
            digest.update(f.read(chunk))
    return digest.hexdigest()


@dataclass(frozen=True)
class GGUFSummary:
    """What a GGUF file holds, from its metadata and tensor headers (no weights read)."""

    path: Path
    architecture: str
    name: str
    parameters: int
    file_bytes: int
    context_length: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tensor_types: dict[str, str] = field(default_factory=dict)
    """Tensor kind -> its ggml type name; kinds whose layers differ list each type, joined by ``+``."""
    has_chat_template: bool = False

    def matrix_types(self) -> set[str]:
        """The types of the two-dimensional weights (norms and biases left out)."""
        return {t for kind, types in self.tensor_types.items() if not is_vector_kind(kind)
                for t in types.split("+")}


def is_vector_kind(kind: str) -> bool:
    return kind.endswith(("norm", ".bias")) or "norm" in kind.split("_")


def metadata(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value of a GGUF (``default`` when the file lacks the key)."""
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def describe_gguf(path: str | Path) -> GGUFSummary:
    """Read a GGUF's metadata and tensor headers. Raises ValueError for a file that is not a GGUF."""
    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    arch = str(metadata(reader, "general.architecture", "unknown"))

    def arch_int(key: str, default: int = 0) -> int:
        value = metadata(reader, f"{arch}.{key}")
        return default if value is None else int(value)

    hidden = arch_int("embedding_length")
    heads = arch_int("attention.head_count")
    kinds: dict[str, list[str]] = {}
    parameters = 0
    for tensor in reader.tensors:
        parameters += int(tensor.n_elements)
        seen = kinds.setdefault(tensor_kind(tensor.name), [])
        type_name = tensor.tensor_type.name
        if type_name not in seen:
            seen.append(type_name)
    vocab = metadata(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(metadata(reader, "tokenizer.ggml.tokens", []) or [])
    head_dim = arch_int("attention.key_length") or arch_int("rope.dimension_count") or (hidden // heads if heads else 0)
    return GGUFSummary(
        path=path, architecture=arch, name=str(metadata(reader, "general.name", path.stem)),
        parameters=parameters, file_bytes=path.stat().st_size, context_length=arch_int("context_length"),
        num_layers=arch_int("block_count"), hidden_size=hidden, num_heads=heads,
        num_kv_heads=arch_int("attention.head_count_kv", heads), head_dim=head_dim, vocab_size=int(vocab),
        tensor_types={kind: "+".join(types) for kind, types in sorted(kinds.items())},
        has_chat_template=bool(metadata(reader, "tokenizer.chat_template")),
    )


def _llama_rows(num_heads: int, head_dim: int) -> torch.Tensor:
    """For each row of a Q or K projection in llama.cpp's layout (each head's rotating pairs interleaved), the
    row of transformers' layout (the pairs' halves apart) it holds."""
    rows = torch.arange(num_heads * head_dim).view(num_heads, 2, head_dim // 2)
    return rows.transpose(1, 2).reshape(-1)


def _encode(values: torch.Tensor, type_name: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    kind = gguf.GGMLQuantizationType[type_name]
    array = values.detach().to(torch.float32).contiguous().numpy()
    if kind == gguf.GGMLQuantizationType.F32:
        return array, kind
    if kind == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), kind
    return gguf.quants.quantize(array, kind), kind


Encoder = Callable[[np.ndarray], np.ndarray]


# transformers model type -> the GGUF architecture write_gguf writes it as (llama.cpp's names).
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                      "gemma2": "gemma2", "gemma3_text": "gemma3"}


def write_gguf(model: Any, path: Path, matrix_type: str, *, embedding_type: str | None = None,
               tokenizer_from: Path | None = None, name: str | None = None,
               encoders: dict[str, Encoder] | None = None, kind_types: dict[str, str] | None = None) -> None:
    """Write a transformers causal LM of a type in GGUF_ARCHITECTURES as llama.cpp lays that architecture out
    (tensor names from the ``gguf`` package's map; Llama's Q and K rows interleaved per head for RoPE; Gemma's
    norms stored as ``1 + weight``; Llama 3's RoPE scaling as a ``rope_freqs`` tensor, other scalings as metadata),
    with every projection in ``matrix_type`` (one of WRITABLE_TYPES), the token embedding (and a separate LM head)
    in ``embedding_type`` (default: Q8_0 for quantised matrices, else ``matrix_type``) and the vectors (norms,
    biases) in F32. ``tokenizer_from``: a GGUF whose ``tokenizer.*`` metadata (vocabulary, merges, special tokens,
    chat template) is copied. ``encoders``: more types, each an fp32 ``[N, K]`` -> block bytes ``[N, ...]``
    function (the tests' K-quants). ``kind_types``: the type of some tensor kinds (``attn_v``, ``output``...) where
    it differs, as in the mixed files llama.cpp's quantiser makes (Q4_K_M keeps ``attn_v`` and ``ffn_down`` in
    Q6_K). Written to a temporary name and renamed into place. ValueError for another model type."""
    encoders = encoders or {}
    if matrix_type not in WRITABLE_TYPES and matrix_type not in encoders:
        raise ValueError(f"cannot write {matrix_type!r} matrices; one of {', '.join(WRITABLE_TYPES)}")
    embedding_type = embedding_type or (matrix_type if matrix_type in ("F32", "F16", "BF16") else "Q8_0")
    config = model.config
    arch = GGUF_ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ValueError(f"cannot write a {config.model_type!r} model as a GGUF")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params.get("full_attention"), dict):  # Gemma 3: the global layers' RoPE (the local one is fixed)
        params = params["full_attention"]
    gemma = arch.startswith("gemma")
    tmp = path.with_name(f".{path.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_name(name or str(getattr(config, "name_or_path", "") or path.stem))
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "sliding_window", None) and arch != "llama":
        writer.add_sliding_window(int(config.sliding_window))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    rope_type = params.get("rope_type", "default")
    if arch != "llama" and rope_type in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_type))
        writer.add_rope_scaling_factor(float(params["factor"]))
        if params.get("original_max_position_embeddings"):
            writer.add_rope_scaling_orig_ctx_len(int(params["original_max_position_embeddings"]))
    elif arch != "llama" and rope_type != "default":
        raise ValueError(f"cannot write RoPE type {rope_type!r} for a {arch} GGUF")
    if tokenizer_from is not None:
        _copy_tokenizer(gguf.GGUFReader(str(tokenizer_from)), writer)

    def put(tensor_name: str, values: torch.Tensor, type_name: str) -> None:
        type_name = (kind_types or {}).get(tensor_kind(tensor_name), type_name)
        if type_name in encoders:
            array = values.detach().to(torch.float32).contiguous().numpy()
            data, kind = encoders[type_name](array), gguf.GGMLQuantizationType[type_name]
        else:
            data, kind = _encode(values, type_name)
        writer.add_tensor(tensor_name, data, raw_dtype=kind)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    for hf_name, values in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        base, _, suffix = hf_name.rpartition(".")
        found = names.get_name(base)
        if found is None:
            raise ValueError(f"{hf_name}: no GGUF name for it in a {arch} file")
        tensor_name = f"{found}.{suffix}"
        kind = tensor_kind(tensor_name)
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            values = values.index_select(0, _llama_rows(heads if kind == "attn_q" else kv_heads, head_dim))
        if values.dim() == 1:
            put(tensor_name, values.float() + 1.0 if gemma and "norm" in kind else values, "F32")
        else:
            put(tensor_name, values, embedding_type if kind in ("token_embd", "output") else matrix_type)
    factors = rope_freq_factors(config) if arch == "llama" else None
    if factors is not None:  # as llama.cpp's converter writes Llama 3's scaling
        writer.add_tensor("rope_freqs.weight", factors.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)


def _copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for key, found in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(found.types[0])
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, list(found.contents()))
        else:
            writer.add_key_value(key, found.contents(), vtype)
