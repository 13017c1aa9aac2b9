"""Linear and embedding layers that run a GGUF tensor at its own precision on CPU.

Each decoded tensor (`utils/models/gguf_blocks.py`) can run through one of these kernels; `utils/models/kernel_choice.py`
times them on the model's own shapes and picks one per shape:

| kernel | weights held as | what it computes |
| --- | --- | --- |
| `gguf` | the file's own blocks, as they are (Q2_K-Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS, IQ1_S, IQ1_M) | our integer kernels (`utils/models/qkernels`) on 8-bit activations |
| `gguf8` | Q2_K to Q6_K, IQ4_XS, Q4_1 or Q8_0 blocks with 8 rows interleaved (Q3_K's, Q4_K's, Q5_K's and IQ4_XS's scales decoded: 1.5-3.6% larger) | the same kernels' tiles for those layouts (`qkernels/interleaved.h`) |
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

from utils.models import qkernels
from utils.models.cpu_kernels import PACK_FOR_ROWS, PackedLinear, one_row_as_two, packing_available
from utils.models.gguf_blocks import (BLOCK_LAYOUT, DECODERS, Int4Groups, RawBlocks, as_values, decode, decoded_rows,
                                      package_dequantized)

INT4_GROUP = 32  # the int4 kernel's group size, and the Q4 types' block size
INT4_ROWS = 16  # torch's int4 packing needs a multiple of this many output rows
KERNELS = ("gguf", "gguf8", "int4", "bf16", "f32")
# How much memory each kernel's weights take, in classes: a near-tie in time goes to the smaller class, and
# within a class to the faster kernel (gguf8 holds 0-3.6% more bytes than gguf: the same class).
MEMORY_CLASS = {"gguf": 0, "gguf8": 0, "int4": 1, "bf16": 2, "f32": 3}
OWN_KERNELS = ("gguf", "gguf8")  # read the file's blocks (RawBlocks), not a decoded form
X8_ROWS = 8  # gguf8 interleaves groups of this many output rows


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def decoded(form):
    """The file's blocks -> the integer values and scales torch's kernels take, or float32 weights for a type
    without a decoder here (dequantized by the gguf package); other forms as they are."""
    if not isinstance(form, RawBlocks):
        return form
    if form.type_name in DECODERS:
        return decode(form.type_name, form.data)
    return package_dequantized(form.type_name, form.data.numpy())


def dense(form) -> Tensor:
    """Any form (the file's blocks, a decoded form, float weights) -> float32 values [out, in]."""
    return as_values(decoded(form))


def kernels_for(form) -> tuple[str, ...]:
    """The kernels that can run `form` (a RawBlocks, a decoded form or float weights) on this torch and CPU."""
    own = ()
    if isinstance(form, RawBlocks):
        if qkernels.loaded() and form.type_name in qkernels.TYPES:
            own = ("gguf",)
            if form.type_name in qkernels.X8 and form.data.shape[0] % X8_ROWS == 0:
                own = ("gguf", "gguf8")
        four_bit = form.type_name in ("Q4_K", "Q4_0", "Q4_1")
        rows = form.data.shape[0]
    else:
        four_bit = isinstance(form, Int4Groups) and form.group == INT4_GROUP
        rows = (form.q if hasattr(form, "q") else form).shape[0]
    if four_bit and rows % INT4_ROWS == 0 and int4_available():
        return own + ("int4", "bf16", "f32")
    return own + ("bf16", "f32")


# The last activations quantised, per activation format, and for which tensor: q/k/v (and gate/up) read the same
# input tensor one after another, so it is quantised once for all of them. Holding the tensor keeps its memory
# from being reused by another tensor at the same address; `_version` catches an in-place change.
_last_quantised: dict[bool, tuple] = {}


def quantise_shared(x: Tensor, type_name: str) -> Tensor:
    """x: [..., in] float32 -> the 8-bit activation blocks a `type_name` weight reads, reused for the same input."""
    # No memo in a traced graph (`_version` and `is` are not graph values), nor for a tensor made under
    # torch.inference_mode(), which has no version counter to tell an in-place change by
    if torch.compiler.is_compiling() or x.is_inference():
        return qkernels.quantize(x.reshape(-1, x.shape[-1]).float(), type_name)
    k = type_name in qkernels.K_TYPES
    held = _last_quantised.get(k)
    if held is not None and held[0] is x and held[1] == x._version:
        return held[2]
    xq = qkernels.quantize(x.reshape(-1, x.shape[-1]).float(), type_name)
    _last_quantised[k] = (x, x._version, xq)
    return xq


class GGUFLinear(torch.nn.Module):
    """The file's blocks through our integer kernels. Batch invariant by construction (each output is the same
    operations in the same order whatever the pass's width), so no row needs computing as a pair.

    `interleaved`: blocks of a type of `qkernels.X8` in the layout of `torch.ops.specdec.interleave` (kernel `gguf8`)."""

    def __init__(self, blocks: Tensor, type_name: str, bias: Tensor | None, in_features: int,
                 interleaved: bool = False):
        super().__init__()
        self.type_name, self.interleaved = type_name, interleaved
        self.type_id = qkernels.X8[type_name] if interleaved else qkernels.TYPES[type_name]
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)  # [out, row bytes] uint8
        self.register_buffer("bias", bias, persistent=False)  # [out] float32 or None

    @property
    def label(self) -> str:
        """The block type it reads, as the start-up line counts it."""
        return f"{self.type_name}x8" if self.interleaved else self.type_name

    def file_rows(self, ids: Tensor) -> Tensor:
        """Output rows `ids` as the file's blocks: [len(ids), file row bytes] uint8. Interleaved, only the groups
        of 8 holding them are converted back (a shortlist of a 151936-row head adds a few rows at a time)."""
        if not self.interleaved:
            return self.blocks.index_select(0, ids)
        groups = torch.unique(ids // X8_ROWS)  # [g] ascending
        rows = (groups.unsqueeze(1) * X8_ROWS + torch.arange(X8_ROWS)).reshape(-1)  # [8g]: the groups' row-equivalents
        part = torch.ops.specdec.deinterleave(self.blocks.index_select(0, rows), qkernels.TYPES[self.type_name])
        return part.index_select(0, torch.searchsorted(groups, ids // X8_ROWS) * X8_ROWS + ids % X8_ROWS)

    def rows(self, ids: Tensor) -> "GGUFLinear":
        """A layer of output rows `ids` only, interleaved again where this one is and whole groups allow."""
        bias = None if self.bias is None else self.bias[ids]
        blocks, again = self.file_rows(ids), self.interleaved and ids.numel() % X8_ROWS == 0
        if again:
            blocks = torch.ops.specdec.interleave(blocks, qkernels.TYPES[self.type_name])
        return GGUFLinear(blocks, self.type_name, bias, self.in_features, interleaved=again)

    def forward(self, x: Tensor) -> Tensor:
        xq = quantise_shared(x, self.type_name)
        y = qkernels.ops().gguf_mm(xq, self.blocks, self.type_id, self.in_features)  # [rows, out]
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.label} blocks"


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
    """What a layer of `kernel` keeps of the tensor `form`: the tensors saved in the prepared cache."""
    if kernel == "gguf":
        return {"blocks": form.data}
    if kernel == "gguf8":
        return {"blocks": torch.ops.specdec.interleave(form.data, qkernels.TYPES[form.type_name])}
    form = decoded(form)
    if kernel == "int4":
        return Int4Linear.pack(form)
    if kernel == "bf16" and isinstance(form, Tensor):  # F16/BF16 weights: no float32 copy on the way (a head: 0.9 GB)
        return {"weight": form.to(torch.bfloat16)}
    weight = dense(form)  # [out, in] float32
    return {"weight": weight.to(torch.bfloat16) if kernel == "bf16" else weight}


def linear_from_state(kernel: str, state: dict[str, Tensor], bias: Tensor | None, in_features: int,
                      type_name: str | None = None) -> torch.nn.Module:
    if kernel in OWN_KERNELS:
        return GGUFLinear(state["blocks"], type_name, bias, in_features, interleaved=kernel == "gguf8")
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
    """A module computing `x @ w.T + bias` for the tensor `form` with `kernel`."""
    in_features = in_features_of(form)
    return linear_from_state(kernel, linear_state(form, kernel), bias, in_features, getattr(form, "type_name", None))


def in_features_of(form) -> int:
    if isinstance(form, RawBlocks):
        return form.in_features
    return (form if isinstance(form, Tensor) else form.q).shape[1]


def requantize_int4(form) -> Int4Groups:
    """Any decoded tensor -> 4-bit values with a minimum and a scale per group of 32 (lossy: for drafters only,
    whose tokens the target checks). Min-max rounding, as Q4_1 quantises."""
    weight = dense(form)
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // INT4_GROUP, INT4_GROUP)  # [rows, groups, 32]
    low, high = groups.amin(-1), groups.amax(-1)  # [rows, groups]
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    return Int4Groups(q.reshape(rows, cols), scale, -low)


def requantize_q4_1(form) -> RawBlocks:
    """Any tensor -> Q4_1 blocks (`w = d * q + m`, d and m in float16, min-max rounding as llama.cpp's
    quantiser), for a drafter run through our integer kernels. Lossy: drafters only. The file's blocks of a type
    our kernels decode are re-quantised row by row in our op (the bits of `q4_1_reference`; 8.3 s -> 0.85 s of the
    0.5B drafter's first preparation on the Zen 3 of benchmarks/RESULTS.md), anything else in torch."""
    type_id = qkernels.TYPES.get(getattr(form, "type_name", None))
    if isinstance(form, RawBlocks) and type_id is not None and qkernels.loaded() and form.in_features % 32 == 0:
        blocks = torch.ops.specdec.requantize_q4_1(form.data, type_id, form.in_features)
        return RawBlocks("Q4_1", blocks, form.in_features)
    return q4_1_reference(dense(form))


def q4_1_reference(weight: Tensor) -> RawBlocks:
    """Float weights [rows, cols] -> Q4_1 blocks, in torch: what `specdec::requantize_q4_1` computes (tests)."""
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // 32, 32)  # [rows, blocks, 32]
    low, high = groups.amin(-1), groups.amax(-1)
    # the block's own numbers, as the file would hold them; a minimum of -0 as +0 (`+ 0.0`): amin's vector code and
    # a scalar min disagree on the sign of a zero
    d, m = ((high - low) / 15).half(), (low + 0.0).half()
    inverse = torch.where(d == 0, torch.zeros_like(d, dtype=torch.float32), 1 / d.float())
    q = ((groups - m.float().unsqueeze(-1)) * inverse.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # [rows, blocks, 16]: value i low, value i + 16 high
    blocks = torch.cat([d.unsqueeze(-1).view(torch.uint8), m.unsqueeze(-1).view(torch.uint8), nibbles], dim=-1)
    assert blocks.shape[-1] == BLOCK_LAYOUT["Q4_1"][1]
    return RawBlocks("Q4_1", blocks.reshape(rows, -1).contiguous(), cols)


# Whether a lookup decodes its rows in our op where the kernels are built (`specdec::embedding_rows`, the same
# bits as `decode` + `dequantize`); benchmarks/pass_overhead.py compares both ways.
EMBEDDING_OP = True


class GGUFEmbedding(torch.nn.Module):
    """Token embeddings kept as the file's blocks; a lookup decodes only the rows it reads."""

    def __init__(self, type_name: str, raw: Tensor, embedding_dim: int):
        super().__init__()
        self.type_name, self.embedding_dim = type_name, embedding_dim
        self.register_buffer("raw", raw, persistent=False)  # [vocab, bytes per row] uint8, or float rows
        self.num_embeddings = raw.shape[0]
        self.type_id = qkernels.TYPES.get(type_name)  # None (float rows): read in torch

    def forward(self, ids: Tensor) -> Tensor:
        if EMBEDDING_OP and self.type_id is not None and qkernels.loaded() and self.raw.is_cpu:
            op = torch.ops.specdec.embedding_rows  # this build's, not `qkernels.ops()`: kernel_ab's base may lack it
            values = op(self.raw, self.type_id, self.embedding_dim, ids.long())  # [tokens, dim]
            return values.reshape(*ids.shape, self.embedding_dim)
        rows = self.raw.index_select(0, ids.reshape(-1))  # [tokens, bytes per row]
        return decoded_rows(self.type_name, rows).reshape(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> Tensor:
        """The whole table in float32 (for code that reads `.weight`; costly on a large vocabulary)."""
        return self.forward(torch.arange(self.num_embeddings))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.type_name} blocks"


