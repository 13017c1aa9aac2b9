"""oneDNN linear layers with pre-packed weights, for float32 models on CPU.

Measured on this project's 2-core AVX2 machines (README, `benchmarks/results/kernels.md`): with torch's default
float32 matmul a pass over 2 tokens costs about two one-token passes, because every call re-packs the whole
weight matrix for its small row count, so a verification pass barely beats decoding its tokens one by one.
oneDNN can pack each weight once, at load time, into its blocked layout; then a 2-token pass of the 1.5B costs
1.16 one-token passes and a 9-token pass 1.8, and a one-token pass is 30% faster than MKL's. The weights are
the same numbers; only their layout and the kernel change.

The packing op (`torch.ops.mkldnn._reorder_linear_weight`) and the linear op that reads it
(`torch.ops.mkldnn._linear_pointwise`) are the ones torch's own compiler (inductor) uses on CPU. They are
operators, not attributes of a class, but they are underscore-named, so their presence is checked and
`torch.utils.mkldnn.MkldnnLinear` (per-call layout) is the fallback.
"""

from __future__ import annotations

import warnings

import torch

# The row count oneDNN packs for. Measured on the 1.5B (2, 8 and 16 within 3% of each other at 1-13 rows; 1
# makes 2+ rows 40% slower): verification passes have 2-9 rows and decoding 1.
PACK_FOR_ROWS = 2


def onednn_applicable(model: torch.nn.Module) -> bool:
    return model.device.type == "cpu" and model.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def packing_available() -> bool:
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(torch.nn.Module):
    """`nn.Linear` whose float32 weight oneDNN has reordered once into its blocked layout."""

    def __init__(self, linear: torch.nn.Linear, rows: int = PACK_FOR_ROWS):
        super().__init__()
        self.in_features, self.out_features, self.rows = linear.in_features, linear.out_features, rows
        weight = linear.weight.detach()  # [out, in]
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, rows), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().clone()  # [out]
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        return one_row_as_two(lambda rows: torch.ops.mkldnn._linear_pointwise(
            rows, self.packed_weight, self.bias, "none", [], ""), x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for {self.rows} rows"


def one_row_as_two(matmul, x: torch.Tensor) -> torch.Tensor:
    """`matmul(x)`, with a single row computed as a pair of equal rows.

    oneDNN runs one row through a matrix-vector kernel and two or more through a matrix-matrix one, whose sums
    differ in the last bits (measured: 1 bfloat16 ulp, 5e-6 in float32, rows of 2 to 1,100 all identical). A
    token's logits must not depend on how many tokens share its pass, or greedy speculative decoding could part
    from greedy decoding on a near-tie; one row costs the same as two (the weights' reading dominates).
    """
    flat = x.reshape(-1, x.shape[-1])  # [rows, in]
    if flat.shape[0] != 1:
        return matmul(x)
    return matmul(flat.expand(2, -1).contiguous())[:1].reshape(*x.shape[:-1], -1)


def use_onednn_linear(model: torch.nn.Module) -> int:
    """Swaps every `nn.Linear` that `model` calls for a oneDNN linear, in place; returns how many were swapped."""
    if packing_available():
        make = PackedLinear
    else:
        from torch.utils import mkldnn

        make = lambda linear: mkldnn.MkldnnLinear(linear, torch.float32)  # noqa: E731
    return replace_linear(model, make, only=called_linears(model))


def called_linears(model: torch.nn.Module) -> set[int]:
    """The ids of the `nn.Linear` modules that a two-token pass of `model` calls and whose weight it reads only
    through that call. Some models read a projection's weight themselves: Mamba's scan multiplies by `dt_proj.weight`
    and its head reads `lm_head.weight.dtype`; such a layer must stay an `nn.Linear`. A model that cannot run
    this pass gets nothing replaced (its own error comes when it is used)."""
    linears = [module for module in model.modules() if type(module) is torch.nn.Linear]
    trace = LinearTrace()
    ids = torch.zeros((1, 2), dtype=torch.long, device=model.device)  # [1, 2]
    extra = {"decoder_input_ids": ids} if getattr(model.config, "is_encoder_decoder", False) else {}
    for linear in linears:
        linear.__class__, linear.trace = TracedLinear, trace
    try:
        with torch.no_grad():
            model(input_ids=ids, **extra)
    except Exception:  # noqa: BLE001
        return set()
    finally:
        for linear in linears:
            linear.__class__ = torch.nn.Linear
            del linear.trace
    return trace.called - trace.read_outside


class LinearTrace:
    def __init__(self):
        self.called: set[int] = set()  # linears the pass called
        self.read_outside: set[int] = set()  # linears whose weight or bias was read outside their own call
        self.inside: int | None = None  # the linear being called


class TracedLinear(torch.nn.Linear):
    """An `nn.Linear` for the length of `called_linears`'s pass: it notes its calls and who reads its tensors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        trace = self.trace
        trace.called.add(id(self))
        trace.inside = id(self)
        try:
            return super().forward(x)
        finally:
            trace.inside = None

    def __getattr__(self, name: str):
        value = super().__getattr__(name)  # parameters live in the module's registry, so they come through here
        if name in ("weight", "bias") and self.trace.inside != id(self):
            self.trace.read_outside.add(id(self))
        return value


# -- int8 drafter ------------------------------------------------------------------------------------------------
# A drafter only proposes tokens; the target decides each one, so a drafter may be lossy without changing any
# output. Dynamic int8 (weights int8 per output channel, activations quantised per call) halves the 0.5B
# drafter's one-token pass on this machine (89 ms packed float32 -> 41 ms). It costs agreement with the target,
# mostly through the MLP's down projection (likely the outliers of its input, the gated activations, which one
# scale per activation rounds badly): keeping it float32 brings the drafter's greedy agreement with the 1.5B's
# answers on the chat prompts from 0.57 back to 0.71 (float32: 0.73) for 58 ms a token
# (`python -m benchmarks.drafters`; README, "A cheaper drafter").
KEEP_FLOAT = ("down_proj",)


def int8_applicable(model: torch.nn.Module) -> bool:
    return (model.device.type == "cpu" and model.dtype == torch.float32
            and torch.backends.quantized.engine != "none")


def quantize_int8(model: torch.nn.Module, keep_float: tuple[str, ...] = KEEP_FLOAT) -> int:
    """Dynamic int8 quantisation of every plain `nn.Linear` that `model` calls (`called_linears`) whose name does
    not end in one of `keep_float`, in place; returns how many. For drafters only: it changes the logits."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    called = called_linears(model)
    chosen = {name: per_channel_dynamic_qconfig for name, module in model.named_modules()
              if type(module) is torch.nn.Linear and id(module) in called and name.rsplit(".", 1)[-1] not in keep_float}
    # torch 2.13 deprecates eager-mode quantisation in favour of torchao, whose counterpart is reported slower than
    # this on CPU (pytorch/ao#4365, open) and would be one more dependency; the deprecation warnings are silenced.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(model, chosen, dtype=torch.qint8, inplace=True)
    return len(chosen)


def int8_layers(model: torch.nn.Module) -> int:
    """How many of `model`'s layers `quantize_int8` replaced."""
    return sum(type(module).__module__.startswith("torch.ao.nn.quantized.dynamic") for module in model.modules())


def replace_linear(model: torch.nn.Module, make, only: set[int] | None = None) -> int:
    """Replaces every plain `nn.Linear` of `model` (or those whose id is in `only`) by `make(linear)`, in place;
    returns how many."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and (only is None or id(child) in only):
                setattr(module, name, make(child))
                swapped += 1
    return swapped
