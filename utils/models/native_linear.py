"""Linear and embedding layers that run a GGUF tensor at its own precision on CPU.

Each decoded tensor (`utils/models/gguf_blocks.py`) can run through one of these kernels; `utils/models/kernel_choice.py`
times them on the model's own shapes and picks one per shape:

| kernel | weights held as | what it computes |
| --- | --- | --- |
| `int4` | the file's 4-bit values, packed by `_convert_weight_to_int4pack_for_cpu`, scale and zero per group of 32 in bfloat16 | `_weight_int4pack_mm_for_cpu` on bfloat16 activations (Int4Groups only) |
| `bf16` | the dequantized weights rounded to bfloat16, packed once for oneDNN where it has bfloat16 kernels | a bfloat16 matmul |
| `f32` | the dequantized weights in float32, packed once for oneDNN | the exactness reference |

The model around these layers (norms, attention, residual stream) stays float32: only the matmul's inputs are
cast, so the cache and the rest of the code see a float32 model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from utils.models.cpu_kernels import PACK_FOR_ROWS, PackedLinear, one_row_as_two, packing_available
from utils.models.gguf_blocks import Int4Groups, decode, dequantize

INT4_GROUP = 32  # the int4 kernel's group size, and the Q4 types' block size
KERNELS = ("int4", "bf16", "f32")


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def kernels_for(form) -> tuple[str, ...]:
    """The kernels that can run `form` on this torch."""
    if isinstance(form, Int4Groups) and form.group == INT4_GROUP and int4_available():
        return KERNELS
    return ("bf16", "f32")


class Int4Linear(torch.nn.Module):
    """4-bit values through torch's int4 weight-only CPU kernel: `w = (q - 8) * scale + zero` per group of 32."""

    def __init__(self, packed: Tensor, scales_and_zeros: Tensor, bias: Tensor | None, in_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, scales_and_zeros.shape[1]
        self.register_buffer("packed", packed, persistent=False)  # [out, in / 2] uint8, the kernel's layout
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)  # [in / 32, out, 2] bfloat16
        self.register_buffer("bias", bias, persistent=False)  # [out] float32 or None

    @staticmethod
    def pack(form: Int4Groups) -> dict[str, Tensor]:
        zero = form.scale * 8 - form.minimum  # scale * q - minimum == (q - 8) * scale + zero
        scales_and_zeros = torch.stack([form.scale, zero], dim=-1).transpose(0, 1)  # [in / 32, out, 2]
        return {"packed": torch.ops.aten._convert_weight_to_int4pack_for_cpu(form.q.to(torch.int32), 1),
                "scales_and_zeros": scales_and_zeros.contiguous().to(torch.bfloat16)}

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [tokens, in]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP, self.scales_and_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # [..., out]
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {INT4_GROUP}"


def bf16_packing_available() -> bool:
    mkldnn = torch.ops.mkldnn
    return packing_available() and hasattr(mkldnn, "_is_mkldnn_bf16_supported") and mkldnn._is_mkldnn_bf16_supported()


class Bf16Linear(torch.nn.Module):
    """Dequantized weights rounded to bfloat16; float32 in and out.

    Where oneDNN has bfloat16 kernels the weight is packed once into its blocked layout (2.6x faster than
    `F.linear` in bfloat16 for one row of the 1.5B's MLP on an AVX512-BF16 CPU); elsewhere `F.linear`.
    The packed layout is opaque (it cannot be saved), so packing happens at every load.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.to(torch.bfloat16)  # [out, in]
        self.packed = bf16_packing_available()
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.packed:
            y = one_row_as_two(lambda rows: torch.ops.mkldnn._linear_pointwise(
                rows, self.weight, None, "none", [], ""), x.to(torch.bfloat16))
        else:
            y = one_row_as_two(lambda rows: F.linear(rows, self.weight), x.to(torch.bfloat16))
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16"


def linear_state(form, kernel: str) -> dict[str, Tensor]:
    """What a layer of `kernel` keeps of the decoded tensor `form`: the tensors saved in the prepared cache."""
    if kernel == "int4":
        return Int4Linear.pack(form)
    weight = form if isinstance(form, Tensor) else dequantize(form)  # [out, in] float32
    return {"weight": weight.to(torch.bfloat16) if kernel == "bf16" else weight.float()}


def linear_from_state(kernel: str, state: dict[str, Tensor], bias: Tensor | None, in_features: int) -> torch.nn.Module:
    if kernel == "int4":
        return Int4Linear(state["packed"], state["scales_and_zeros"], bias, in_features)
    if kernel == "bf16":
        return Bf16Linear(state["weight"], bias)
    weight = state["weight"]
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return PackedLinear(linear) if packing_available() else linear


def make_linear(form, kernel: str, bias: Tensor | None = None) -> torch.nn.Module:
    """A module computing `x @ w.T + bias` for the decoded tensor `form` with `kernel`."""
    in_features = (form if isinstance(form, Tensor) else form.q).shape[1]
    return linear_from_state(kernel, linear_state(form, kernel), bias, in_features)


def requantize_int4(form) -> Int4Groups:
    """Any decoded tensor -> 4-bit values with a minimum and a scale per group of 32 (lossy: for drafters only,
    whose tokens the target checks). Min-max rounding, as Q4_1 quantises."""
    weight = form if isinstance(form, Tensor) else dequantize(form)
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // INT4_GROUP, INT4_GROUP)  # [rows, groups, 32]
    low, high = groups.amin(-1), groups.amax(-1)  # [rows, groups]
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    return Int4Groups(q.reshape(rows, cols), scale, -low)


class GGUFEmbedding(torch.nn.Module):
    """Token embeddings kept as the file's blocks; a lookup decodes only the rows it reads."""

    def __init__(self, type_name: str, raw: Tensor, embedding_dim: int):
        super().__init__()
        self.type_name, self.embedding_dim = type_name, embedding_dim
        self.register_buffer("raw", raw, persistent=False)  # [vocab, bytes per row] uint8, or float rows
        self.num_embeddings = raw.shape[0]

    def forward(self, ids: Tensor) -> Tensor:
        rows = self.raw.index_select(0, ids.reshape(-1))  # [tokens, bytes per row]
        form = decode(self.type_name, rows)
        values = form.float() if isinstance(form, Tensor) else dequantize(form)  # [tokens, dim]
        return values.reshape(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> Tensor:
        """The whole table in float32 (for code that reads `.weight`; costly on a large vocabulary)."""
        return self.forward(torch.arange(self.num_embeddings))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.type_name} blocks"


