"""Attention computed query row by query row, so that a token's result never depends on its pass's width.

Greedy speculative decoding equals greedy decoding only if the target's logits for a position are the same
whether the position is decoded alone or verified with others. torch's CPU attention kernel is not batch
invariant: a query computed among 9 differs from the same query alone in the last bits (measured: up to 1e-6),
and the native mode's bfloat16 matmul inputs turn such a bit into a visible logit change (0.09 on the 1.5B's
head), enough to flip a near-tie. Here every query row `i` of a pass is one call of the same kernel with one
query and exactly the keys it may see, the call a one-token decoding step makes: identical inputs, identical
result, whatever the pass's width and whether the cache is on (a cache-off pass is rows of the same calls).

Valid for one unpadded causal sequence (batch 1, no sliding window), which is how `ModelRunner` calls models.
Registered with transformers' public `AttentionInterface` under `NAME`, set per model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

NAME = "specdec_rowwise"


def rowwise_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None,
                      dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    # query: [batch, heads, q, dim]; key, value: [batch, kv_heads, k, dim], the last q keys being the queries'
    queries, keys = query.shape[2], key.shape[2]
    grouped = query.shape[1] != key.shape[1]  # grouped-query attention: SDPA shares each kv head, no copies
    rows = []
    for i in range(queries):
        seen = keys - queries + i + 1  # causal: the query at this position sees the keys up to it
        rows.append(F.scaled_dot_product_attention(query[:, :, i : i + 1], key[:, :, :seen], value[:, :, :seen],
                                                   scale=scaling, enable_gqa=grouped))  # [batch, heads, 1, dim]
    out = torch.cat(rows, dim=2) if queries > 1 else rows[0]  # [batch, heads, q, dim]
    return out.transpose(1, 2).contiguous(), None  # [batch, q, heads, dim]


def use_rowwise_attention(model: torch.nn.Module) -> bool:
    """Switches `model` to row-wise attention when it applies (no sliding window); returns whether it did."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    AttentionInterface.register(NAME, rowwise_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the mask is built but unused: causality is by row
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
