"""A compact forward for Llama-family decoders (Llama and SmolLM; the code also takes Qwen2-style q/k/v
biases, but only model types verified against transformers are enabled: SUPPORTED_MODEL_TYPES).

transformers' modeling code is the loader and the reference; this module runs the same arithmetic
with less in between: the Q/K/V projections fused into one matmul and gate/up into another, RoPE from
a precomputed table, and attention straight over each session's K/V in the paged pool (``SessionKV``). Every
projection is a :class:`Linear`: dense weights (any float dtype) or weight-only quantised ones, so the
same forward runs the model at the precision that serves the device.

Two entry points mirror the runner's: :meth:`LlamaForward.prefill` (one session, a run of new tokens)
and :meth:`LlamaForward.decode` (one new token for each of several sessions, one batched pass through
the projections). Both append the new positions' K/V to the caches and return logits in fp32.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F

from chatd.engine.cpu import cpu_features
from chatd.engine.kvcache import KVPool, SessionKV, appending, attend
from chatd.engine.native import EngineKernels, StepPlan
from chatd.engine.paged import dequantize_rows
from chatd.engine.quant import GGUFWeights, TileQ4Linear, TileQ8Linear

# Model types whose forward this module has been checked to reproduce (tests/test_llama_forward.py);
# anything else keeps transformers' forward. Mistral and Qwen2 share the arithmetic but wait for a test
# with real weights of their own.
SUPPORTED_MODEL_TYPES = frozenset({"llama"})
# Where SDPA runs in bf16 on AMX tiles (LlamaForward.bf16_attention), prompt chunks up to this many tokens attend
# through the native kernel (one call per layer for every such run and every decode token) and longer ones
# through SDPA: the kernel's row-by-row walk rereads the cache per query row, where SDPA's blocks share it. Where
# SDPA runs in fp32 every run takes the kernel, which measured faster for every length (docs/performance.md).
NATIVE_ATTENTION_MAX_RUN = 64


class Linear(Protocol):
    """``y = x W^T (+ b)`` for ``x`` ``[M, in_features]`` fp32, returning ``[M, out_features]`` fp32."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Bf16Linear(Linear, Protocol):
    """A :class:`Linear` that also runs bf16 to bf16 (``bf16``: ``[M, in_features]`` contiguous bf16 in,
    ``[M, out_features]`` bf16 out), with no conversion around its kernel; ``takes_bf16`` says whether it can
    (a dense one only when its weight is bf16)."""

    takes_bf16: bool

    def bf16(self, x: torch.Tensor) -> torch.Tensor: ...


def takes_bf16(linear: Linear) -> bool:
    """Whether ``linear`` is a :class:`Bf16Linear` that can run bf16 to bf16."""
    return bool(getattr(linear, "takes_bf16", False)) and callable(getattr(linear, "bf16", None))


class Embedding(Protocol):
    """Token ids ``[n]`` int64 -> their embeddings ``[n, hidden]`` fp32."""

    def __call__(self, ids: torch.Tensor) -> torch.Tensor: ...


class DenseEmbedding:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # [vocab, hidden]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].float()


class DenseLinear:
    """A dense projection; the weight may be stored in a lower precision than the activations."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out_features, in_features]
        self.bias = None if bias is None else bias.to(weight.dtype)  # [out_features] or None
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == x.dtype:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).float()

    @property
    def takes_bf16(self) -> bool:
        return self.weight.dtype == torch.bfloat16

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 ``[M, in]`` -> bf16 ``[M, out]`` (a bf16 weight only: see ``takes_bf16``)."""
        return F.linear(x, self.weight, self.bias)


