"""Keys and values of shared prompt prefixes: computed once, attended to by every row that starts with one.

Rows of one micro-batch or one generation chunk often begin with the same tokens (a group's system prompt and
task text, its common first turns). The CPU update (`empo2.lit.packing`) and the HF engine's
prefill (`HFEngine._prefill`) run each distinct prefix once, then the rest of every row with the prefix's
cache as its past: the same numbers to float32 rounding, for fewer positions. Under gradient checkpointing too:
the caches here give a layer's recompute in the backward pass the keys and values its first run saw, and store
nothing more (`caches_through_checkpoints`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer


class _Recorded(DynamicLayer):
    """Keeps the keys and values of its layer's first call and hands every call's back unchanged: a checkpointed
    layer's recompute in the backward pass stores nothing twice."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class _Extended(DynamicLayer):
    """A prefix's keys and values, followed by each call's own, which it does not keep: every call, a checkpointed
    layer's recompute included, sees the prefix alone as its past."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


@contextmanager
def caches_through_checkpoints(model) -> Iterator[None]:
    """Lets `model`'s checkpointed decoder layers (gradient checkpointing, in training) use the cache passed to
    them, which transformers otherwise drops, as a recompute would store into a growing cache a second time. Only
    for the caches here, which store nothing on a recompute. The layer keeps its arguments for the recompute, so
    the backward pass needs nothing of this. Non-reentrant checkpointing only (what `empo2.workflows.train`
    enables): a reentrant one runs the forward without a graph, and the prefix's keys and values would pass no
    gradient back."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


class PrefixCaches:
    """One decoder pass per prefix length over the distinct `prefixes` (token tuples; empty ones are skipped),
    keeping every layer's keys and values, (k, heads, length, head dim), with their autograd graph when
    gradients are on, also through checkpointed layers. `ok` is False when the model's cache layers hold more
    than keys and values (sliding window, ...), or its checkpointed layers would drop a cache (a transformers
    without `_can_checkpoint_with_cache`): then no prefix can be shared."""

    def __init__(self, decoder, prefixes: list[tuple[int, ...]], device: torch.device):
        by_length: dict[int, dict[tuple[int, ...], int]] = {}
        for p in prefixes:
            if p:
                slots = by_length.setdefault(len(p), {})
                slots.setdefault(p, len(slots))
        plain = DynamicCache(config=decoder.config).layers  # the layers the model's own cache would have
        checkpointed = any(m.gradient_checkpointing and m.training for m in decoder.modules()
                           if isinstance(m, GradientCheckpointingLayer))
        self.ok = all(type(layer) is DynamicLayer for layer in plain) and (
            not checkpointed or hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache"))
        self._layers: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._slots: dict[tuple[int, ...], int] = {}
        if not self.ok:
            return
        for length, slots in by_length.items():
            ids = torch.tensor(list(slots), device=device)  # (k, length): unpadded, positions from 0
            cache = DynamicCache()
            cache.layers = [_Recorded() for _ in plain]
            with caches_through_checkpoints(decoder):
                # the cache is at hand: `use_cache` would only return it (and is refused under checkpointing)
                decoder(input_ids=ids, past_key_values=cache, use_cache=False)
            self._layers[length] = [(layer.keys, layer.values) for layer in cache.layers]
            self._slots.update(slots)

    def detach(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Puts leaves in place of the kept keys and values that carry a graph, so the passes that attend to them
        end their graphs there; returns (those keys and values, their leaves): the prefix passes' own backward,
        once the leaves hold every pass's gradient (`EMPO2Module.backward_passes`)."""
        ends, leaves = [], []
        for length, layers in self._layers.items():
            kept = []
            for pair in layers:
                pair_leaves = []
                for t in pair:
                    leaf = t.detach().requires_grad_(t.requires_grad)
                    if t.requires_grad:
                        ends.append(t)
                        leaves.append(leaf)
                    pair_leaves.append(leaf)
                kept.append(tuple(pair_leaves))
            self._layers[length] = kept
        return tuple(ends), tuple(leaves)

    def rows(self, prefixes: list[tuple[int, ...]], grow: bool = True) -> DynamicCache:
        """A cache with one row per entry of `prefixes` (all of one length; a prefix may repeat). It keeps what a
        pass adds (`grow`, to read the whole prompt's cache back) or, without `grow`, only lends the prefix to
        every call: what a checkpointed pass needs (`caches_through_checkpoints`)."""
        at = torch.tensor([self._slots[p] for p in prefixes])
        cache = DynamicCache()
        for i, (k, v) in enumerate(self._layers[len(prefixes[0])]):
            k, v = k.index_select(0, at.to(k.device)), v.index_select(0, at.to(v.device))
            if grow:
                cache.update(k, v, i)
            else:
                cache.layers.append(_Extended(k, v))
        return cache


def cheapest_runs(n: int, cost: Callable[[int, int], float]) -> list[tuple[int, int]]:
    """Items 0..n-1, in their order, cut into consecutive runs [i, j) whose summed `cost(i, j)` is least (dynamic
    programming over the cut points, O(n^2) calls of `cost`). How the update groups rows into passes
    (`length_buckets`) and the prefill groups prompts under stems (`_stems`)."""
    best = [0.0] + [math.inf] * n  # best[j]: the cheapest cut of the first j items
    start = [0] * (n + 1)  # where the last run of that cut starts
    for j in range(1, n + 1):
        for i in range(j):
            total = best[i] + cost(i, j)
            if total < best[j]:
                best[j], start[j] = total, i
    runs, j = [], n
    while j:
        runs.append((start[j], j))
        j = start[j]
    return runs[::-1]
