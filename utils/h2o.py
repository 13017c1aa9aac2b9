"""H2O (Zhang et al. 2023) under a KV budget: each layer and kv head keeps the attention sinks, a recent window and
its heavy hitters, the positions with the largest attention accumulated over every query that has seen them.

How it stays exact for speculative decoding. H2O's evictions depend on attention weights, so a query must see
exactly what it would see decoded alone: the keys left by every earlier query's eviction. Each query row of a
pass is therefore one step of H2O's greedy rule, in order: it attends to the set its predecessors left (gathered
from the cache in ascending position order: the very tensor a one-row pass reads), adds its weights to the
scores, and once the set is full evicts the lowest-scored candidate. The set and the scores after every row are
kept until the runner knows the row is final, so rolling back rejected rows restores the state before them
exactly; only then are evicted entries removed from the cache (`H2OCache.evict`, between passes).

A prompt is read with full attention and scored by all its queries (H2O's prefill), then cut to the budget.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from utils.caching import BoundedCache, SinkWindowLayer, cache_length
from utils.snapkv import row_weights, weighted_values


SETTLE_EVERY = 16  # rows whose evictions leave the cache together: its copy is paid once per 16 rows, not per row


def split_budget(budget: int, sinks: int) -> tuple[int, int]:
    """(recent window, heavy hitters) that a query sees: H2O's even split of what the sinks leave. After the query,
    one heavy hitter goes (the lowest-scored, which may be the position that has just left the window)."""
    recent = max((budget - sinks) // 2, 1)
    return recent, budget - sinks - recent


class H2OLayer(SinkWindowLayer):
    """A cache layer with H2O's state: the first `compacted` slots are what every kv head keeps (ascending
    positions, each head its own), the slots after them the rows fed since, each with the state it left."""

    def __init__(self):
        super().__init__()
        self.compacted = 0  # slots whose evictions are final
        self.scores: Tensor | None = None  # [kv_heads, compacted]: accumulated attention
        self.rows: list[tuple[Tensor, Tensor]] = []  # per row since: (visible [kv_heads, n] slots, scores [kv, slots])

    def state(self, kv_heads: int) -> tuple[Tensor, Tensor]:
        """(visible slots [kv_heads, n], scores [kv_heads, slots]) that the next row starts from."""
        if self.rows:
            return self.rows[-1]
        device = self.keys.device
        scores = self.scores if self.scores is not None else torch.zeros(kv_heads, 0, device=device)
        return torch.arange(self.compacted, device=device).expand(kv_heads, -1), scores

    def crop(self, max_length: int) -> None:
        """DynamicLayer's crop (keeps the first `max_length` slots; a negative one removes that many), refused where
        it would reach slots whose evictions are final."""
        removed = -max_length if max_length < 0 else max(self.get_seq_length() - max_length, 0)
        if removed > len(self.rows):
            raise ValueError(f"the h2o cache cannot remove {removed} positions: only its last {len(self.rows)} "
                             "have evictions that are not final")
        super().crop(-removed)
        if removed:
            del self.rows[-removed:]

    def settle(self, pending: int) -> None:
        """Makes final all rows but the last `pending`: removes what they evicted and re-indexes the rest."""
        settled = len(self.rows) - pending
        if settled <= 0:
            return
        visible, scores = self.rows[settled - 1]  # [kv_heads, kept], [kv_heads, cut]
        cut, kept = scores.shape[1], visible.shape[1]
        total = self.keys.shape[-2]
        self.keep(visible, cut)
        device = visible.device
        lookup = torch.full((visible.shape[0], total), -1, dtype=torch.long, device=device)  # old slot -> new slot
        lookup.scatter_(1, visible, torch.arange(kept, device=device).expand_as(visible).contiguous())
        lookup[:, cut:] = torch.arange(kept, kept + total - cut, device=device)
        self.rows = [(lookup.gather(1, v), torch.cat([s.gather(1, visible), s[:, cut:]], dim=1))
                     for v, s in self.rows[settled:]]
        self.compacted, self.scores = kept, scores.gather(1, visible)

    def compress(self, scores: Tensor, budget: int, sinks: int, recent: int) -> None:
        """After a prompt pass: keeps the sinks, the `recent` last slots and the best-scored of the rest, so that the
        next query sees `budget` positions. `scores`: [kv_heads, slots], the prompt's queries' weights: the only ones,
        as every prompt of a compressing runner is read into a fresh cache (`ModelRunner.start_sequence`)."""
        total = self.keys.shape[-2] if self.is_initialized else 0
        heavy = budget - 1 - sinks - recent  # after the prompt's last query has evicted
        if total > budget - 1:
            middle = scores[:, sinks : total - recent]  # [kv_heads, candidates]
            best = middle.topk(heavy, dim=-1).indices.sort(dim=-1).values + sinks
            kv_heads, device = scores.shape[0], scores.device
            slots = torch.cat([torch.arange(sinks, device=device).expand(kv_heads, -1), best,
                               torch.arange(total - recent, total, device=device).expand(kv_heads, -1)], dim=1)
            self.keep(slots, total)
            scores = scores.gather(1, slots)
        self.compacted, self.scores, self.rows = min(total, budget - 1), scores, []


class H2OCache(BoundedCache):
    """A bounded cache under H2O: `sinks` first positions, a recent window and the heavy hitters (`split_budget`).
    Built by `utils.caching.new_cache` for a model whose KV policy is h2o. Entries held: at most the budget less
    one, plus the rows not settled yet (fewer than `SETTLE_EVERY` past a drafter's reserve) and one pass."""

    def __init__(self, sinks: int, window: int):
        super().__init__(sinks, window, layer_class=H2OLayer)
        self.budget = sinks + window
        self.recent = split_budget(self.budget, sinks)[0]

    def evict(self, reserve: int = 0) -> int:
        """Between passes: the rows fed so far are final but for the last `reserve` (a drafter's round), and what
        they evicted leaves the cache once `SETTLE_EVERY` rows are due (until then it is only not attended to)."""
        due = len(self.layers[0].rows) - reserve if self.layers else 0
        return self.settle(reserve) if due >= SETTLE_EVERY else 0

    def settle(self, reserve: int = 0) -> int:
        """Removes now what the rows but the last `reserve` evicted; returns the number of entries removed."""
        before = cache_length(self)
        for layer in self.layers:
            layer.settle(reserve)
        return before - cache_length(self)

    def compress(self, observation, protect: int = 0) -> None:
        for index, layer in enumerate(self.layers):
            total = layer.keys.shape[-2] if layer.is_initialized else 0
            layer.compress(observation.scores(index, total), self.budget, self.sinks, self.recent)

    def can_remove(self, count: int) -> bool:
        return all(count <= len(layer.rows) for layer in self.layers)


ACTIVE: H2OCache | None = None  # the cache of the pass in progress, read by the row-wise attention


@contextmanager
def attending(cache):
    """A pass of a runner whose cache is an `H2OCache`: its rows follow H2O's rule (`attend`)."""
    global ACTIVE
    ACTIVE = cache if isinstance(cache, H2OCache) else None
    try:
        yield
    finally:
        ACTIVE = None


def attend(cache: H2OCache, layer_index: int, query: Tensor, key: Tensor, value: Tensor,
           scaling: float | None) -> Tensor:
    """`query`: [1, heads, q, dim], `key`/`value`: [1, kv_heads, slots, dim] (the pass's rows last) ->
    [1, q, heads, dim], each row attending to what H2O leaves it, in order."""
    layer = cache.layers[layer_index]
    queries = query.shape[2]
    kv_heads, slots = key.shape[1], key.shape[2]
    visible, scores = layer.state(kv_heads)
    head = torch.arange(kv_heads, device=key.device)[:, None]  # [kv_heads, 1]: indexes rows of whole slots
    rows = []
    for i in range(queries):
        slot = slots - queries + i
        visible = torch.cat([visible, visible.new_full((kv_heads, 1), slot)], dim=1)  # [kv_heads, n]
        k, v = key[0][head, visible], value[0][head, visible]  # [kv_heads, n, dim], ascending positions
        weights = row_weights(query[0, :, i], k, scaling)  # [kv_heads, group, n]
        rows.append(weighted_values(weights, v))  # [heads, dim]
        scores = F.pad(scores, (0, slot + 1 - scores.shape[1])).scatter_add(1, visible, weights.mean(1))
        if visible.shape[1] >= cache.budget:
            visible = evict_one(visible, scores, cache.sinks, cache.recent)
        layer.rows.append((visible, scores))
    return torch.stack(rows)[None]  # [1, q, heads, dim]


def evict_one(visible: Tensor, scores: Tensor, sinks: int, recent: int) -> Tensor:
    """[kv_heads, n] -> [kv_heads, n - 1]: each head drops its lowest-scored slot between the sinks and the recent
    window (the first one on a tie)."""
    kv_heads, n = visible.shape
    candidates = visible[:, sinks : n - recent]  # [kv_heads, heavy]
    drop = scores.gather(1, candidates).argmin(dim=1) + sinks  # [kv_heads]
    after = torch.arange(n - 1, device=visible.device).expand(kv_heads, -1)  # [kv_heads, n - 1]
    return visible.gather(1, after + (after >= drop[:, None]))  # each head skips its dropped slot
