"""``[model] weights = "q4"`` for any source the compact forward runs: the file's own quantised blocks where the
source is a GGUF that holds them (each type as :mod:`chatd.engine.model.gguf_weights` runs it), otherwise the weights
quantised on load to Q4_1 (token embedding and LM head Q8_0) and cached on disk as a GGUF, so later starts read
the blocks instead of quantising again.

Quantising is lossy: the load log and ``/admin/stats`` (``model.weights_from``) say so, and
``python -m benchmarks.quality`` measures the agreement with the unquantised forward.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from chatd.engine.model.gguf_file import write_gguf
from chatd.engine.model.gguf_weights import Q4_ARCHITECTURES
from chatd.engine.model.packaged import SourceGGUF

log = logging.getLogger(__name__)

UNQUANTISED_TYPES = frozenset({"F32", "F16", "BF16"})  # q4 quantises these on load rather than run them
QUANTISED_VERSION = 1  # bump when the cached file's layout or quantiser changes


def q4_blocks_problem(architecture: str, tensor_types: dict[str, str]) -> str | None:
    """Why a GGUF's own blocks cannot run as ``q4`` (None when they can): a file of an architecture the q4 path
    reads (gguf_weights.Q4_ARCHITECTURES) whose projections are quantised (any ggml block type;
    gguf_weights.read_blocks says per type how it runs). ``tensor_types``: tensor kind -> type names joined by
    ``+`` (:attr:`chatd.engine.model.gguf_file.GGUFSummary.tensor_types`)."""
    if architecture not in Q4_ARCHITECTURES:
        return f"architecture {architecture!r}"
    # Phi-3's files fuse q|k|v (attn_qkv) and gate|up (ffn_up alone); the others keep them apart.
    fused = "attn_qkv" in tensor_types
    kinds = [*(("attn_qkv",) if fused else ("attn_q", "attn_k", "attn_v")), "attn_output",
             *(() if fused and "ffn_gate" not in tensor_types else ("ffn_gate",)), "ffn_up", "ffn_down"]
    for kind in kinds:
        types = set(tensor_types.get(kind, "missing").split("+"))
        if types & UNQUANTISED_TYPES or "missing" in types:
            return f"{kind} is {'+'.join(sorted(types))}"
    return None


def describe_runs_as(file_name: str, runs_as: dict[str, str]) -> str:
    """``weights_from`` for a GGUF's blocks: as they are, or which kinds were repacked or requantised."""
    changed = {kind: how for kind, how in runs_as.items() if not how.endswith(("as it is", "(exact)"))}
    if not changed:
        return f"the blocks of {file_name} as they are"
    lossy = " (lossy)" if any("lossy" in how for how in changed.values()) else ""
    return f"the blocks of {file_name}{lossy}; " + ", ".join(f"{kind} {how}" for kind, how in changed.items())


def runnable_q4_file(source: SourceGGUF | None) -> tuple[Path | None, str]:
    """``(path, why)``: the source GGUF when its blocks run as ``q4``, else ``(None, reason)``."""
    if source is None:
        return None, "the source is not a GGUF file"
    problem = q4_blocks_problem(source.architecture, source.tensor_types)
    return (source.path, "") if problem is None else (None, problem)


def quantised_q4_file(model: Any, data_dir: Path, weights_hash: str) -> Path:
    """The model's weights as Q4_1 projections with a Q8_0 embedding and head, written once per weights under
    ``data_dir/models`` (a GGUF in llama.cpp's layout, read back like any other)."""
    target = data_dir / "models" / f"q4_1-v{QUANTISED_VERSION}-{weights_hash[:16]}.gguf"
    if target.exists():
        return target
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(model, target, "Q4_1")
    log.info("quantised the weights to Q4_1 (Q8_0 embedding) in %.1f s, cached at %s (lossy: "
             "python -m benchmarks.quality measures the agreement)", time.monotonic() - started, target)
    return target
