"""The forward pass of the decoder-only architectures GGUF files carry (Qwen2, Llama), as our own tree
(utils/models/native_tree.py) runs it: transformers' steps for these architectures, in its order, without its
per-call machinery (output recording, mask building, kwargs plumbing, per-layer wrappers).

Measured on a 2-core Zen 1 (benchmarks/RESULTS.md): that machinery cost about as much per one-token pass as the
1.5B's integer matmuls. The arithmetic is transformers', so logits are bit-identical to its forward (tested);
the cache goes through the public `Cache.update`, attention through `rowwise_attention` (a KV budget
included), so rollback, reuse and budgets work as before. Valid where row-wise attention is: unpadded causal
sequences.

A layer whose seven projections are GGUF blocks on our integer kernels goes further: its two halves around
attention are one C++ op each (`specdec::attn_in`, `specdec::attn_out_mlp`, utils/models/qkernels/layer.h), the
same steps in the same order, except that RMSNorm's sum of squares runs in eight fixed lanes; logits then
differ from transformers' forward in the last bits, and stay batch invariant (tested). Measured on the Zen 1 of
benchmarks/RESULTS.md, same kernels: the 1.5B's one-row step went from 107 ms to 85-91 ms, Python and small
torch calls from ~37 ms to ~8 ms of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.modeling_outputs import CausalLMOutputWithPast

from utils import h2o, snapkv
from utils.caching import GrowingCache, kv_budget
from utils.models import qkernels
from utils.models.native_linear import GGUFLinear
from utils.models.rowwise_attention import in_one_op, rowwise_attention

FUSED_LAYERS = True  # whether layers of GGUF blocks take the fused ops (tests compare both ways)
STACKED = True  # whether a pass whose every layer is fused runs them all in one op (tests compare both ways)


@dataclass(frozen=True)
class FusedLayer:
    """What the fused ops read of one decoder layer, gathered once: norm weights and epsilons, the projections'
    blocks, GGML types and biases (an empty tensor for none), in the order the ops take them."""
    norms: tuple[Tensor, Tensor]
    eps: tuple[float, float]
    qkv: tuple[list[Tensor], list[int], list[Tensor]]
    rest: tuple[list[Tensor], list[int], list[Tensor]]  # o, gate, up, down
    heads: int
    kv_heads: int


def fused_plan(layer, config) -> FusedLayer | None:
    """The fused form of `layer`, or None where a projection is not GGUF blocks (another kernel, or no build)."""
    attn, mlp = layer.self_attn, layer.mlp
    projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if not all(type(p) is GGUFLinear for p in projections) or not all(hasattr(n, "variance_epsilon") for n in norms):
        return None
    none = torch.empty(0)
    gathered = ([p.blocks for p in projections], [p.type_id for p in projections],
                [none if p.bias is None else p.bias for p in projections])
    return FusedLayer(norms=(norms[0].weight.detach(), norms[1].weight.detach()),
                      eps=(float(norms[0].variance_epsilon), float(norms[1].variance_epsilon)),
                      qkv=tuple(part[:3] for part in gathered), rest=tuple(part[3:] for part in gathered),
                      heads=config.num_attention_heads, kv_heads=config.num_key_value_heads)


@dataclass(frozen=True)
class FusedStack:
    """Every layer's FusedLayer flattened into the lists `torch.ops.specdec.decoder_stack` takes."""
    weights: list[Tensor]  # 7 a layer: q, k, v, o, gate, up, down
    types: list[int]
    biases: list[Tensor]
    norms: list[Tensor]  # 2 a layer: input, post-attention
    eps: list[float]
    heads: int
    kv_heads: int
    scale: float  # the attention's, the same in every layer

    def args(self) -> tuple:
        return self.weights, self.types, self.biases, self.norms, self.eps, self.heads, self.kv_heads


def fused_stack(layers, plans: list[FusedLayer | None]) -> FusedStack | None:
    """The stack of `plans`, or None where a layer is not fused (it runs the per-layer loop then)."""
    if not plans or any(plan is None for plan in plans):
        return None

    def flat(part: int) -> list:  # 0 weights, 1 types, 2 biases: q, k, v then o, gate, up, down, layer by layer
        return [item for plan in plans for half in (plan.qkv, plan.rest) for item in half[part]]

    return FusedStack(weights=flat(0), types=flat(1), biases=flat(2),
                      norms=[norm for plan in plans for norm in plan.norms],
                      eps=[eps for plan in plans for eps in plan.eps], heads=plans[0].heads,
                      kv_heads=plans[0].kv_heads, scale=float(layers[0].self_attn.scaling))


def stack_applies(model, stack: FusedStack | None, hidden: Tensor) -> bool:
    """Whether this pass may run as one op: every layer fused, attention that `in_one_op` takes (no KV budget,
    float32 on CPU), and no H2O or SnapKV observing the rows."""
    return (stack is not None and STACKED and FUSED_LAYERS and h2o.ACTIVE is None and snapkv.ACTIVE is None
            and kv_budget(model) is None and in_one_op(hidden))


