"""Attention computed query row by query row, so that a token's result never depends on its pass's width.

Greedy speculative decoding equals greedy decoding only if the target's logits for a position are the same
whether the position is decoded alone or verified with others. torch's CPU attention kernel is not batch
invariant: a query computed among 9 differs from the same query alone in the last bits (measured: up to 1e-6),
and the native mode's bfloat16 matmul inputs turn such a bit into a visible logit change (0.09 on the 1.5B's
head), enough to flip a near-tie. Here every query row `i` of a pass is one call of the same kernel with one
query and exactly the keys it may see, the call a one-token decoding step makes: identical inputs, identical
result, whatever the pass's width and whether the cache is on (a cache-off pass is rows of the same calls).

Float32 on CPU with our kernels built, and no KV budget or observation, the rows run in one C++ op
(`torch.ops.specdec.attention`, utils/models/qkernels/attention.h): the same rule, its own fixed order of
operations, and none of the per-row calls from Python (2.5 ms a layer of a 60-row cache-off pass of the 1.5B).
Whether a model takes it depends on its dtype and device only, so every generator of a run takes the same one.

Valid for one unpadded causal sequence (batch 1, no sliding window), which is how `ModelRunner` calls models.
Registered with transformers' public `AttentionInterface` under `NAME`, set per model.

With a KV budget (`use_kv_budget`), each query sees the first `sinks` keys and its own last `window` keys
(StreamingLLM's attention sinks plus a recent window): a rule of the query's position alone, so the cache may
forget everything else (`utils.caching.BoundedCache`) and every pass width still gives the same result. Under
H2O the rule depends on the earlier rows' weights instead; `utils/h2o.py` keeps it row by row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from utils import h2o, snapkv
from utils.models import qkernels
from utils.caching import KV_BUDGET_ATTRIBUTE, KV_POLICIES, KV_POLICY_ATTRIBUTE, SINKS, kv_budget

NAME = "specdec_rowwise"


def rowwise_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None,
                      dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    # query: [batch, heads, q, dim]; key, value: [batch, kv_heads, k, dim], the last q keys being the queries'
    queries, keys = query.shape[2], key.shape[2]
    grouped = query.shape[1] != key.shape[1]  # grouped-query attention: SDPA shares each kv head, no copies
    sinks, window = kv_budget(module) or (0, 0)
    observation = snapkv.ACTIVE
    if observation is not None:
        window = 0  # SnapKV and H2O read a prompt with full attention
    elif h2o.ACTIVE is not None:
        return h2o.attend(h2o.ACTIVE, module.layer_idx, query, key, value, scaling), None
    if not window and observation is None and in_one_op(query):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5  # SDPA's default
        return qkernels.ops().attention(query, key, value, float(scale)), None  # [batch, q, heads, dim]
    rows = []
    for i in range(queries):
        seen = keys - queries + i + 1  # causal: the query at this position sees the keys up to it
        k, v = key[:, :, :seen], value[:, :, :seen]
        if window and seen > sinks + window:  # the budget: the sinks and the query's last `window` keys
            k = torch.cat([key[:, :, :sinks], key[:, :, seen - window : seen]], dim=2)
            v = torch.cat([value[:, :, :sinks], value[:, :, seen - window : seen]], dim=2)
        weights = None
        if observation is not None:  # an observed row's weights give its output too: one softmax, not two
            weights = observation.record(module.layer_idx, seen - 1, query[:, :, i : i + 1], k, scaling)
        if weights is not None:
            rows.append(snapkv.weighted_values(weights, v[0])[None, :, None])  # [batch, heads, 1, dim]
        else:
            rows.append(F.scaled_dot_product_attention(query[:, :, i : i + 1], k, v, scale=scaling,
                                                       enable_gqa=grouped))  # [batch, heads, 1, dim]
    out = torch.cat(rows, dim=2) if queries > 1 else rows[0]  # [batch, heads, q, dim]
    return out.transpose(1, 2).contiguous(), None  # [batch, q, heads, dim]


def in_one_op(query: Tensor) -> bool:
    """Whether the rows of this attention run in our C++ op: float32 on CPU, with the kernels built."""
    return query.dtype == torch.float32 and query.device.type == "cpu" and qkernels.loaded()


def slides(config) -> bool:
    """Whether a model attends over a sliding window, which row-wise attention does not honour."""
    return bool(getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))


def use_rowwise_attention(model: torch.nn.Module) -> bool:
    """Switches `model` to row-wise attention when it applies (no sliding window); returns whether it did. Our own
    tree (utils/models/native_tree.py) attends row-wise always."""
    if getattr(model, "attends_rowwise", False):
        return True
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config
    if slides(config):
        return False
    AttentionInterface.register(NAME, rowwise_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the mask is built but unused: causality is by row
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME


def use_kv_budget(model: torch.nn.Module, budget: int, sinks: int = SINKS, policy: str = "streaming") -> None:
    """Bounds what `model` attends to, and what its cache holds, to `budget` positions: `sinks` first ones
    (streaming), the prompt's most attended ones (snapkv, `utils/snapkv.py`) or the sinks and the most attended
    so far (h2o, `utils/h2o.py`), and a recent window. Lossy against full attention, but the same rule for
    every generator, so speculative decoding still equals autoregressive decoding under the same budget and
    policy. Needs row-wise attention."""
    if policy not in KV_POLICIES:
        raise ValueError(f"unknown KV policy {policy!r}; use one of {', '.join(KV_POLICIES)}")
    if not use_rowwise_attention(model):
        why = "a sliding window" if slides(model.config) else "its attention cannot be replaced"
        raise ValueError(f"a KV budget needs row-wise attention, which this model cannot use ({why})")
    if budget < 2 * sinks:
        raise ValueError(f"the KV budget must be at least {2 * sinks} positions ({sinks} sinks and a window of as many)")
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and budget > limit:
        raise ValueError(f"a KV budget of {budget} positions is larger than the model's context of {limit}")
    kept = snapkv.split_budget(budget) if policy == "snapkv" else (sinks, budget - sinks)
    setattr(model.config, KV_BUDGET_ATTRIBUTE, kept)
    setattr(model.config, KV_POLICY_ATTRIBUTE, policy)


def describe_budget(model: torch.nn.Module) -> str:
    """What a model's KV budget keeps, in words, for the start-up line."""
    from utils.caching import kv_policy

    kept, window = kv_budget(model)
    if kv_policy(model) == "snapkv":
        return f"the {kept} most attended prompt positions + the {window} most recent"
    if kv_policy(model) == "h2o":
        recent, heavy = h2o.split_budget(kept + window, kept)
        return f"{kept} sinks + the {heavy} most attended so far (H2O) + the {recent} most recent"
    return f"{kept} sinks + the {window} most recent positions"
