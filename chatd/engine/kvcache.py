"""A transformers cache whose layers write into preallocated buffers instead of growing by torch.cat.

``DynamicCache`` concatenates every step, copying each layer's whole cache per generated token.
Here each layer owns K and V buffers of shape ``[1, kv_heads, capacity, head_dim]`` and exposes the
filled prefix as views, so a decode step writes one column and a turn whose room was reserved up
front never reallocates. Capacity is what the memory budget counts.

Only the engine worker thread may touch these tensors (see worker.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

# Capacity grows in steps of this many tokens when a write overflows without a reservation.
GROWTH_TOKENS = 256


class GrowableLayer(DynamicLayer):
    """One layer's K/V: buffers ``[1, kv_heads, capacity, head_dim]``; ``keys``/``values`` are views of
    the first ``length`` positions."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.is_initialized = True
        self._refresh_views()

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Buffers are created by reserve(); nothing to infer from the first states.
        self.is_initialized = True

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` positions in total (never shrinks below ``length``)."""
        capacity = max(capacity, self.length)
        if capacity == self.capacity:
            return
        shape = (1, self.num_kv_heads, capacity, self.head_dim)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)
        v = torch.empty(shape, dtype=self.dtype, device=self.device)
        if self._k is not None and self._v is not None and self.length:
            k[:, :, : self.length].copy_(self._k[:, :, : self.length])
            v[:, :, : self.length].copy_(self._v[:, :, : self.length])
        self._k, self._v = k, v
        self._refresh_views()

    def _refresh_views(self) -> None:
        if self._k is None or self._v is None:
            empty = torch.empty((1, self.num_kv_heads, 0, self.head_dim), dtype=self.dtype, device=self.device)
            self.keys, self.values = empty, empty
            return
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [1, kv_heads, new, head_dim]
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self.reserve(-(-end // GROWTH_TOKENS) * GROWTH_TOKENS)
        assert self._k is not None and self._v is not None
        self._k[:, :, self.length : end].copy_(key_states)
        self._v[:, :, self.length : end].copy_(value_states)
        self.length = end
        self._refresh_views()
        return self._k[:, :, :end], self._v[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        # transformers >= 5 passes a negative count of tokens to drop.
        if tokens_to_remove > 0:
            raise ValueError("crop expects a negative number of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)
        self._refresh_views()

    def reset(self) -> None:
        self.length = 0
        self._refresh_views()

    def filled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[kv_heads, length, head_dim]`` of K and V; each head's slab is contiguous."""
        assert self.keys is not None and self.values is not None
        return self.keys[0], self.values[0]


class SessionKV(DynamicCache):
    """The KV cache of one session: one :class:`GrowableLayer` per decoder layer, batch size 1."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        layers = [GrowableLayer(num_kv_heads, head_dim, dtype, device) for _ in range(num_layers)]
        Cache.__init__(self, layers=list[Any](layers))
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device

    @property
    def growable_layers(self) -> Sequence[GrowableLayer]:
        return self.layers  # type: ignore[return-value]

    @property
    def length(self) -> int:
        return self.growable_layers[0].length

    @property
    def capacity(self) -> int:
        return self.growable_layers[0].capacity

    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.layers) * self.num_kv_heads * self.head_dim * element

    @property
    def num_bytes(self) -> int:
        """Bytes allocated (capacity, not length): what the memory budget counts."""
        return self.capacity * self.bytes_per_token()

    def reserve(self, capacity: int) -> None:
        for layer in self.growable_layers:
            layer.reserve(capacity)

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` positions (no copy; capacity unchanged)."""
        if length < self.length:
            for layer in self.growable_layers:
                layer.crop(length - layer.length)

    def set_length(self, length: int) -> None:
        """Declare the first ``length`` positions valid (after filling buffers directly, e.g. a restore)."""
        if length > self.capacity:
            raise ValueError(f"length {length} exceeds capacity {self.capacity}")
        for layer in self.growable_layers:
            layer.length = length
            layer._refresh_views()

    def free(self) -> None:
        """Release the buffers (the cache is empty afterwards)."""
        for layer in self.growable_layers:
            layer._k = layer._v = None
            layer.length = 0
            layer._refresh_views()

    def fill_targets(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Reserve ``length`` positions and return per-layer ``[kv_heads, length, head_dim]`` views to
        write into (restore path); call :meth:`set_length` once they are filled."""
        self.reserve(max(length, self.capacity))
        views = []
        for layer in self.growable_layers:
            assert layer._k is not None and layer._v is not None
            views.append((layer._k[0, :, :length], layer._v[0, :, :length]))
        return views

    def copy_prefix(self, other: SessionKV, length: int) -> None:
        """Make this cache hold ``other``'s first ``length`` positions (a copy; the two stay independent)."""
        if length > other.length:
            raise ValueError(f"the source holds {other.length} positions, not {length}")
        self.truncate(0)
        for (dst_k, dst_v), (src_k, src_v) in zip(self.fill_targets(length), other.filled_layers(), strict=True):
            dst_k.copy_(src_k[:, :length])
            dst_v.copy_(src_v[:, :length])
        self.set_length(length)

    def filled_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer ``[kv_heads, length, head_dim]`` views of the valid positions (snapshot path)."""
        return [layer.filled() for layer in self.growable_layers]
