"""A compact forward for Llama-family decoders: Llama and SmolLM, and the families that differ from Llama in a few
places (:class:`LlamaShape` names them): Mistral, Qwen2 and Qwen3, Phi-3, Gemma 2 and 3. Only model types verified
against transformers are enabled (SUPPORTED_MODEL_TYPES).

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
import math
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from chatd.engine.kernels.cpu import cpu_features
from chatd.engine.kernels.loader import EngineKernels, StepPlan
from chatd.engine.model.quant import TileQ4Linear, TileQ8Linear
from chatd.engine.model.weights import Bf16Linear, LlamaLayer, LlamaWeights, takes_bf16
from chatd.engine.pool.kvcache import KVPool, SessionKV, StepSlots, appending, attend
from chatd.engine.pool.paged import dequantize_rows

# Where SDPA runs in bf16 on AMX tiles (LlamaForward.bf16_attention), prompt chunks up to this many tokens attend
# through the native kernel (one call per layer for every such run and every decode token) and longer ones
# through SDPA: the kernel's row-by-row walk rereads the cache per query row, where SDPA's blocks share it. Where
# SDPA runs in fp32 every run takes the kernel, which is the faster there for every length.
NATIVE_ATTENTION_MAX_RUN = 64

def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [M, hidden] fp32; one fused op, the same values as transformers' LlamaRMSNorm in fp32
    return F.rms_norm(x, weight.shape, weight, eps)


@dataclass
class _Layout:
    """One step's rows: each run's length, cached start and row bounds, every row's position, and how each run
    attends: ``natives`` through the native kernel (over ``tables``: block tables, rows and visible positions),
    ``others`` through SDPA over their cache ``views`` with a causal ``masks`` entry (None for one token)."""

    lengths: list[int]
    starts: Sequence[int]
    bounds: list[int]
    positions: torch.Tensor  # [rows] int64
    natives: list[int]
    others: list[int]
    masks: dict[int, torch.Tensor | None]
    views: dict[int, list[tuple[list[torch.Tensor], list[torch.Tensor]]]]
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    window_masks: dict[tuple[int, int], torch.Tensor]  # (run, window) -> its mask in layers of that sliding window


class LlamaForward:
    """The compact forward over :class:`LlamaWeights`. Not thread-safe: the engine worker is its only caller."""

    def __init__(self, weights: LlamaWeights, device: torch.device) -> None:
        self.weights = weights
        self.shape = s = weights.shape
        self.device = device
        positions = torch.arange(s.max_positions, dtype=torch.float32)
        # One cos and one sin table [max_positions, head_dim] per distinct RoPE (Gemma 3's local and global layers
        # differ); self.cos and self.sin are the first, every layer's but in such a model.
        self.rope_tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        for rope in s.all_ropes():
            freqs = torch.outer(positions, torch.tensor(rope.inv_freq, dtype=torch.float32))  # [positions, dim / 2]
            table = torch.cat([freqs, freqs], dim=-1)
            self.rope_tables.append(((table.cos() * rope.scaling).to(device), (table.sin() * rope.scaling).to(device)))
        self.cos, self.sin = self.rope_tables[0]
        self.scale = s.attention_scale or s.head_dim ** -0.5
        self.group = s.num_heads // s.num_kv_heads
        # The fused path's layer (add + norm, projection, SiLU-times-up natively) is Llama's; Gemma's norms
        # around attention and MLP and its GELU take the kernels path.
        self.fused_layers = not s.sandwich_norms and s.activation == "silu"
        linears = [self.weights.lm_head, *(p for layer in self.weights.layers
                                            for p in (layer.qkv, layer.o, layer.gate_up, layer.down))]
        # Every projection runs bf16 to bf16 (q4 and dense bf16 weights): the native path between them.
        self.bf16_projections = all(takes_bf16(linear) for linear in linears)
        # Over a bf16 pool on a CPU with AMX tiles, the attention of prompt chunks (SDPA) runs in bf16: faster than
        # widening K/V to fp32 there, and the result is rounded to bf16 for the o projection anyway. Without AMX,
        # bf16 SDPA is the slower one.
        self.bf16_attention = device.type == "cpu" and bf16_attention_is_fast()
        # The longest run that attends through the native kernel (when there is one); longer ones take SDPA.
        self.native_attention_max_run = NATIVE_ATTENTION_MAX_RUN if self.bf16_attention else sys.maxsize
        # Native kernels (chatd/engine/kernels/loader.py), set by the loader where they build and fit the pool (CPU,
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
        their scales, the embedding, the norms): the memory a step streams, for :mod:`chatd.engine.pool.hugepages`."""
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
                                                                "down", "q_norm", "k_norm", "post_attn_norm",
                                                                "post_ffn_norm"))):
            if owner is not None:
                add(owner)
        return list(found.values())

    # ------------------------------------------------------------------ pieces

    def _rope_table(self, positions: torch.Tensor, table: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [M] int64 -> cos, sin [M, 1, head_dim] of RoPE table ``table``, looked up once per forward
        cos, sin = self.rope_tables[table]
        return cos[positions][:, None], sin[positions][:, None]

    def _rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self._rope_table(positions, table) for table in range(len(self.rope_tables))]

    def _layer_tables(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s cos and sin tables, for the native RoPE."""
        return self.rope_tables[self.shape.rope_of(index)]

    def _norm_qk(self, layer: LlamaLayer, qkv: torch.Tensor) -> None:
        """Each q and k head of ``qkv`` ``[M, width]`` RMS-normed in place (LlamaShape.qk_norm), before RoPE."""
        if layer.q_norm is None or layer.k_norm is None:
            return
        s = self.shape
        heads = s.num_heads * s.head_dim
        q = qkv[:, :heads].view(-1, s.num_heads, s.head_dim)
        k = qkv[:, heads:heads + s.num_kv_heads * s.head_dim].view(-1, s.num_kv_heads, s.head_dim)
        q.copy_(_rms_norm(q, layer.q_norm, s.rms_norm_eps))
        k.copy_(_rms_norm(k, layer.k_norm, s.rms_norm_eps))

    def _qkv(self, layer: LlamaLayer, h: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # h: [M, hidden] -> q [M, heads, head_dim], k and v [M, kv_heads, head_dim], RoPE applied to q and k
        s = self.shape
        qkv = layer.qkv(_rms_norm(h, layer.attn_norm, s.rms_norm_eps)).contiguous()
        self._norm_qk(layer, qkv)
        num_qk = (s.num_heads + s.num_kv_heads) * s.head_dim
        qk = qkv[:, :num_qk].view(-1, s.num_heads + s.num_kv_heads, s.head_dim)  # q and k heads rotate alike
        cos, sin = rope
        half = s.head_dim // 2
        rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
        qk = qk * cos + rotated * sin
        q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)
        return q, k, qkv[:, num_qk:].view(-1, s.num_kv_heads, s.head_dim)

    def _mlp(self, layer: LlamaLayer, h: torch.Tensor) -> torch.Tensor:
        s = self.shape
        gate, up = layer.gate_up(_rms_norm(h, layer.ffn_norm, s.rms_norm_eps)).chunk(2, dim=-1)
        out = layer.down((F.silu(gate) if s.activation == "silu" else F.gelu(gate, approximate="tanh")) * up)
        return out if layer.post_ffn_norm is None else _rms_norm(out, layer.post_ffn_norm, s.rms_norm_eps)

    def _attended(self, layer: LlamaLayer, out: torch.Tensor) -> torch.Tensor:
        """The o projection of the attention's ``out``, normed where the model norms it (Gemma)."""
        o = layer.o(out)
        return o if layer.post_attn_norm is None else _rms_norm(o, layer.post_attn_norm, self.shape.rms_norm_eps)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        # h: [M, hidden] (the positions whose logits are wanted) -> [M, vocab] fp32
        return self._capped(self.weights.lm_head(_rms_norm(h, self.weights.norm, self.shape.rms_norm_eps)).float())

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.shape.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _step_plan(self, pool: KVPool) -> StepPlan | None:
        """The plan for running this step as one native call, or None where it cannot: no kernels or no tile
        kernel, or weights packed for another kind."""
        kernels = self.kernels
        if kernels is None or not self._tiled or not self.use_native_step or not self.shape.plain:
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

        The step takes one of four paths, each a method of its own: the whole step in one native call
        (:meth:`_step_native`: every projection on the tile kernel and every run attending natively), the layers
        in Python with the native steps between bf16 projections (:meth:`_step_fused`), with the native RoPE,
        K/V write and attention around fp32 projections (:meth:`_step_kernels`), or torch's ops alone
        (:meth:`_step_torch`).
        """
        pool = caches[0].pool
        with appending(caches, runs) as step:
            layout = self._layout(caches, runs, step)
            ids = torch.tensor([t for run in runs for t in run], dtype=torch.long, device=self.device)
            h = self.weights.embed(ids)  # [rows, hidden] fp32
            if self.shape.embed_scale != 1.0:
                h = h * self.shape.embed_scale
            if self.kernels is None:
                return self._step_torch(h, layout, pool, step.slots)
            # The kernel reads the RoPE tables unchecked (torch's lookup would raise): check the range once.
            if max(start + n for start, n in zip(layout.starts, layout.lengths, strict=True)) > self.cos.shape[0]:
                raise IndexError(f"a position past the model's {self.cos.shape[0]} RoPE positions")
            slots = step.slots.to(torch.int64).contiguous()
            plan = self._step_plan(pool) if not layout.others else None
            if plan is not None:
                return self._step_native(plan, h, layout, slots)
            if self.bf16_projections and self.fused_layers:
                return self._step_fused(h, layout, pool, slots)
            return self._step_kernels(h, layout, pool, slots)

    def _layout(self, caches: Sequence[SessionKV], runs: Sequence[Sequence[int]], step: StepSlots) -> _Layout:
        """Where each run's rows sit in the step and how each run attends."""
        lengths = [len(run) for run in runs]
        starts = step.starts
        positions = torch.tensor([start + j for start, n in zip(starts, lengths, strict=True) for j in range(n)],
                                 dtype=torch.long)
        bounds = list(itertools.accumulate(lengths, initial=0))
        # Decode tokens and prompt chunks attend in one native call per layer for all of them, straight from their
        # block tables, each row over its own causal prefix; chunks longer than native_attention_max_run (and every
        # run without the kernel) attend through torch's SDPA, which reuses K/V across query rows.
        natives = ([run for run, n in enumerate(lengths) if n <= self.native_attention_max_run]
                   if self.kernels is not None and self._attends_natively(starts, lengths) else [])
        others = sorted(set(range(len(runs))) - set(natives))
        # Causal over the cached prefix and the run itself: new token j sees positions <= start + j. A single new
        # token sees everything, so needs no mask.
        masks = {run: None if lengths[run] == 1 else
                 torch.ones(lengths[run], starts[run] + lengths[run], dtype=torch.bool, device=self.device)
                 .tril(diagonal=starts[run]).repeat(self.group, 1) for run in others}
        views = {run: caches[run].run_views() for run in others}
        tables = _decode_tables(caches, natives, starts, bounds, caches[0].pool.block_size) if natives else None
        if self.kernels is not None:
            positions = positions.to(device=self.device, dtype=torch.int64).contiguous()
        return _Layout(lengths=lengths, starts=starts, bounds=bounds, positions=positions, natives=natives,
                       others=others, masks=masks, views=views, tables=tables, window_masks={})

    def _attends_natively(self, starts: Sequence[int], lengths: Sequence[int]) -> bool:
        """Whether the native kernel (plain causal attention) computes this step's attention in every layer: no
        soft-capping, and no sliding window that cuts into a run's view (every run ends within the shortest)."""
        s = self.shape
        if s.attention_softcap is not None:
            return False
        if s.native_attention:
            return True
        end = max(start + n for start, n in zip(starts, lengths, strict=True))
        return end <= min(window for window in s.windows if window)

    def _mask(self, layout: _Layout, run: int, window: int | None) -> torch.Tensor | None:
        """Run ``run``'s mask in a layer of sliding ``window`` (None: full attention), folded like its queries:
        query j (position start + j) sees the positions p <= start + j with start + j - p < window."""
        start, n = layout.starts[run], layout.lengths[run]
        if window is None or start + n <= window:
            return layout.masks[run]
        mask = layout.window_masks.get((run, window))
        if mask is None:
            queries = torch.arange(start, start + n, device=self.device)[:, None]
            keys = torch.arange(start + n, device=self.device)[None, :]
            mask = ((keys <= queries) & (queries - keys < window)).repeat(self.group, 1)
            layout.window_masks[(run, window)] = mask
        return mask

    def _step_native(self, plan: StepPlan, h: torch.Tensor, layout: _Layout, slots: torch.Tensor) -> torch.Tensor:
        """The whole step in one native call (:meth:`EngineKernels.forward_step`): the fused layer loop, in C."""
        assert self.kernels is not None and layout.tables is not None
        self.native_steps += 1
        tables, _, visible = layout.tables
        last = torch.tensor(layout.bounds[1:], dtype=torch.int32) - 1
        return self.kernels.forward_step(plan, h.contiguous(), layout.positions, self.cos, self.sin, slots, tables,
                                         visible, last).float()

    def _step_fused(self, h: torch.Tensor, layout: _Layout, pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
        """Every projection bf16 to bf16 (q4, or dense bf16) and everything between two projections native: the
        residual add and RMSNorm in one call, SiLU-times-up in another, no conversions around the projections.
        ``pending`` is the last projection's output, added to ``h`` by the next norm."""
        kernels = self.kernels
        assert kernels is not None
        s = self.shape
        pending: torch.Tensor | None = None
        for index, layer in enumerate(self.weights.layers):
            layer_kv = pool.tensors.kv[index]  # [2, kv_heads, num_blocks, block_size, head_dim]
            x = kernels.add_rms_norm(h, pending, layer.attn_norm, s.rms_norm_eps)
            qkv = cast(Bf16Linear, layer.qkv).bf16(x).float()
            self._norm_qk(layer, qkv)
            cos, sin = self._layer_tables(index)
            kernels.rope_write(qkv, s.num_heads, layout.positions, cos, sin, layer_kv[0], layer_kv[1], slots)
            q = qkv[:, :s.num_heads * s.head_dim].view(-1, s.num_heads, s.head_dim)
            out = self._attention(layout, index, q, layer_kv)
            attended = cast(Bf16Linear, layer.o).bf16(out.to(torch.bfloat16).contiguous())
            x = kernels.add_rms_norm(h, attended, layer.ffn_norm, s.rms_norm_eps)
            gate_up = cast(Bf16Linear, layer.gate_up).bf16(x)
            pending = cast(Bf16Linear, layer.down).bf16(kernels.silu_mul(gate_up))
        last = torch.tensor(layout.bounds[1:], device=self.device) - 1
        x = kernels.add_rms_norm(h, pending, self.weights.norm, s.rms_norm_eps)
        return self._capped(cast(Bf16Linear, self.weights.lm_head).bf16(x[last].contiguous()).float())

    def _step_kernels(self, h: torch.Tensor, layout: _Layout, pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
        """fp32 projections in torch; RoPE with the K/V write, and the attention, native."""
        kernels = self.kernels
        assert kernels is not None
        s = self.shape
        for index, layer in enumerate(self.weights.layers):
            layer_kv = pool.tensors.kv[index]  # [2, kv_heads, num_blocks, block_size, head_dim]
            qkv = layer.qkv(_rms_norm(h, layer.attn_norm, s.rms_norm_eps)).contiguous()
            self._norm_qk(layer, qkv)
            cos, sin = self._layer_tables(index)
            kernels.rope_write(qkv, s.num_heads, layout.positions, cos, sin, layer_kv[0], layer_kv[1], slots)
            q = qkv[:, :s.num_heads * s.head_dim].view(-1, s.num_heads, s.head_dim)
            out = self._attention(layout, index, q, layer_kv)
            h = h + self._attended(layer, out)
            h = h + self._mlp(layer, h)
        return self._logits(h[torch.tensor(layout.bounds[1:], device=self.device) - 1])

    def _step_torch(self, h: torch.Tensor, layout: _Layout, pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
        """torch's ops alone: RoPE from the table, K/V written by index, every run attending through SDPA."""
        ropes = self._rope_tables(layout.positions.to(self.device))
        for index, layer in enumerate(self.weights.layers):
            q, k, v = self._qkv(layer, h, ropes[self.shape.rope_of(index)])
            pool.write(index, slots, k, v)
            out = self._attention(layout, index, q, pool.tensors.kv[index])
            h = h + self._attended(layer, out)
            h = h + self._mlp(layer, h)
        return self._logits(h[torch.tensor(layout.bounds[1:], device=self.device) - 1])

    def _attention(self, layout: _Layout, index: int, q: torch.Tensor, layer_kv: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s attention of every row (K/V already written), ``[rows, heads * head_dim]`` fp32: the
        native runs in one kernel call, the others through SDPA one run at a time."""
        window = self.shape.windows[index] if self.shape.windows else None
        if len(layout.others) == len(layout.lengths) == 1:
            return self._attend(_layer_runs(layout.views[0], index), q, self._mask(layout, 0, window))
        bounds = layout.bounds
        out = torch.empty(bounds[-1], self.shape.num_heads * self.shape.head_dim, device=self.device)
        if layout.tables is not None:
            assert self.kernels is not None
            tables, rows, visible = layout.tables
            self.kernels.decode_attention(q, out, rows, layer_kv[0], layer_kv[1], tables, visible, self.scale)
        for run in layout.others:
            out[bounds[run]:bounds[run + 1]] = self._attend(
                _layer_runs(layout.views[run], index), q[bounds[run]:bounds[run + 1]], self._mask(layout, run, window))
        return out

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
        cap = s.attention_softcap
        out = (attend(folded, kv_runs, mask, self.scale) if cap is None
               else _attend_capped(folded, kv_runs, mask, self.scale, cap)).float()
        if n == 1:
            return out.reshape(1, -1)
        return out.view(s.num_kv_heads, self.group, n, s.head_dim).permute(2, 0, 1, 3).reshape(n, -1)

    def prefill(self, cache: SessionKV, token_ids: Sequence[int]) -> torch.Tensor:
        """Append ``token_ids`` (non-empty) to ``cache``; return the last position's logits ``[vocab]`` fp32."""
        return self.step([cache], [token_ids])[0]

    def decode(self, caches: Sequence[SessionKV], token_ids: Sequence[int]) -> torch.Tensor:
        """Feed one token to each cache in one pass; return logits ``[batch, vocab]`` fp32."""
        return self.step(caches, [[token] for token in token_ids])


def _attend_capped(query: torch.Tensor, runs: Sequence[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None,
                   scale: float, cap: float) -> torch.Tensor:
    """:func:`attend` with soft-capped scores, ``cap * tanh(score / cap)`` (Gemma 2): SDPA has no such step, so the
    scores are made whole, K/V concatenated from their runs."""
    keys = torch.cat([k for k, _ in runs], dim=2).to(query.dtype)  # [1, kv_heads, length, head_dim]
    values = torch.cat([v for _, v in runs], dim=2).to(query.dtype)
    scores = torch.tanh(torch.matmul(query, keys.transpose(-1, -2)) * scale / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype), values)


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


def bf16_attention_is_fast() -> bool:
    """Whether SDPA over bf16 K/V is faster in bf16 than widened to fp32 on this CPU: where it has AMX tiles; on
    AVX512-BF16 alone it is slower."""
    if not cpu_features().amx:
        return False
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False

