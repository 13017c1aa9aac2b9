"""Our own module tree for the GGUF architectures the lean pass runs (Qwen2, Llama), so that a warm start does not
import transformers' modelling code.

Importing `modeling_qwen2` pulls in torch._dynamo, torch.distributed.tensor, the hub-kernel machinery and scipy
(through its loss functions): 2.9 s of a 12.7 s warm start on the Zen 3 of benchmarks/RESULTS.md, and building
the empty tree another 0.25 s a model. The lean pass (utils/models/lean_forward.py) never needed that code's
forward; here it needs no module of it either.

Module names are transformers' (`model.layers.3.self_attn.q_proj`, `lm_head`), so prepared layouts, the fused
layers' plans and the drafter's shortlist head address the tree as before. Norms and rotary embeddings compute
what transformers' do, step for step (tested against its tree, bit for bit). The tree runs unpadded batches of
ids with or without a cache; any other call (padding, embeddings instead of ids, hidden states, `generate`)
goes to transformers' own tree, built on first need around the same weights, at the import's cost once.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from utils.models.lean_forward import fused_plan, fused_stack, lean_pass, new_dynamic_cache
from utils.models.rowwise_attention import slides

TREE_ARCHS = {"qwen2", "llama"}
# What the tree's own pass understands; any other argument goes to transformers' tree.
HANDLED = {"input_ids", "past_key_values", "use_cache", "position_ids", "logits_to_keep", "attention_mask",
           "cache_position", "return_dict"}
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # inverse frequencies fixed at start (no dynamic update)


def tree_applicable(config) -> bool:
    rope = getattr(config, "rope_parameters", None) or {}
    return (config.model_type in TREE_ARCHS and getattr(config, "hidden_act", None) == "silu"
            and rope.get("rope_type", "default") in STATIC_ROPE
            and not slides(config))


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def unfilled() -> nn.Module:
    """A place for a module `gguf_native.build` puts in; its meta weight makes a forgotten one an error there."""
    module = nn.Module()
    module.weight = nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
    return module


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta"), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, hidden: Tensor) -> Tensor:  # transformers' steps, in its order
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        rope = config.rope_parameters
        if rope.get("rope_type", "default") == "default":
            dim = head_dim(config)
            inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)  # [b, n, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [batch, new, head_dim]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx  # rowwise attention reads the KV budget off the config
        self.head_dim = head_dim(config)
        self.scaling = self.head_dim**-0.5
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (unfilled() for _ in range(4))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (unfilled() for _ in range(3))
        self.act_fn = nn.SiLU()  # transformers' "silu"


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderBody(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = unfilled()
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class NativeCausalLM(nn.Module):
    """A decoder-only causal LM of GGUF blocks: what `gguf_native.build` fills, what `ModelRunner` calls."""

    attends_rowwise = True  # every pass is row-wise attention (utils/models/rowwise_attention.py)
    reads_strided_cache = True  # that attention reads strided keys: `new_cache` gives it a GrowingCache
    # A row's logits never depend on how many rows share its pass: the kernel choice keeps only batch-invariant
    # kernels, and attention is row-wise. So `ModelRunner` may cut any pass into pieces (LONG_PASS).
    batch_invariant = True

    def __init__(self, config):
        super().__init__()
        from transformers import GenerationConfig

        self.config = config
        self.model = DecoderBody(config)
        self.lm_head = unfilled()
        self.generation_config = GenerationConfig.from_model_config(config)
        self.plans = None  # fused layers, gathered on the first pass (after `build` has filled the tree)
        self.stack = None  # the plans as one op's arguments, where every layer is fused
        self.transformers_tree = {}  # transformers' tree once a call needs it; in a dict, so it is no submodule

    @property
    def device(self) -> torch.device:
        return next(p.device for p in self.parameters())

    @property
    def dtype(self) -> torch.dtype:
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, head: nn.Module) -> None:
        self.lm_head = head

    def forward(self, input_ids=None, past_key_values=None, use_cache=None, position_ids=None, logits_to_keep=0,
                attention_mask=None, **kwargs):
        if (set(kwargs) - HANDLED or input_ids is None or kwargs.get("return_dict") is False
                or (attention_mask is not None and not bool(attention_mask.all()))
                or not isinstance(logits_to_keep, int)):
            return self.transformers_model()(input_ids=input_ids, past_key_values=past_key_values,
                                             use_cache=use_cache, position_ids=position_ids,
                                             logits_to_keep=logits_to_keep, attention_mask=attention_mask, **kwargs)
        cache = None
        if use_cache is not False and (use_cache or self.config.use_cache):  # transformers' rule for None
            cache = past_key_values if past_key_values is not None else new_dynamic_cache(self.config)
        if self.plans is None:
            self.plans = [fused_plan(layer, self.config) for layer in self.model.layers]
            self.stack = fused_stack(self.model.layers, self.plans)
        # the fused ops take one sequence; a batch (beam search) runs the layers' modules
        if input_ids.shape[0] != 1:
            return lean_pass(self, input_ids, cache, position_ids, logits_to_keep, [None] * len(self.plans))
        return lean_pass(self, input_ids, cache, position_ids, logits_to_keep, self.plans, self.stack)

    def generate(self, *args, **kwargs):
        return self.transformers_model().generate(*args, **kwargs)

    def transformers_model(self):
        """transformers' own tree for this config, holding this tree's embedding and projections and sharing its
        norm weights and config (so a KV budget set on one holds for both), with row-wise attention."""
        if "model" not in self.transformers_tree:
            from utils.models.gguf_native import empty_model, replace
            from utils.models.rowwise_attention import use_rowwise_attention

            full = empty_model(self.config)
            names = ["model.embed_tokens"] + [f"model.layers.{i}.{p}" for i in range(len(self.model.layers))
                                              for p in PROJECTIONS]
            for name in names:
                replace(full, name, self.get_submodule(name))
            for name, module in self.named_modules():
                if isinstance(module, RMSNorm):
                    full.get_submodule(name).weight = module.weight
            full.generation_config = self.generation_config
            use_rowwise_attention(full)
            self.transformers_tree["model"] = full.eval()
        full = self.transformers_tree["model"]
        full.set_output_embeddings(self.lm_head)  # the head of the moment (a shortlist may come and go)
        return full


def transformers_form(model: nn.Module) -> nn.Module:
    """`model` as transformers' API expects it (`generate`, an assistant model): our tree's transformers tree,
    any other model itself."""
    return model.transformers_model() if isinstance(model, NativeCausalLM) else model
