"""SnapKV (Li et al. 2024) under a KV budget: after a prompt is read with full attention, each layer and kv head
keeps the prompt positions its last queries attended to most; what follows is streamed as under the default
policy, the kept positions playing the part of StreamingLLM's sinks.

How it stays exact for speculative decoding: the prompt's pass is the first pass after `ModelRunner.reuse` (or a
new runner), the same for every generator; its observation rows are final positions only (never drafts), and
the compression runs between passes. Afterwards the row-wise rule of the budget (the first `sinks` slots and the
query's last `window` keys) is a rule of the query's position alone, as for streaming.

Observation: the attention weights of the prompt's last `OBSERVATION` queries, averaged over the query heads
that share a kv head, summed over those queries and max-pooled along the keys (a kept position brings its
neighbours' context), as SnapKV's reference implementation does.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.nn.functional as F
from torch import Tensor

OBSERVATION = 32  # prompt queries whose attention decides what is kept (SnapKV's observation window)
POOL = 7  # max-pooling kernel along the keys (SnapKV's default)
RECENT_SHARE = 4  # the recent window is budget // RECENT_SHARE; the rest holds the kept prompt positions


def split_budget(budget: int) -> tuple[int, int]:
    """(kept prompt positions, recent window) of a SnapKV budget."""
    window = max(budget // RECENT_SHARE, 2)
    return budget - window, window


def row_weights(query: Tensor, key: Tensor, scaling: float | None) -> Tensor:
    """One query's attention weights, computed explicitly (SDPA does not return them): `query` [heads, dim],
    `key` [kv_heads, keys, dim] -> float32 [kv_heads, group, keys], each kv head shared by its group of heads."""
    kv_heads, dim = key.shape[0], key.shape[-1]
    q = query.contiguous().view(kv_heads, -1, dim)  # [kv_heads, group, dim]
    return (q @ key.transpose(-1, -2) * (scaling if scaling is not None else dim**-0.5)).float().softmax(-1)


def weighted_values(weights: Tensor, value: Tensor) -> Tensor:
    """The output of `row_weights`' query: [kv_heads, group, keys] x `value` [kv_heads, keys, dim] -> [heads, dim]."""
    return (weights.to(value.dtype) @ value).view(-1, value.shape[-1])


@dataclass
class Observation:
    first: int  # the slots whose queries are observed: [first, last)
    last: int
    sums: dict[int, Tensor] = field(default_factory=dict)  # layer -> [kv_heads, keys]: the observed weights summed

    def record(self, layer: int, slot: int, query: Tensor, key: Tensor, scaling: float | None) -> Tensor | None:
        """`query`: [1, heads, 1, dim], `key`: [1, kv_heads, keys, dim]: adds the weights this query's softmax gives,
        averaged over the query heads of each kv head (a query never attends to later keys: they get nothing).
        Returns the weights, [kv_heads, group, keys], or None for a query not observed."""
        if not self.first <= slot < self.last:
            return None
        weights = row_weights(query[0, :, 0], key[0], scaling)  # [kv_heads, group, keys]
        row = weights.mean(1)  # [kv_heads, keys]
        total = self.sums.get(layer)
        if total is None:  # sized once: an observed query sees at most `last` keys
            total = self.sums[layer] = row.new_zeros(row.shape[0], self.last)
        total[:, : row.shape[-1]] += row
        return weights

    def scores(self, layer: int, slots: int) -> Tensor:
        """[kv_heads, slots]: the observed weights summed, zero for the keys no observed query saw."""
        total = self.sums[layer][:, :slots]
        return F.pad(total, (0, slots - total.shape[-1]))


ACTIVE: Observation | None = None  # the prompt pass in progress, read by the row-wise attention


@contextmanager
def observing(first: int, last: int):
    """A prompt pass: every query attends to everything, and the observed ones are recorded."""
    global ACTIVE
    ACTIVE = Observation(first, last)
    try:
        yield ACTIVE
    finally:
        ACTIVE = None


def kept_slots(scores: Tensor, candidates: int, keep: int) -> Tensor:
    """`scores`: [kv_heads, >= candidates] -> [kv_heads, keep] slots among the first `candidates`, ascending."""
    pooled = F.max_pool1d(scores[None, :, :candidates], POOL, stride=1, padding=POOL // 2)[0]  # [kv, candidates]
    return pooled.topk(keep, dim=-1).indices.sort(dim=-1).values
