"""The HF backend's key/value caches: kept across an episode's turns, and grown in place while decoding.

`KeptCache` holds the last generate call's cache and the tokens of each of its rows, so that an agent's
next turn prefills only what is new (`HFBackend.conversation`). `growing` makes a cache's layers
append into a preallocated buffer instead of concatenating the whole cache at every decoding step.

transformers is imported inside the functions that need it.
"""

from __future__ import annotations

from typing import Any


class KeptCache:
    """The key/value cache of the last generate call and which tokens each of its rows holds (`HFBackend.conversation`)."""

    def __init__(self) -> None:
        self.cache: Any = None  # a DynamicCache, (B_old, heads, T_old, head_dim) per layer, left-padded rows
        self.rows: list[tuple[Any, int]] = []  # per old row: (its cached tokens as a numpy array, first column)

    def keep(self, tokens: list[list[int]], width: int, prompts: list[list[int]], cache: Any) -> None:
        """Remember `cache` from a batch of left-padded prompts (`width` columns): row r holds `tokens[r]` (prompt
        + sampled turn) from column width - len(prompts[r]), up to the cache's length (the last token sampled
        in the batch was never fed back, so its keys are missing)."""
        import numpy as np

        self.cache, self.rows = None, []
        if not _plain(cache):
            return  # sliding-window, static or quantized caches: not reused
        length = cache.get_seq_length()
        for ids, prompt in zip(tokens, prompts):
            start = width - len(prompt)
            self.rows.append((np.asarray(ids[: length - start], dtype=np.int64), start))
        self.cache = cache

    @classmethod
    def of_prefix(cls, tokens: list[int], cache: Any) -> KeptCache | None:
        """A kept cache of one row: `cache` holds the keys and values of `tokens` alone (batch 1, no padding), so
        that `prefill` lays them into every prompt that begins with them. None for a cache `keep` would not reuse."""
        import numpy as np

        if not _plain(cache):
            return None
        kept = cls()
        kept.cache, kept.rows = cache, [(np.asarray(tokens, dtype=np.int64), 0)]
        return kept

    def prefill(self, prompts: list[list[int]], width: int) -> Any:
        """A cache for this batch built from the kept rows: each prompt's longest kept prefix, aligned so that
        only the last `new` columns of every row still need a forward pass; None when nothing is kept or
        matches. Left padding fixes the layout: rows end together, so the uncached block is as wide as
        the longest uncached suffix, and a row with a shorter one recomputes a few cached tokens."""
        import numpy as np
        import torch

        if self.cache is None:
            return None
        matched = [self._longest_prefix(np.asarray(p, dtype=np.int64)) for p in prompts]  # (old row, length)
        new = max(len(p) - n for p, (_, n) in zip(prompts, matched))  # >= 1: the last prompt token is never cached
        cached = width - new
        if cached < 1 or all(n == 0 for _, n in matched):
            return None
        source_row = torch.zeros(len(prompts), dtype=torch.long)  # (B,)
        source_col = torch.zeros(len(prompts), cached, dtype=torch.long)  # (B, cached); padding reads column 0
        for i, (p, (row, _)) in enumerate(zip(prompts, matched)):
            k = len(p) - new  # this row's tokens inside the cached columns (<= its match)
            if k > 0:
                source_row[i] = row
                source_col[i, cached - k :] = torch.arange(self.rows[row][1], self.rows[row][1] + k)
        device = self.cache.layers[0].keys.device
        source_row, source_col = source_row.to(device)[:, None], source_col.to(device)
        for layer in self.cache.layers:  # (B_old, H, T_old, D) -> (B, H, cached, D)
            layer.keys = layer.keys.transpose(1, 2)[source_row, source_col].transpose(1, 2).contiguous()
            layer.values = layer.values.transpose(1, 2)[source_row, source_col].transpose(1, 2).contiguous()
        cache, self.cache, self.rows = self.cache, None, []  # the new call's cache replaces it when it ends
        return cache

    def _longest_prefix(self, prompt: Any) -> tuple[int, int]:
        """(kept row, n): the kept row sharing the longest prefix with `prompt`, and that prefix's length,
        at most len(prompt) - 1 (generate needs one token to run)."""
        import numpy as np

        best = (0, 0)
        for row, (ids, _) in enumerate(self.rows):
            m = min(len(ids), len(prompt) - 1)
            if m <= best[1]:
                continue
            differ = np.flatnonzero(ids[:m] != prompt[:m])
            n = int(differ[0]) if differ.size else m
            if n > best[1]:
                best = (row, n)
        return best


