"""A lean forward pass for the decoder-only architectures GGUF files carry (Qwen2, Llama): the model's own modules
and transformers' own rotary function, called in the order transformers' modelling code calls them, without its
per-call machinery (output recording, mask building, kwargs plumbing, per-layer wrappers).

Measured on a 2-core Zen 1 (benchmarks/RESULTS.md): that machinery cost about as much per one-token pass as the
1.5B's integer matmuls. The arithmetic is unchanged, so logits are bit-identical to transformers' forward
(tested); the cache goes through the public `Cache.update`, attention through `rowwise_attention` (a KV budget
included), so rollback, reuse and budgets work as before.

Valid where row-wise attention is: one unpadded causal sequence (batch 1). Any other call (a batch, padding,
embeddings instead of ids, asking for hidden states) goes to transformers' forward, unchanged.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # Qwen2's is the same function

from utils.models.rowwise_attention import NAME as ROWWISE, rowwise_attention

LEAN_ARCHS = {"qwen2", "llama"}
# What the lean pass understands; any other argument (or a value it cannot honour) goes to the full forward.
HANDLED = {"input_ids", "past_key_values", "use_cache", "position_ids", "logits_to_keep", "attention_mask",
           "cache_position", "return_dict"}


def lean_applicable(model: torch.nn.Module) -> bool:
    config = model.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return (config.model_type in LEAN_ARCHS and config._attn_implementation == ROWWISE
            and getattr(config, "hidden_act", None) == "silu" and rope.get("rope_type", "default") != "dynamic"
            and not getattr(config, "use_sliding_window", False))


def use_lean_forward(model: torch.nn.Module) -> bool:
    """Makes `model(...)` take the lean pass where it applies; returns whether it does."""
    if not lean_applicable(model):
        return False
    full = model.forward

    def forward(self, input_ids=None, past_key_values=None, use_cache=None, position_ids=None, logits_to_keep=0,
                attention_mask=None, **kwargs):
        if (set(kwargs) - HANDLED or input_ids is None or input_ids.shape[0] != 1
                or (attention_mask is not None and not bool(attention_mask.all()))
                or kwargs.get("return_dict") is False or not isinstance(logits_to_keep, int)):
            return full(input_ids=input_ids, past_key_values=past_key_values, use_cache=use_cache,
                        position_ids=position_ids, logits_to_keep=logits_to_keep, attention_mask=attention_mask,
                        **kwargs)
        cache = None
        if use_cache is not False and (use_cache or self.config.use_cache):  # transformers' rule for None
            cache = past_key_values if past_key_values is not None else new_dynamic_cache(self.config)
        return lean_pass(self, input_ids, cache, position_ids, logits_to_keep)

    model.forward = types.MethodType(forward, model)
    return True


@torch.no_grad()
def lean_pass(model, input_ids: Tensor, cache, position_ids: Tensor | None, logits_to_keep: int):
    inner = model.model
    hidden = inner.embed_tokens(input_ids)  # [1, new, hidden]
    if position_ids is None:
        start = cache.get_seq_length() if cache is not None else 0
        position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    cos, sin = inner.rotary_emb(hidden, position_ids)  # [1, new, head_dim] each
    for layer in inner.layers[: model.config.num_hidden_layers]:
        hidden = decoder_layer(layer, hidden, cos, sin, cache)
    hidden = inner.norm(hidden)
    if logits_to_keep:
        hidden = hidden[:, -logits_to_keep:, :]
    logits = model.lm_head(hidden)  # [1, kept, vocab]
    return CausalLMOutputWithPast(logits=logits, past_key_values=cache)


def new_dynamic_cache(config):
    from transformers import DynamicCache

    return DynamicCache(config=config)


def decoder_layer(layer, hidden: Tensor, cos: Tensor, sin: Tensor, cache) -> Tensor:
    attn, mlp = layer.self_attn, layer.mlp
    x = layer.input_layernorm(hidden)
    heads = (*x.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(x).view(heads).transpose(1, 2)  # [1, heads, new, head_dim]
    k = attn.k_proj(x).view(heads).transpose(1, 2)  # [1, kv heads, new, head_dim]
    v = attn.v_proj(x).view(heads).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx)
    out, _ = rowwise_attention(attn, q, k, v, None, scaling=attn.scaling)  # [1, new, heads, head_dim]
    hidden = hidden + attn.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())
    x = layer.post_attention_layernorm(hidden)
    return hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