class PackedBf16Linear:
    """A dense bf16 projection whose weight oneDNN has reordered once, at load, into the blocked layout its
    CPU matmul (AMX tiles or AVX512-BF16) reads. A plain bf16 ``F.linear`` reorders the weight on every
    call: for this model's small matrices that reorder, not the multiply, was most of the cost
    (docs/performance.md, "Quick run after the native steps between projections"). The results are those
    of ``F.linear`` in bf16."""

    # The row count oneDNN is told to expect. Any count runs; 16 (a batched decode step) measured as fast
    # as the best hint for 1 to 512 rows.
    _ROWS_HINT = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        bf16 = weight.to(torch.bfloat16).contiguous()  # [out_features, in_features]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(bf16, self._ROWS_HINT)  # opaque oneDNN tensor
        self.bias = None if bias is None else bias.to(torch.bfloat16).contiguous()  # [out_features] or None

    @staticmethod
    def available() -> bool:
        """Whether this torch build has oneDNN's bf16 linear ops (CPU builds with mkldnn)."""
        try:
            return (torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
        except (AttributeError, RuntimeError):
            return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.bf16(x.to(torch.bfloat16).contiguous()).float()

    takes_bf16 = True

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 ``[M, in]`` -> bf16 ``[M, out]``."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


class Int8Linear:
    """Weight-only int8 with one scale per output channel (symmetric, round to nearest)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight  # [out_features, in_features] int8
        self.scales = scales  # [out_features] bf16
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        # weight: [out, in] fp32
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scales.to(torch.bfloat16), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # The CPU kernel is fast only with bf16 activations and scales (fp32 takes a scalar path ~30x slower).
        out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.weight, self.scales).float()
        return out if self.bias is None else out + self.bias


class RowSwitchLinear:
    """One projection held twice: ``small`` for batches of fewer than ``min_rows`` rows (decode), ``large``
    for bigger ones (prefill chunks, wide decode steps). The weight-only int4 kernel reads 4x fewer bytes
    than fp32 but its cost grows with every row, while a dense matmul barely notices 16 more rows: on this
    kind of CPU a prepacked bf16 one overtakes it at about 8 rows, an fp32 one near 20-30."""

    def __init__(self, small: Linear, large: Linear, min_rows: int) -> None:
        self.small, self.large, self.min_rows = small, large, min_rows
        self.out_features, self.in_features = small.out_features, small.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (self.large if x.shape[0] >= self.min_rows else self.small)(x)

    @property
    def takes_bf16(self) -> bool:
        return takes_bf16(self.small) and takes_bf16(self.large)

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        return cast(Bf16Linear, self.large if x.shape[0] >= self.min_rows else self.small).bf16(x)


@dataclass(frozen=True)
class LlamaShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int

    @classmethod
    def from_config(cls, config: Any) -> LlamaShape:
        """Raises ValueError for configs this forward does not reproduce exactly (other RoPE scalings,
        sliding windows, other architectures)."""
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {config.model_type!r} is not a supported Llama-family decoder")
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"RoPE type {rope_type!r} is not supported by the compact forward")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"activation {config.hidden_act!r} is not supported by the compact forward")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise ValueError("sliding-window attention is not supported by the compact forward")
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size, rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            max_positions=int(config.max_position_embeddings),
        )


@dataclass
class LlamaLayer:
    attn_norm: torch.Tensor  # [hidden] fp32
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    o: Linear  # heads * head_dim -> hidden
    ffn_norm: torch.Tensor  # [hidden] fp32
    gate_up: Linear  # hidden -> 2 * intermediate (gate rows first)
    down: Linear  # intermediate -> hidden


@dataclass
class LlamaWeights:
    shape: LlamaShape
    embed: Embedding
    layers: list[LlamaLayer]
    norm: torch.Tensor  # [hidden] fp32
    lm_head: Linear  # hidden -> vocab


def weights_from_transformers(model: Any, make_linear: Callable[[torch.Tensor, torch.Tensor | None], Linear]
                              | None = None) -> LlamaWeights:
    """Fuse a loaded transformers Llama-family model's weights for the compact forward.

    ``make_linear(weight [out, in] fp32, bias)`` builds each projection (default: dense, in the model's
    dtype). The model's tensors are copied into fused ones, so the model can be dropped afterwards.
    """
    shape = LlamaShape.from_config(model.config)
    make = make_linear or (lambda w, b: DenseLinear(w, b))
    inner = model.model
    layers = []
    for block in inner.layers:
        attn, mlp = block.self_attn, block.mlp
        qkv_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        qkv_b = torch.cat(biases).detach() if all(b is not None for b in biases) else None
        if getattr(mlp.gate_proj, "bias", None) is not None or getattr(attn.o_proj, "bias", None) is not None:
            raise ValueError("biases outside the q/k/v projections are not supported by the compact forward")
        layers.append(LlamaLayer(
            attn_norm=block.input_layernorm.weight.detach().float(),
            qkv=make(qkv_w, qkv_b),
            o=make(attn.o_proj.weight.detach(), None),
            ffn_norm=block.post_attention_layernorm.weight.detach().float(),
            gate_up=make(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(), None),
            down=make(mlp.down_proj.weight.detach(), None),
        ))
    return LlamaWeights(shape=shape, embed=DenseEmbedding(inner.embed_tokens.weight.detach().float()), layers=layers,
                        norm=inner.norm.weight.detach().float(),
                        lm_head=make(model.lm_head.weight.detach(), None))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [M, hidden] fp32; one fused op, the same values as transformers' LlamaRMSNorm in fp32
    return F.rms_norm(x, weight.shape, weight, eps)


class LlamaForward:
    """The compact forward over :class:`LlamaWeights`. Not thread-safe: the engine worker is its only caller."""

    def __init__(self, weights: LlamaWeights, device: torch.device) -> None:
        self.weights = weights
        self.shape = s = weights.shape
        self.device = device
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.int64).float() / s.head_dim))
        positions = torch.arange(s.max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
        table = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.cos = table.cos().to(device)
        self.sin = table.sin().to(device)
        self.scale = s.head_dim ** -0.5
        self.group = s.num_heads // s.num_kv_heads
        linears = [self.weights.lm_head, *(p for layer in self.weights.layers
                                            for p in (layer.qkv, layer.o, layer.gate_up, layer.down))]
        # Every projection runs bf16 to bf16 (q4 and dense bf16 weights): the native path between them.
        self.bf16_projections = all(takes_bf16(linear) for linear in linears)
        # Over a bf16 pool on a CPU with AMX tiles, the attention of prompt chunks (SDPA) runs in bf16: 2.2-2.6x
        # faster than widening K/V to fp32 there, and the result is rounded to bf16 for the o projection
        # anyway. Without AMX, bf16 SDPA is the slower one (docs/performance.md).
        self.bf16_attention = device.type == "cpu" and bf16_attention_is_fast()
        # The longest run that attends through the native kernel (when there is one); longer ones take SDPA.
        self.native_attention_max_run = NATIVE_ATTENTION_MAX_RUN if self.bf16_attention else sys.maxsize
        # Native kernels (chatd/engine/native.py), set by the loader where they build and fit the pool (CPU,
        # fp32 K/V): RoPE with the K/V write for every row, and the attention of single-token runs. None:
        # torch's ops alone.
        self.kernels: EngineKernels | None = None
        # With every projection on the tile kernel (the q4 model where a tile kernel runs), a step whose runs
        # all attend natively runs as one native call (EngineKernels.forward_step), planned once per pool (a
        # forward may serve several runners' pools; a pool's plan goes with the pool).
        tiled = [p for layer in weights.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self._tiled: list[TileQ4Linear] = ([cast(TileQ4Linear, p) for p in tiled]
                                           if all(isinstance(p, TileQ4Linear) for p in tiled)
                                           and isinstance(weights.lm_head, TileQ8Linear) else [])
        self._plans: weakref.WeakKeyDictionary[KVPool, StepPlan] = weakref.WeakKeyDictionary()
        self.use_native_step = True
        """False keeps every step on the Python loop over layers (tests compare the two)."""
        self.native_steps = 0
        """Steps run as one native call (EngineKernels.forward_step)."""

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor the forward reads its weights from (the projections' packed or dense weights and
        their scales, the embedding, the norms): the memory a step streams, for :mod:`chatd.engine.hugepages`."""
        found: dict[int, torch.Tensor] = {}

        def add(owner: object) -> None:
            if isinstance(owner, torch.Tensor):
                found[id(owner)] = owner
            elif isinstance(owner, torch.nn.Module):
                for tensor in (*owner.parameters(), *owner.buffers()):
                    found[id(tensor)] = tensor
            for value in getattr(owner, "__dict__", {}).values():
                if isinstance(value, torch.Tensor):
                    found[id(value)] = value

        w = self.weights
        for owner in (w.embed, w.norm, w.lm_head, *(getattr(layer, name) for layer in w.layers
                                                   for name in ("attn_norm", "qkv", "o", "ffn_norm", "gate_up",
                                                                "down"))):
            add(owner)
        return list(found.values())

    # ------------------------------------------------------------------ pieces

    def _rope_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [M] int64 -> cos, sin [M, 1, head_dim], looked up once per forward for every layer
        return self.cos[positions][:, None], self.sin[positions][:, None]

    def _qkv(self, layer: LlamaLayer, h: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # h: [M, hidden] -> q [M, heads, head_dim], k and v [M, kv_heads, head_dim], RoPE applied to q and k
        s = self.shape
        qkv = layer.qkv(_rms_norm(h, layer.attn_norm, s.rms_norm_eps))
        num_qk = (s.num_heads + s.num_kv_heads) * s.head_dim
        qk = qkv[:, :num_qk].view(-1, s.num_heads + s.num_kv_heads, s.head_dim)  # q and k heads rotate alike
        cos, sin = rope
        half = s.head_dim // 2
        rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
        qk = qk * cos + rotated * sin
        q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)
        return q, k, qkv[:, num_qk:].view(-1, s.num_kv_heads, s.head_dim)

    def _mlp(self, layer: LlamaLayer, h: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(_rms_norm(h, layer.ffn_norm, self.shape.rms_norm_eps)).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        # h: [M, hidden] (the positions whose logits are wanted) -> [M, vocab] fp32
        return self.weights.lm_head(_rms_norm(h, self.weights.norm, self.shape.rms_norm_eps)).float()

    def _step_plan(self, pool: KVPool) -> StepPlan | None:
        """The plan for running this step as one native call, or None where it cannot: no kernels or no tile
        kernel, or weights packed for another kind."""
        kernels = self.kernels
        if kernels is None or not self._tiled or not self.use_native_step:
            return None
        head = cast(TileQ8Linear, self.weights.lm_head)
        kind = kernels.tile_matmul_kind
        if kind is None or head.kind != kind or any(p.kind != kind for p in self._tiled):
            return None
        plan = self._plans.get(pool)
        if plan is None or plan.kv is not pool.tensors.kv:
            s = self.shape
            layers = [{"attn_norm": layer.attn_norm, "ffn_norm": layer.ffn_norm,
                       **{name: cast(TileQ4Linear, getattr(layer, name)).tiles
                          for name in ("qkv", "o", "gate_up", "down")}}
                      for layer in self.weights.layers]
            plan = StepPlan(num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                            inter=self.weights.layers[0].gate_up.out_features // 2, eps=s.rms_norm_eps,
                            scale=self.scale, layers=layers, final_norm=self.weights.norm, lm_head=head.tiles,
                            vocab=s.vocab_size, kv=pool.tensors.kv, kind=kind)
            self._plans[pool] = plan
        return plan

    # ------------------------------------------------------------------ entry points

    @torch.inference_mode()
    def step(self, caches: Sequence[SessionKV], runs: Sequence[Sequence[int]]) -> torch.Tensor:
        """One packed forward pass: append ``runs[i]`` (non-empty token ids) to ``caches[i]`` for every ``i``
        and return the logits of each run's last position, ``[len(runs), vocab]`` fp32.

        Runs may be prompt chunks of any length and single decode tokens alike; they are concatenated
        without padding, so every projection runs once over all rows, and each layer's new K/V of every run
        go to the pool in one indexed write. Attention runs per run over its own cache, read in place from
        the pool (a decode token over the whole cache, a chunk causally over the cache and itself), so run
        ``i``'s result equals running it alone, up to float rounding.
        """
        lengths = [len(run) for run in runs]
        pool = caches[0].pool
        with appending(caches, runs) as step:
            starts = step.starts
            ids = torch.tensor([t for run in runs for t in run], dtype=torch.long, device=self.device)
            positions = torch.tensor([start + j for start, n in zip(starts, lengths, strict=True) for j in range(n)],
                                     dtype=torch.long)
            h = self.weights.embed(ids)  # [rows, hidden] fp32
            kernels = self.kernels
            rope = self._rope_table(positions.to(self.device)) if kernels is None else None
            bounds = list(itertools.accumulate(lengths, initial=0))
            # Decode tokens and prompt chunks attend in one native call per layer for all of them, straight
            # from their block tables, each row over its own causal prefix; chunks longer than
            # native_attention_max_run (and every run without the kernel) attend through torch's SDPA, which
            # reuses K/V across query rows.
            natives = ([run for run, n in enumerate(lengths) if n <= self.native_attention_max_run]
                       if kernels is not None else [])
            others = sorted(set(range(len(runs))) - set(natives))
            # Causal over the cached prefix and the run itself: new token j sees positions <= start + j. A
            # single new token sees everything, so needs no mask.
            masks = {run: None if lengths[run] == 1 else
                     torch.ones(lengths[run], starts[run] + lengths[run], dtype=torch.bool, device=self.device)
                     .tril(diagonal=starts[run]).repeat(self.group, 1) for run in others}
            views = {run: caches[run].run_views() for run in others}
            if natives:
                tables, rows, visible = _decode_tables(caches, natives, starts, bounds, pool.block_size)
            rows_total = bounds[-1]
            if kernels is not None:
                # The kernel reads the RoPE tables unchecked (torch's lookup would raise): check the range once.
                if max(start + n for start, n in zip(starts, lengths, strict=True)) > self.cos.shape[0]:
                    raise IndexError(f"a position past the model's {self.cos.shape[0]} RoPE positions")
                positions = positions.to(device=self.device, dtype=torch.int64).contiguous()
                slots = step.slots.to(torch.int64).contiguous()
                plan = self._step_plan(pool) if not others else None
                if plan is not None:  # the whole step in one native call: the loop below, in C
                    self.native_steps += 1
                    last = torch.tensor(bounds[1:], dtype=torch.int32) - 1
                    return kernels.forward_step(plan, h.contiguous(), positions, self.cos, self.sin, slots, tables,
                                                visible, last).float()
            s = self.shape
            # With the kernels and bf16 projections (q4, or dense bf16), everything between two projections
            # runs natively and the projections take and give bf16 (no conversions around them): the
            # residual add and RMSNorm in one call, SiLU-times-up in another. ``pending`` is the last
            # projection's output, added to ``h`` by the next norm.
            fused = kernels is not None and self.bf16_projections
            pending: torch.Tensor | None = None
            for index, layer in enumerate(self.weights.layers):
                layer_kv = pool.tensors.kv[index]  # [2, kv_heads, num_blocks, block_size, head_dim]
                if fused:
                    assert kernels is not None
                    x = kernels.add_rms_norm(h, pending, layer.attn_norm, s.rms_norm_eps)
                    qkv = cast(Bf16Linear, layer.qkv).bf16(x).float()
                    kernels.rope_write(qkv, s.num_heads, positions, self.cos, self.sin, layer_kv[0], layer_kv[1],
                                       slots)
                    q = qkv[:, :s.num_heads * s.head_dim].view(-1, s.num_heads, s.head_dim)
                elif kernels is not None:
                    qkv = layer.qkv(_rms_norm(h, layer.attn_norm, s.rms_norm_eps)).contiguous()
                    kernels.rope_write(qkv, s.num_heads, positions, self.cos, self.sin, layer_kv[0], layer_kv[1],
                                       slots)
                    q = qkv[:, :s.num_heads * s.head_dim].view(-1, s.num_heads, s.head_dim)
                else:
                    assert rope is not None
                    q, k, v = self._qkv(layer, h, rope)
                    pool.write(index, step.slots, k, v)
                if len(others) == len(runs) == 1:
                    out = self._attend(_layer_runs(views[0], index), q, masks[0])
                else:
                    out = torch.empty(rows_total, self.shape.num_heads * self.shape.head_dim, device=self.device)
                    if natives:
                        assert kernels is not None
                        kernels.decode_attention(q, out, rows, layer_kv[0], layer_kv[1], tables, visible, self.scale)
                    for run in others:
                        out[bounds[run]:bounds[run + 1]] = self._attend(
                            _layer_runs(views[run], index), q[bounds[run]:bounds[run + 1]], masks[run])
                if fused:
                    assert kernels is not None
                    attended = cast(Bf16Linear, layer.o).bf16(out.to(torch.bfloat16).contiguous())
                    x = kernels.add_rms_norm(h, attended, layer.ffn_norm, s.rms_norm_eps)
                    gate_up = cast(Bf16Linear, layer.gate_up).bf16(x)
                    pending = cast(Bf16Linear, layer.down).bf16(kernels.silu_mul(gate_up))
                else:
                    h = h + layer.o(out)
                    h = h + self._mlp(layer, h)
            last = torch.tensor(bounds[1:], device=self.device) - 1
            if fused:
                assert kernels is not None
                x = kernels.add_rms_norm(h, pending, self.weights.norm, s.rms_norm_eps)
                return cast(Bf16Linear, self.weights.lm_head).bf16(x[last].contiguous()).float()
            return self._logits(h[last])

    def _attend(self, kv_runs: Sequence[tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Attend one run's ``q`` ``[n, heads, head_dim]`` over its cache (K/V already written), given as
        views ``[1, kv_heads, len, row_width]`` of the pool per run of blocks; returns ``[n, heads * head_dim]``."""
        s = self.shape
        n = q.shape[0]
        if kv_runs[0][0].dtype == torch.int8:  # an int8 pool's rows, widened for SDPA
            wide = torch.bfloat16 if self.bf16_attention else torch.float32
            kv_runs = [(dequantize_rows(keys, wide), dequantize_rows(values, wide)) for keys, values in kv_runs]
        # Fold each KV head's query group into the query length, [1, kv_heads, group * n, head_dim]: one
        # 4-D SDPA call takes the fused CPU kernel (3-D inputs fall back to two matmuls).
        folded = q.view(n, s.num_kv_heads, self.group, s.head_dim).permute(1, 2, 0, 3)
        folded = folded.reshape(1, s.num_kv_heads, self.group * n, s.head_dim)
        if self.bf16_attention and kv_runs[0][0].dtype == torch.bfloat16:
            folded = folded.to(torch.bfloat16)
        out = attend(folded, kv_runs, mask, self.scale).float()
        if n == 1:
            return out.reshape(1, -1)
        return out.view(s.num_kv_heads, self.group, n, s.head_dim).permute(2, 0, 1, 3).reshape(n, -1)

    def prefill(self, cache: SessionKV, token_ids: Sequence[int]) -> torch.Tensor:
        """Append ``token_ids`` (non-empty) to ``cache``; return the last position's logits ``[vocab]`` fp32."""
        return self.step([cache], [token_ids])[0]

    def decode(self, caches: Sequence[SessionKV], token_ids: Sequence[int]) -> torch.Tensor:
        """Feed one token to each cache in one pass; return logits ``[batch, vocab]`` fp32."""
        return self.step(caches, [[token] for token in token_ids])


def _layer_runs(views: list[tuple[list[torch.Tensor], list[torch.Tensor]]], layer: int
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(keys[layer], values[layer]) for keys, values in views]


def _decode_tables(caches: Sequence[SessionKV], runs: Sequence[int], starts: Sequence[int], bounds: Sequence[int],
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the native attention: per query row of ``runs`` (every token of each run) its run's block table
    (int32, padded with 0), its row in the step, and how many positions it attends (its cache and the
    run's tokens up to itself)."""
    rows = [row for run in runs for row in range(bounds[run], bounds[run + 1])]
    visible = [starts[run] + 1 + j for run in runs for j in range(bounds[run + 1] - bounds[run])]
    ends = {run: starts[run] + bounds[run + 1] - bounds[run] for run in runs}
    width = -(-max(ends.values()) // block_size)
    table = {run: [*caches[run].block_ids[:-(-end // block_size)]] for run, end in ends.items()}
    tables = torch.tensor([[*table[run], *[0] * (width - len(table[run]))]
                           for run in runs for _ in range(bounds[run + 1] - bounds[run])], dtype=torch.int32)
    return tables, torch.tensor(rows, dtype=torch.int32), torch.tensor(visible, dtype=torch.int32)


def bf16_matmul_is_fast() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX tiles or AVX512-BF16). There a dense bf16
    matmul of a few rows or more costs about what reading its weights costs, flat from 4 to 64 rows, where
    the int4 kernel pays for every row (docs/performance.md, "Decode engine")."""
    if not cpu_features().bf16_matmul:  # what the engine may use (CHATD_CPU_ISA may cap it)
        return False
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    try:
        return any(bool(getattr(torch.cpu, name)()) for name in probes if hasattr(torch.cpu, name))
    except RuntimeError:
        return False


def bf16_attention_is_fast() -> bool:
    """Whether SDPA over bf16 K/V is faster in bf16 than widened to fp32 on this CPU: where it has AMX tiles
    (measured 2.2-2.6x for a 256-token chunk over 512-2,048 positions); on AVX512-BF16 alone it was slower."""
    if not cpu_features().amx:
        return False
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def weights_from_gguf(gguf: GGUFWeights, dense: LlamaWeights | None = None, min_rows: int = 32) -> LlamaWeights:
    """The compact forward over a GGUF's own quantised blocks (chatd/engine/quant.py): Q4_1 projections
    through the int4 kernel, the Q8_0 embedding looked up row by row and used as the LM head.

    ``dense``: the same weights dequantised (fp32, or bf16 where the CPU has bf16 matmul units); batches of
    at least ``min_rows`` rows (prefill chunks, batched decode steps) then run those, LM head included."""
    d = gguf.dims
    shape = LlamaShape(num_layers=d.num_layers, hidden_size=d.hidden_size, num_heads=d.num_heads,
                       num_kv_heads=d.num_kv_heads, head_dim=d.head_dim, vocab_size=d.vocab_size,
                       rms_norm_eps=d.rms_norm_eps, rope_theta=d.rope_theta, max_positions=d.context_length)
    def pick(small: Linear, large: Linear | None) -> Linear:
        return small if large is None else RowSwitchLinear(small, large, min_rows)

    layers = []
    for index, layer in enumerate(gguf.layers):
        twin = dense.layers[index] if dense is not None else None
        layers.append(LlamaLayer(
            attn_norm=layer.attn_norm, ffn_norm=layer.ffn_norm,
            qkv=pick(layer.qkv, twin.qkv if twin else None), o=pick(layer.o, twin.o if twin else None),
            gate_up=pick(layer.gate_up, twin.gate_up if twin else None),
            down=pick(layer.down, twin.down if twin else None)))
    return LlamaWeights(shape=shape, embed=gguf.embed_tokens.rows, layers=layers, norm=gguf.final_norm,
                        lm_head=pick(cast(Linear, gguf.lm_head), dense.lm_head if dense is not None else None))
