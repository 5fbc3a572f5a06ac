"""KV cache for incremental decoding: each attention layer keeps the keys and values it has computed.

A step feeds only the new tokens (at positions ``offset`` onwards); each layer appends its new keys and
values [b, groups_local, s_new, d] to preallocated buffers and attends over everything so far. Under
TP a rank caches only its own KV groups; under PP a rank caches only its own layers (the cache is keyed
by global layer number, like the parameters), so the cache is sharded exactly like the model.

The model reads ``offset`` and calls ``layer(number).update(k, v)``; the caller ``advance``s the offset
after every rank has run its layers for the step. The two tensors a layer keeps need not have one shape:
a multi-latent attention layer (model/mla.py) keeps its latent [b, 1, s, --kv-lora-rank] and its rotated
key [b, 1, s, --qk-pos-emb-head-dim] in their place, on every TP rank, instead of per-head keys and values
(``nbytes`` counts what a cache holds; docs/models.md compares the two kinds per token).

A sliding-window layer (--window-size) passes its window: it keeps only the window - 1 latest positions
between steps (a query sees itself and the window - 1 before it), so its cache is bounded by the window,
not by the generated length; the attention masks by relative position, so the dropped past is not missed.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """One layer's keys and values: [b, groups_local, capacity, d] buffers (each of its own width), the first
    ``length`` filled."""

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v [b, g, s, d] at positions offset..offset+s-1; return all of [0, offset+s),
        or with ``window`` > 0 the window - 1 positions before the step and the step's own."""
        if window:
            return self._update_window(k, v, window)
        start, s = self.owner.offset, k.shape[2]
        end = start + s
        if self.k is None:
            self.k = k.new_empty((*k.shape[:2], self.owner.capacity, k.shape[3]))
            self.v = v.new_empty((*v.shape[:2], self.owner.capacity, v.shape[3]))
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; step needs {end}")
        if k.shape[0] != self.k.shape[0]:
            raise ValueError(f"KV cache was built for batch {self.k.shape[0]}, got {k.shape[0]}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def _update_window(self, k: torch.Tensor, v: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.owner.offset + k.shape[2] > self.owner.capacity:
            raise ValueError(f"KV cache holds {self.owner.capacity} positions; step needs "
                             f"{self.owner.offset + k.shape[2]}")
        if self.k is not None and k.shape[0] != self.k.shape[0]:
            raise ValueError(f"KV cache was built for batch {self.k.shape[0]}, got {k.shape[0]}")
        if self.k is None or self.owner.offset == 0:
            kk, vv = k, v
        else:
            kk, vv = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        first = max(kk.shape[2] - (window - 1), 0)
        self.k, self.v = kk[:, :, first:].clone(), vv[:, :, first:].clone()
        return kk, vv

    @property
    def held(self) -> int:
        """Positions this layer's cache holds in memory."""
        return 0 if self.k is None else self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes this layer's buffers hold."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)


class KVCache:
    """The cache of every layer this rank holds, for sequences of up to ``capacity`` positions."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.offset = 0  # positions already cached (the next token's position)
        self._layers: dict[int, LayerKVCache] = {}

    def layer(self, number: int) -> LayerKVCache:
        if number not in self._layers:
            self._layers[number] = LayerKVCache(self)
        return self._layers[number]

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds over all of this rank's layers."""
        return sum(layer.nbytes for layer in self._layers.values())

    def advance(self, steps: int) -> None:
        """Called once the step's new positions are stored in every layer of this rank."""
        if self.offset + steps > self.capacity:
            raise ValueError(f"KV cache overflow: {self.offset} + {steps} > capacity {self.capacity}")
        self.offset += steps
