"""Keys and values of shared prompt prefixes: computed once, attended to by every row that starts with one.

Rows of one micro-batch or one generation chunk often begin with the same tokens (a group's system prompt and
task text, its common first turns). The CPU update (`empo2.lit.packing`) and the HF engine's
prefill (`HFEngine._prefill`) run each distinct prefix once, then the rest of every row with the prefix's
cache as its past: the same numbers to float32 rounding, for fewer positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class PrefixCaches:
    """One decoder pass per prefix length over the distinct `prefixes` (token tuples; empty ones are skipped),
    keeping every layer's keys and values, (k, heads, length, head dim), with their autograd graph when
    gradients are on. `ok` is False when the model's cache layers hold more than keys and values (sliding
    window, ...): then no prefix can be shared."""

    def __init__(self, decoder, prefixes: list[tuple[int, ...]], device: torch.device):
        by_length: dict[int, dict[tuple[int, ...], int]] = {}
        for p in prefixes:
            if p:
                slots = by_length.setdefault(len(p), {})
                slots.setdefault(p, len(slots))
        self.ok = True
        self._layers: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._slots: dict[tuple[int, ...], int] = {}
        for length, slots in by_length.items():
            ids = torch.tensor(list(slots), device=device)  # (k, length): unpadded, positions from 0
            cache = decoder(input_ids=ids, use_cache=True).past_key_values
            if any(type(layer) is not DynamicLayer for layer in cache.layers):
                self.ok = False
                return
            self._layers[length] = [(layer.keys, layer.values) for layer in cache.layers]
            self._slots.update(slots)

    def rows(self, prefixes: list[tuple[int, ...]]) -> DynamicCache:
        """A cache with one row per entry of `prefixes` (all of one length; a prefix may repeat)."""
        at = torch.tensor([self._slots[p] for p in prefixes])
        cache = DynamicCache()
        for i, (k, v) in enumerate(self._layers[len(prefixes[0])]):
            cache.update(k.index_select(0, at.to(k.device)), v.index_select(0, at.to(v.device)), i)
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