@torch.no_grad()
def lean_pass(model, input_ids: Tensor, cache, position_ids: Tensor | None, logits_to_keep: int,
              plans: list[FusedLayer | None], stack: FusedStack | None = None):
    inner = model.model
    hidden = inner.embed_tokens(input_ids)  # [1, new, hidden]
    if position_ids is None:
        start = cache.get_seq_length() if cache is not None else 0
        position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    cos, sin = inner.rotary_emb(hidden, position_ids)  # [1, new, head_dim] each
    # The last layer's keys and values cover every row, its queries, output projection and MLP only the rows
    # whose logits are kept: 1/28 of a 60-row cache-off pass of the 1.5B. Rows are independent there, so the kept
    # rows' bits are the same. H2O and SnapKV record every row's attention: not for them (nor for the one op).
    keep = logits_to_keep if 0 < logits_to_keep < input_ids.shape[1] else 0
    stacked = stacked_pass(stack, hidden, cos, sin, cache, keep) if stack_applies(model, stack, hidden) else None
    if stacked is not None:
        hidden = stacked
    else:
        layers = inner.layers[: model.config.num_hidden_layers]
        trims = h2o.ACTIVE is None and snapkv.ACTIVE is None
        for index, (layer, plan) in enumerate(zip(layers, plans)):
            last_keep = keep if index == len(layers) - 1 and trims else 0
            if plan is not None and FUSED_LAYERS:
                hidden = fused_decoder_layer(layer, plan, hidden, cos, sin, cache, last_keep)
            else:
                hidden = decoder_layer(layer, hidden, cos, sin, cache, last_keep)
    hidden = inner.norm(hidden)
    if logits_to_keep:
        hidden = hidden[:, -logits_to_keep:, :]
    logits = model.lm_head(hidden)  # [1, kept, vocab]
    return CausalLMOutputWithPast(logits=logits, past_key_values=cache)


def stacked_pass(stack: FusedStack, hidden: Tensor, cos: Tensor, sin: Tensor, cache, keep: int) -> Tensor | None:
    """Every layer in one op, the last one trimmed to the last `keep` rows (0: all) as the loop does; None where
    the cache is not one whose buffers the op can write, or while torch.compile traces a pass without a cache (the
    per-layer loop runs then)."""
    if cache is None and torch.compiler.is_compiling():
        return None  # inductor (torch 2.13) fails to lower the op's empty buffer lists; the per-layer ops compile
    new = hidden.shape[1]
    keys, values, start = [], [], 0
    if cache is not None:
        dim = cos.shape[-1]
        like = hidden.new_empty((1, stack.kv_heads, 0, dim))  # [batch, kv heads, -, dim]: what the buffers hold
        rooms = cache.rooms(new, like, like) if isinstance(cache, GrowingCache) else None
        if rooms is None:
            return None
        keys, values, start = rooms
    out = qkernels.ops().decoder_stack(hidden, cos, sin, *stack.args(), keys, values, start, keep, stack.scale)
    if cache is not None:
        cache.written(new)
    return out  # [1, new or keep, hidden]


def new_dynamic_cache(config):
    from transformers import DynamicCache

    return DynamicCache(config=config)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """transformers' rotation (Qwen2's and Llama's are one function), in its order of operations."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [batch, 1, new, head_dim]: over the heads
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def decoder_layer(layer, hidden: Tensor, cos: Tensor, sin: Tensor, cache, keep: int = 0) -> Tensor:
    """One decoder layer; with `keep`, only the last `keep` rows come out (the keys and values of all go in)."""
    attn, mlp = layer.self_attn, layer.mlp
    x = layer.input_layernorm(hidden)
    heads = (*x.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(x).view(heads).transpose(1, 2)  # [1, heads, new, head_dim]
    k = attn.k_proj(x).view(heads).transpose(1, 2)  # [1, kv heads, new, head_dim]
    v = attn.v_proj(x).view(heads).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx)
    if keep:
        q, hidden = q[:, :, -keep:], hidden[:, -keep:]  # [1, heads, keep, head_dim], [1, keep, hidden]
    out, _ = rowwise_attention(attn, q, k, v, None, scaling=attn.scaling)  # [1, new or keep, heads, head_dim]
    hidden = hidden + attn.o_proj(out.reshape(*hidden.shape[:-1], -1).contiguous())
    x = layer.post_attention_layernorm(hidden)
    return hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def fused_decoder_layer(layer, plan: FusedLayer, hidden: Tensor, cos: Tensor, sin: Tensor, cache,
                        keep: int = 0) -> Tensor:
    attn = layer.self_attn
    q, k, v = qkernels.ops().attn_in(hidden, plan.norms[0], plan.eps[0], *plan.qkv, cos, sin, plan.heads,
                                     plan.kv_heads)  # [1, heads or kv heads, new, head_dim], rotated
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx)
    if keep:
        q, hidden = q[:, :, -keep:], hidden[:, -keep:].contiguous()  # the rows whose logits are kept
    out, _ = rowwise_attention(attn, q, k, v, None, scaling=attn.scaling)  # [1, new or keep, heads, head_dim]
    return qkernels.ops().attn_out_mlp(hidden, out, *plan.rest, plan.norms[1], plan.eps[1])  # [1, rows, hidden]
