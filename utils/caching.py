"""The KV-cache core: one place where the cache entries of rejected drafts are removed, and the bounded cache.

Only the public API of transformers' caches is used: `Cache.crop` (which in the pinned transformers takes a
*negative* count of tokens to remove) and, for a static cache, rewinding the per-layer write position that the
model reads its positions from, as gpt-fast rewinds its input position.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
    StaticCache,
    StaticLayer,
)

from utils.arguments import integer

# Room a GrowingLayer adds when it is full: half its length again, at least this many positions.
MIN_ROOM = 256
UNSUPPORTED_REASON = {
    "QuantizedCache": "its quantized part cannot be cut back token by token",
    "StaticSlidingWindowLayer": "its ring buffer overwrites the entries a rollback would need",
    "LinearAttentionLayer": "it holds a recurrent state (Mamba, convolution or linear-attention layers), which "
                            "cannot be cut back to the tokens before a rejected draft",
    "LinearAttentionAndFullAttentionLayer": "its recurrent half cannot be cut back to the tokens before a rejected "
                                            "draft",
}


# Where a model's KV budget lives: (sinks, window) and the eviction policy, set by
# `utils.models.rowwise_attention.use_kv_budget`.
KV_BUDGET_ATTRIBUTE = "specdec_kv_budget"
KV_POLICY_ATTRIBUTE = "specdec_kv_policy"
# StreamingLLM's finding: four initial tokens hold the attention mass a softmax must put somewhere. Kept by every
# bound on what a model attends to: `--kv-budget`'s policies and the drafter's window.
SINKS = 4
KV_POLICIES = ("streaming", "h2o", "snapkv")
CACHE_POLICIES = ("h2o", "snapkv")  # policies that choose what a cache keeps from attention weights: cache on only


def kv_budget(model: torch.nn.Module) -> tuple[int, int] | None:
    """(sinks, window) of a model, or of one of its layers (they share its config), or None."""
    return getattr(model.config, KV_BUDGET_ATTRIBUTE, None)


def kv_policy(model: torch.nn.Module) -> str:
    """Which positions a bounded cache keeps besides the recent window: `streaming` (the first ones), `h2o` (the
    most attended so far, `utils/h2o.py`) or `snapkv` (the prompt's most attended ones, `utils/snapkv.py`)."""
    return getattr(model.config, KV_POLICY_ATTRIBUTE, "streaming")


class SinkWindowLayer(DynamicLayer):
    """A dynamic layer that can forget the entries between its attention sinks and its recent window."""

    def evict(self, sinks: int, recent: int) -> int:
        """Keeps the first `sinks` and the last `recent` entries; returns how many were removed."""
        if not self.is_initialized:
            return 0
        stored = self.keys.shape[-2]
        removed = stored - sinks - recent
        if removed <= 0:
            return 0
        self.keys = torch.cat([self.keys[..., :sinks, :], self.keys[..., stored - recent :, :]], dim=-2)
        self.values = torch.cat([self.values[..., :sinks, :], self.values[..., stored - recent :, :]], dim=-2)
        return removed

    def keep(self, slots: Tensor, candidates: int) -> None:
        """Of the first `candidates` entries, keeps `slots` ([kv_heads, kept], each head its own), and all after."""
        head = torch.arange(slots.shape[0], device=slots.device)[:, None]  # [kv_heads, 1]
        self.keys = torch.cat([self.keys[:, head, slots], self.keys[..., candidates:, :]], dim=-2)
        self.values = torch.cat([self.values[:, head, slots], self.values[..., candidates:, :]], dim=-2)


class GrowingLayer(DynamicLayer):
    """A full-attention layer whose keys and values are views of buffers with room to spare: an update copies in
    only its own rows, where DynamicLayer concatenates the whole cache again each pass (the 1.5B's 4-row
    verification: 3.5-3.8 ms of updates at 200 positions, 10-13 at 1500; this way 2.0-3.4, benchmarks/RESULTS.md,
    tenth pass). When full, the buffers grow by half once (one copy). `crop` is DynamicLayer's (shorter views);
    the next update writes over what it cut. The views are strided, so only models whose attention reads strided
    keys get it (`new_cache`)."""

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.room: tuple[Tensor, Tensor] | None = None  # [batch, kv heads, capacity, dim] each

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        start, rows = self.get_seq_length() if self.is_initialized else 0, key_states.shape[-2]
        keys, values = self.room_for(rows, key_states, value_states)
        keys[..., start : start + rows, :].copy_(key_states)
        values[..., start : start + rows, :].copy_(value_states)
        return self.written(rows)

    def room_for(self, rows: int, key_like: Tensor, value_like: Tensor) -> tuple[Tensor, Tensor]:
        """The buffers, with room for `rows` positions past those held ([batch, kv heads, capacity, dim] each;
        `*_like`: any tensor of the new entries' batch, heads, dim, dtype and device)."""
        if not self.is_initialized:
            self.lazy_initialization(key_like, value_like)
        end = self.get_seq_length() + rows
        if self.room is None or end > self.room[0].shape[-2]:
            capacity = end + max(end // 2, MIN_ROOM)
            self.room = (self.grown(self.keys, key_like, capacity), self.grown(self.values, value_like, capacity))
        return self.room

    def written(self, rows: int) -> tuple[Tensor, Tensor]:
        """After `rows` new positions were written into `room_for`'s buffers: the views that hold them too."""
        end = self.get_seq_length() + rows
        keys, values = self.room
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    @staticmethod
    def grown(held: Tensor, new: Tensor, capacity: int) -> Tensor:
        room = new.new_empty((*new.shape[:-2], capacity, new.shape[-1]))
        if held.numel():
            room[..., : held.shape[-2], :].copy_(held)
        return room


class GrowingCache(DynamicCache):
    """DynamicCache with its full-attention layers as GrowingLayer (sliding-window layers stay as they are)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]

    def rooms(self, rows: int, key_like: Tensor, value_like: Tensor) -> tuple[list[Tensor], list[Tensor], int] | None:
        """For a pass that writes every layer's `rows` new entries itself (`torch.ops.specdec.decoder_stack`): the
        layers' buffers and the first position to write, or None where a layer is not a GrowingLayer. Call
        `written(rows)` once they are written."""
        if not all(type(layer) is GrowingLayer for layer in self.layers):
            return None
        start = self.get_seq_length()
        pairs = [layer.room_for(rows, key_like, value_like) for layer in self.layers]
        return [k for k, _ in pairs], [v for _, v in pairs], start

    def written(self, rows: int) -> None:
        for layer in self.layers:
            layer.written(rows)


# Layer classes whose `crop` restores exactly the state before the removed tokens were added.
CROPPABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, GrowingLayer)


class BoundedCache(Cache):
    """StreamingLLM-style memory bound: `sinks` first positions plus a window of recent ones.

    Eviction runs only between passes and keeps the `window - 1` newest entries, which is what the next query
    sees besides itself (row-wise attention gives each query the sinks and its last `window` keys; see
    `utils/models/rowwise_attention.py`). A rollback only removes entries added after an eviction, so it stays
    exact, and every query sees the same keys whether decoded alone, verified among drafts, or recomputed
    without a cache. Entries held: at most sinks + window - 1 + the width of one pass.
    """

    def __init__(self, sinks: int, window: int, layer_class: type = SinkWindowLayer):
        super().__init__(layer_class_to_replicate=layer_class)
        self.sinks, self.window = sinks, window

    def evict(self, reserve: int = 0) -> int:
        """Forgets what no later query can see, but for `reserve` more recent entries (a drafter's next rollback
        must find its drafts; attention still reads only the window); returns the number of positions removed."""
        removed = [layer.evict(self.sinks, self.window - 1 + reserve) for layer in self.layers]
        return removed[0] if removed else 0

    def settle(self) -> int:
        """Forgets now everything no later query can see (before a prompt pass, which reads all that is held)."""
        return self.evict(0)

    def keep_recent(self, count: int) -> None:
        """Keeps the sinks and at most `count` of the newest entries past them: a windowed runner's next pass starts
        its window there (count <= 0: it skips ahead, past everything but the sinks)."""
        for layer in self.layers:
            layer.evict(self.sinks, max(count, 0))

    def compress(self, observation, protect: int) -> None:
        """SnapKV after a prompt pass: each layer keeps its `sinks` best-observed entries among all but the last
        `protect` (the next query's recent window), which stay."""
        from utils.snapkv import kept_slots

        for index, layer in enumerate(self.layers):
            stored = layer.keys.shape[-2] if layer.is_initialized else 0
            candidates = stored - protect
            if candidates > self.sinks:
                layer.keep(kept_slots(observation.scores(index, stored), candidates, self.sinks), candidates)

    def recent_length(self) -> int:
        """Entries held past the sinks: the most a rollback can remove."""
        return max(cache_length(self) - self.sinks, 0)


def cache_refusal(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run with a KV cache that `prune_cache` rolls back, in one line, or None; decided once
    per model (a cache-off runner makes a cache for every long pass).

    Recurrent models keep a state that only grows: Mamba's own `cache_params` (its forward takes no
    `past_key_values`, so a cache passed there would be ignored and each pass would see only its new tokens), and
    the state layers transformers' DynamicCache builds for hybrid models (LFM2's convolutions, Qwen3-Next's and
    Jamba's linear attention, RecurrentGemma's recurrence)."""
    if model not in REFUSALS:
        REFUSALS[model] = judge_cache(model)
    return REFUSALS[model]


REFUSALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> cache_refusal's answer


def judge_cache(model: torch.nn.Module) -> str | None:
    name = type(model).__name__
    parameters = inspect.signature(model.forward).parameters
    # A forward of **kwargs alone (torch.compile's wrapper, adapters) is judged by its config's cache below.
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if "past_key_values" not in parameters and ("cache_params" in parameters or not passes_on):
        return (f"{name} keeps its own recurrent state instead of a KV cache, which cannot be cut back to the "
                "tokens before a rejected draft")
    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # noqa: BLE001 - a config transformers' own cache cannot read: as before, the passes will say
        return None
    bad = uncroppable(layers)
    return f"{name}'s cache has {bad[0]} layers: {bad[1]}" if bad else None


def uncroppable(layers) -> tuple[str, str] | None:
    """The first layer `prune_cache` cannot cut back exactly, as (its class name, why), or None."""
    bad = next((type(layer).__name__ for layer in layers if type(layer) not in CROPPABLE_LAYERS), None)
    return None if bad is None else (bad, UNSUPPORTED_REASON.get(bad, "it cannot be rolled back exactly"))


def new_cache(model: torch.nn.Module) -> Cache:
    """A fresh cache for `model` that `prune_cache` can always roll back: bounded when the model has a KV budget;
    ValueError for a model whose state cannot be rolled back (`cache_refusal`).

    Sliding-window layers drop old entries as they go; recording the past keeps them until the next prune, so a
    rollback after the window has filled is still exact.
    """
    if refusal := cache_refusal(model):
        raise ValueError(f"{refusal}; run it with the cache off")
    config = model.config
    budget = kv_budget(model)
    if budget is not None:
        if kv_policy(model) == "h2o":
            from utils.h2o import H2OCache

            return H2OCache(*budget)
        return BoundedCache(*budget)
    # models that read strided keys (the native lean forward) fill buffers in place instead of concatenating
    growing = getattr(model, "reads_strided_cache", False) and not config.is_encoder_decoder
    decoder_cache = GrowingCache(config) if growing else DynamicCache(config=config)
    decoder_cache.activate_past_recording()
    if config.is_encoder_decoder:
        return EncoderDecoderCache(decoder_cache, DynamicCache(config=config))
    return decoder_cache


def cache_length(cache: Any) -> int:
    """Number of positions held by the (self-attention part of the) cache."""
    if cache is None:
        return 0
    if isinstance(cache, tuple):
        if len(cache) == 0:
            return 0
        layer = cache[0]
        if not (isinstance(layer, tuple) and len(layer) >= 2 and all(isinstance(t, Tensor) for t in layer)):
            raise ValueError("a legacy cache is a tuple of per-layer (key, value[, cross key, cross value]) tuples "
                             "of tensors")
        return layer[0].shape[-2]
    return int(cache.get_seq_length())


def layer_lengths(cache: Any) -> list[int]:
    """Positions held by each layer of the (self-attention part of the) cache that holds any of its own (a layer
    that shares another's keys holds none). A pass cut short between two layers leaves them unequal."""
    if cache is None:
        return []
    if isinstance(cache, tuple):
        return [layer[0].shape[-2] for layer in cache]
    cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    return [int(layer.get_seq_length()) for layer in cache.layers if getattr(layer, "is_initialized", True)]


def trim_sliding(cache: Any) -> None:
    """Sliding-window layers keep what they recorded (`new_cache`) until a crop; with nothing to roll back, a crop
    of none drops what lies before their window (transformers' `crop(0)`), so that they hold a window, not the
    whole sequence, through rounds without a rejection."""
    cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    for layer in cache.layers if isinstance(cache, Cache) else ():
        # an empty layer's crop fails on its missing keys; one within its window has nothing before it
        if (isinstance(layer, DynamicSlidingWindowLayer) and layer.is_initialized
                and layer.get_seq_length() >= layer.sliding_window):
            layer.crop(0)


def prune_cache(cache: Any, num_tokens_to_discard: int) -> Any:
    """Removes the last `num_tokens_to_discard` positions of `cache`.

    - `None` -> `None`.
    - legacy tuple of per-layer tuples -> a new, truncated tuple (for encoder-decoder layers of four tensors,
      only the two self-attention tensors are cut).
    - `DynamicCache` (full or sliding window), `EncoderDecoderCache` over them (self-attention only) and
      `StaticCache` of full-attention layers (rolled back by position) -> pruned in place and returned.
    - anything else -> `ValueError` naming the type.
    """
    if cache is None:
        return None
    n = integer("num_tokens_to_discard", num_tokens_to_discard)  # numpy ints and 0-d tensors too, as counts
    if isinstance(cache, tuple):
        check_count(n, cache_length(cache))
        return prune_legacy(cache, n)
    if not isinstance(cache, Cache):
        raise ValueError(f"prune_cache does not support caches of type {type(cache).__name__}")
    self_attention = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    check_supported(self_attention)
    check_count(n, cache_length(self_attention))
    if n == 0:
        return cache
    if isinstance(self_attention, StaticCache):
        rewind_static(self_attention, n)
    else:
        check_sliding_rollback(self_attention, n)
        self_attention.crop(-n)
    return cache


def check_count(n: int, length: int) -> None:
    if n < 0:
        raise ValueError(f"cannot discard a negative number of tokens ({n})")
    if n > length:
        raise ValueError(f"cannot discard {n} tokens from a cache that holds {length}")


def check_supported(cache: Cache) -> None:
    name = type(cache).__name__
    if isinstance(cache, StaticCache):
        bad = [layer for layer in cache.layers if type(layer) is not StaticLayer]
        if bad:
            layer_name = type(bad[0]).__name__
            reason = UNSUPPORTED_REASON.get(layer_name, "it cannot be rolled back exactly")
            raise ValueError(f"prune_cache does not support {name} with {layer_name} layers: {reason}")
        return
    if isinstance(cache, BoundedCache):
        return  # its layers are SinkWindowLayer, a DynamicLayer whose crop is the inherited one (or H2O's, checked)
    if type(cache) not in (DynamicCache, GrowingCache):
        reason = UNSUPPORTED_REASON.get(name, "it cannot be rolled back exactly")
        raise ValueError(f"prune_cache does not support caches of type {name}: {reason}")
    if bad := uncroppable(cache.layers):
        raise ValueError(f"prune_cache does not support {name} with {bad[0]} layers: {bad[1]}")


class SlidingRollbackError(ValueError):
    """A rollback past what a sliding-window layer still holds: the caller reads the sequence again."""


def check_sliding_rollback(cache: Cache, n: int) -> None:
    """A sliding layer past its window can only roll back what it recorded (see `new_cache`): its `crop` keeps the
    last `window - 1` entries, and recording keeps what was fed since, until that crop. So two rollbacks with no
    pass between (a kept runner cut back to a new prompt's shared prefix, then one more position to read its
    last token), or one longer than the last pass was wide, would leave fewer entries than its length claims:
    transformers' crop does not check it, and the next pass failed on the mask's shape or ran on wrong keys."""
    for idx, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer) and layer.get_seq_length() >= layer.sliding_window:
            if not cache.is_recording_past(idx):
                raise ValueError(
                    "this sliding-window DynamicCache has filled its window without recording the past, so "
                    "its dropped entries are lost; create it with utils.caching.new_cache(model)"
                )
            length, held = layer.get_seq_length(), layer.keys.shape[-2]  # positions length-held .. length-1
            if held < min(length, n + layer.sliding_window - 1):
                raise SlidingRollbackError(
                    f"cannot discard {n} positions from a sliding window of {layer.sliding_window}: it recorded "
                    f"{held - layer.sliding_window + 1} since its last rollback"
                )


def rewind_static(cache: StaticCache, n: int) -> None:
    # The stale entries stay in the buffer but sit after the new write position: the causal mask hides them and
    # the next forward overwrites them.
    for layer in cache.layers:
        if layer.is_initialized:
            layer.cumulative_length.sub_(n)


def prune_legacy(cache: tuple, n: int) -> tuple:
    if n == 0:
        return cache
    pruned = []
    for layer in cache:
        # Decoder layers hold (key, value); encoder-decoder layers add (cross key, cross value), left whole.
        self_attention = tuple(t[..., :-n, :] for t in layer[:2])
        pruned.append(self_attention + tuple(layer[2:]))
    return tuple(pruned)