def cache_kwarg() -> str:
    """What generate and forward call the key/value cache: `cache` since transformers 5, `past_key_values` before."""
    from transformers.generation import utils

    return getattr(utils, "ALL_CACHE_NAMES", ["past_key_values"])[0]


def _plain(cache: Any) -> bool:
    """Whether `cache` is a full-attention dynamic cache (every layer a plain or growing `DynamicLayer`)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in (DynamicLayer, _growing_layer()) for layer in layers)


def growing(cache: Any) -> Any:
    """`cache` with every layer appending in place (`_growing_layer`), or None when it is not `_plain` (a
    sliding-window or hybrid model: generate then makes its own). A new cache has no layers yet: they are
    made as the model first writes to them."""
    from transformers.cache_utils import DynamicLayer

    growing = _growing_layer()
    if not getattr(cache, "layers", None):
        if getattr(cache, "layer_class_to_replicate", None) is not DynamicLayer:
            return None
        cache.layer_class_to_replicate = growing
        return cache
    if not _plain(cache):
        return None
    cache.layers = [growing.holding(layer) for layer in cache.layers]
    return cache


_GROWING_LAYER: type | None = None


def _growing_layer() -> type:
    """A `DynamicLayer` that appends into a preallocated buffer. transformers' concatenates the whole cache
    with each step's one new token, copying it all every decoding step, in every layer: with 32 rows of
    ~600 tokens on 2 CPU cores that was most of a decoding step (docs/BENCHMARKS.md). This one copies
    only the new token, and grows by doubling when full. `keys`/`values` stay views of the valid part, so
    code reading them (attention, `KeptCache`) sees a normal layer; anything that reassigns them
    (`batch_select_indices`, a crop) is noticed at the next append, which then starts a new buffer."""
    global _GROWING_LAYER
    if _GROWING_LAYER is not None:
        return _GROWING_LAYER
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        reserve = 128  # free slots allocated beyond what is written: a turn's decoding steps, usually
        double_adopted = False  # True: the first version's rule (an adopted cache doubled too), for bench_memory's A/B

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._keys = self._values = None  # (B, H, capacity, D) buffers

        @classmethod
        def holding(cls, layer: Any) -> Any:
            """A growing layer holding `layer`'s keys and values (copied into a buffer at the first append)."""
            grown = cls()
            if layer.is_initialized:
                grown.lazy_initialization(layer.keys, layer.values)
                grown.keys, grown.values = layer.keys, layer.values
            return grown

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            old = self.keys.shape[-2] if self.keys.dim() == 4 else 0
            n = old + key_states.shape[-2]
            owned = self._keys is not None and self.keys.data_ptr() == self._keys.data_ptr() \
                and self.keys.shape[0] == self._keys.shape[0]
            if not owned or n > self._keys.shape[-2]:
                # A full buffer of our own doubles (appends stay amortised O(1)). A cache adopted from outside (a
                # kept turn's, gathered for the next turn's prefill) gets room for this turn's decoding only:
                # doubling its `old` columns there reserved a second copy of the whole conversation's keys and
                # values that the turn never wrote (bench/bench_memory.py, docs/ARCHITECTURE.md "Memory").
                capacity = max(n + self.reserve, 2 * old) if owned or self.double_adopted else n + self.reserve
                self._keys, self._values = (self._buffer(current, new, old, capacity)
                                            for current, new in ((self.keys, key_states), (self.values, value_states)))
            self._keys[:, :, old:n] = key_states
            self._values[:, :, old:n] = value_states
            self.keys, self.values = self._keys[:, :, :n], self._values[:, :, :n]
            return self.keys, self.values

        @staticmethod
        def _buffer(current: Any, new: Any, old: int, capacity: int) -> Any:
            b, h, _, d = new.shape
            buffer = new.new_empty(b, h, capacity, d)
            if old:
                buffer[:, :, :old] = current
            return buffer

    _GROWING_LAYER = GrowingLayer
    return GrowingLayer
