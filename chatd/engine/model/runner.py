"""ModelRunner: loads the model and tokenizer, and is the only code that calls the model.

The model runs either as chatd's compact Llama-family forward (chatd/engine/model/forward.py, with weights in
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
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from chatd.config import ModelSettings
from chatd.engine.kernels.cpu import cpu_features
from chatd.engine.kernels.loader import EngineKernels, load_kernels
from chatd.engine.model.choices import (
    compact_forward,
    compact_forward_problem,
    gguf_forward,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
    resolve_weights,
)
from chatd.engine.model.forward import LlamaForward
from chatd.engine.model.gguf_file import GGUF_ARCHITECTURES
from chatd.engine.model.graphs import DecodeGraphs
from chatd.engine.model.hf_forward import ATTN_IMPLEMENTATION, TransformersForward, register_row_attention
from chatd.engine.model.packaged import (
    MODEL_CARD_FILE,
    SourceGGUF,
    convert_gguf_file,
    convert_packaged_model,
    folder_weights_hash,
    source_gguf,
)
from chatd.engine.model.quantise import describe_runs_as, quantised_q4_file, runnable_q4_file
from chatd.engine.pool.hugepages import advise_huge_pages, populate_in_background
from chatd.engine.pool.kvcache import BLOCK_SIZE, KVPool, SessionKV, appending
from chatd.engine.pool.paged import kv_bytes_per_token
from chatd.errors import ConfigError

log = logging.getLogger(__name__)

# KV pool size until the server sets it from [cache] device_budget_mb (scripts and tests that use the runner
# alone). On the CPU the pool's pages are touched only as blocks are first written.
DEFAULT_POOL_MB = 1024


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
    """The CPU features the engine chose its paths by (after ``CHATD_CPU_ISA``'s cap; chatd.engine.kernels.cpu)."""
    kernels: str | None = None
    """The native kernels' tile matmul in use (``amx``, ``avx512-vnni``, ``avx2``), ``none`` where the kernels
    have none, None without native kernels."""
    architecture: str = ""
    """The model type (``llama``, ``qwen2``, ...)."""
    parameters: int = 0
    weights_from: str = "the source's own weights"
    """Where the running weights came from: the source's own, a GGUF's blocks as they are, or quantised on load
    (lossy, said so)."""

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one position over all layers (K and V)."""
        return kv_bytes_per_token(self.dtype, self.num_layers, self.num_kv_heads, self.head_dim)


class ModelRunner:
    """Owns a causal LM and its tokenizer. Not thread-safe: the engine worker is its only caller."""

    def __init__(self, model: Any, tokenizer: PreTrainedTokenizerBase, info: ModelInfo,
                 forward: LlamaForward | None = None, kernels: EngineKernels | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.forward = forward
        self.transformers_forward = TransformersForward(model)
        """transformers' own forward, for steps the compact forward (``forward``, None without one) does not run."""
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
        """Load per ``settings.source``: ``packaged``, a local folder, a ``.gguf`` file, or a hub id.

        Raises ConfigError when the source cannot be found or has no chat template.
        """
        started = time.monotonic()
        hf_logging.disable_progress_bar()
        if settings.threads:
            torch.set_num_threads(settings.threads)
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        given = Path(settings.source).expanduser()
        if settings.source == "packaged":
            folder: str | Path = convert_packaged_model(data_dir)
        elif given.is_dir():
            folder = given
        elif given.is_file() and given.suffix.lower() == ".gguf":
            folder = convert_gguf_file(given, data_dir)
        elif given.exists() or settings.source.startswith((".", "/", "~")) or given.suffix.lower() == ".gguf":
            raise ConfigError(f"model.source {settings.source!r} is not a model folder or a .gguf file")
        else:
            folder = settings.source  # a hub id; needs a reachable hub or a local HF cache
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
            register_row_attention()
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        except OSError as exc:
            raise ConfigError(f"cannot load model {settings.source!r}: {exc}") from exc
        model.to(device=device)  # type: ignore[call-arg]  # transformers' wrapped .to confuses mypy
        model.eval()
        if not tokenizer.chat_template:
            raise ConfigError(f"model {settings.source!r} has no chat template")
        gguf_file: SourceGGUF | None = None
        if isinstance(folder, Path):
            card_path = folder / MODEL_CARD_FILE
            card = json.loads(card_path.read_text()) if card_path.exists() else {}
            name = card.get("name") or folder.name
            weights_hash = card.get("weights_hash") or folder_weights_hash(folder)
            gguf_file = source_gguf(folder, card)
        else:
            name = folder
            weights_hash = hashlib.sha256(model.config.to_json_string().encode()).hexdigest()
        config = model.config.get_text_config()
        features = cpu_features()
        q4_file, not_q4 = runnable_q4_file(gguf_file)
        weights = resolve_weights(settings.weights, device, config, has_gguf=q4_file is not None)
        forward: LlamaForward | None = None
        compact_cpu = weights != "transformers" and device.type == "cpu"
        kernels = load_kernels(data_dir / "native") if compact_cpu and settings.dtype != "float16" else None
        kv_dtype = resolve_kv_dtype(settings.dtype, device, weights, native=kernels is not None)
        weights_from = "the source's own weights"
        if weights == "q4" and q4_file is not None:
            forward = gguf_forward(device, q4_file, model, kernels, config)
            weights_from = describe_runs_as(q4_file.name, forward.weights.runs_as)
        elif weights == "q4":
            if config.model_type not in GGUF_ARCHITECTURES:  # the quantised cache is a GGUF file
                raise ConfigError(f'model.weights = "q4" cannot quantise a {config.model_type!r} model on load: '
                                  'use float32, bfloat16 or int8')
            # Quantised here: the dense twin would hold the unquantised weights, so batches run the blocks too.
            q4_file = quantised_q4_file(model, data_dir, weights_hash)
            weights_from = f"quantised on load to Q4_1, lossy ({not_q4}); cached as {q4_file.name}"
            forward = gguf_forward(device, q4_file, None, kernels, config)
        elif weights != "transformers":
            forward = compact_forward(model, weights, device)
        else:
            weights_from = f"the source's own weights on transformers' forward ({compact_forward_problem(config)})"
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
            weights_from=weights_from,
            architecture=str(config.model_type),
            parameters=sum(p.numel() for p in model.parameters()),
        )
        log.info("loaded %s (%s weights from %s, %s KV cache, %s) in %.1f s", name, weights, weights_from,
                 info.dtype_name, device, info.load_s)
        if device.type == "cpu":
            log.info("CPU features: %s; torch's kernels: %s; native tile matmul: %s", features.describe(),
                     torch.backends.cpu.get_cpu_capability(), info.kernels or "no native kernels")
        runner = cls(model, tokenizer, info, forward, kernels)
        # The captured decode step (graphs.py) is Llama's arithmetic.
        runner.cuda_graphs = (settings.cuda_graphs and device.type == "cuda" and forward is not None
                              and forward.shape.plain)
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
        return self.transformers_forward.step(caches, runs)

    def warm_up(self, max_batch_size: int = 16) -> float:
        """Capture the decode graphs (:attr:`cuda_graphs`), then run each kind of step once on scratch caches
        (a prompt chunk, a one-session decode step and a full-batch one), so that the first requests do not
        pay the kernels' one-time set-up (the bf16 matmul's first call alone takes about half a second on
        this kind of CPU). Returns seconds.

        Called once at start-up, before the engine worker exists (chatd.service.core), so nothing else is using the
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
