"""GGUF quantisation blocks decoded into integer values and group scales, in torch, without re-quantising.

A quantised GGUF tensor is rows of fixed-size blocks (llama.cpp's `ggml-common.h`; the `gguf` package's
`quants.py` holds the same layouts in numpy). Each decoder here returns the file's own integers and the scales
it stores, so a kernel can run them as they are. Two forms cover the types of the embedded files:

- `Int4Groups`: unsigned 4-bit values in groups of 32, `w = scale * q - minimum` (Q4_K, Q4_0, Q4_1). This is
  exactly the form of torch's int4 weight-only CPU kernel, which computes `(q - 8) * scale + zero`.
- `IntGroups`: signed integers in groups of `group`, `w = scale * q` (Q8_0, Q6_K in groups of 16, Q5_0).

`dequantize` turns either into float32 with the same operations, in the same order, as the `gguf` package's
numpy code, so the results are bit-identical (tests/test_gguf_blocks.py). Types without a decoder here are
dequantized by the `gguf` package itself (`gguf.quants.dequantize`) and run dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

QK_K = 256  # values per K-quant super-block


@dataclass
class Int4Groups:
    q: Tensor  # [rows, cols] uint8, 0..15
    scale: Tensor  # [rows, cols // 32] float32
    minimum: Tensor  # [rows, cols // 32] float32
    group: int = 32


@dataclass
class IntGroups:
    q: Tensor  # [rows, cols] int8
    scale: Tensor  # [rows, cols // group] float32
    group: int


def _f16(raw: Tensor) -> Tensor:
    """[blocks, 2] bytes -> [blocks, 1] float32 (the file's float16, widened exactly)."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(raw: Tensor, width: int) -> Tensor:
    """[blocks, chunks * width] bytes -> [blocks, chunks * 2 * width]: per chunk the low nibbles, then the high."""
    blocks = raw.shape[0]
    chunks = raw.reshape(blocks, -1, 1, width)  # [blocks, chunks, 1, width]
    shifts = torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return ((chunks >> shifts) & 0x0F).reshape(blocks, -1)


def _blocks(raw: Tensor, block_bytes: int) -> tuple[Tensor, int]:
    """[rows, row_bytes] -> ([rows * blocks_per_row, block_bytes], rows)."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % block_bytes:
        raise ValueError(f"expected rows of {block_bytes}-byte blocks, got {tuple(raw.shape)} {raw.dtype}")
    return raw.reshape(-1, block_bytes), raw.shape[0]


def q4_k_scale_min(packed: Tensor) -> tuple[Tensor, Tensor]:
    """The twelve scale bytes of a Q4_K/Q5_K block -> eight 6-bit scales and eight 6-bit minimums, [blocks, 8]."""
    d, m, m_d = packed.reshape(-1, 3, 4).unbind(1)  # [blocks, 4] each
    scale = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    minimum = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale, minimum


def decode_q4_k(raw: Tensor) -> Int4Groups:
    # block: d f16 | dmin f16 | 12 bytes of 6-bit scales and minimums | 128 bytes of nibbles
    blocks, rows = _blocks(raw, 144)
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # [blocks, 1]
    sc, m = q4_k_scale_min(blocks[:, 4:16])  # [blocks, 8]
    q = _nibbles(blocks[:, 16:], 32)  # [blocks, 256]: 4 chunks of 64 = sub-blocks 2j (low) and 2j+1 (high)
    return Int4Groups(q.reshape(rows, -1), (d * sc.float()).reshape(rows, -1), (dmin * m.float()).reshape(rows, -1))


def decode_q4_0(raw: Tensor) -> Int4Groups:
    # block: d f16 | 16 bytes of nibbles; w = d * (q - 8)
    blocks, rows = _blocks(raw, 18)
    d = _f16(blocks[:, 0:2])
    q = _nibbles(blocks[:, 2:], 16)
    return Int4Groups(q.reshape(rows, -1), d.reshape(rows, -1), (d * 8).reshape(rows, -1))


def decode_q4_1(raw: Tensor) -> Int4Groups:
    # block: d f16 | m f16 | 16 bytes of nibbles; w = d * q + m
    blocks, rows = _blocks(raw, 20)
    d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:], 16)
    return Int4Groups(q.reshape(rows, -1), d.reshape(rows, -1), (-m).reshape(rows, -1))


def decode_q8_0(raw: Tensor) -> IntGroups:
    # block: d f16 | 32 int8
    blocks, rows = _blocks(raw, 34)
    d = _f16(blocks[:, 0:2])
    q = blocks[:, 2:].contiguous().view(torch.int8)
    return IntGroups(q.reshape(rows, -1), d.reshape(rows, -1), 32)


def decode_q5_0(raw: Tensor) -> IntGroups:
    # block: d f16 | 32 high bits (little-endian u32) | 16 bytes of low nibbles; w = d * (q - 16)
    blocks, rows = _blocks(raw, 22)
    d = _f16(blocks[:, 0:2])
    high_bytes = blocks[:, 2:6].to(torch.int32)  # [blocks, 4]
    bits = torch.arange(8, dtype=torch.int32)
    high = ((high_bytes.unsqueeze(-1) >> bits) & 1).reshape(-1, 32).to(torch.uint8)  # bit i -> value i
    low = _nibbles(blocks[:, 6:], 16)
    q = ((low | (high << 4)).to(torch.int16) - 16).to(torch.int8)
    return IntGroups(q.reshape(rows, -1), d.reshape(rows, -1), 32)


def decode_q6_k(raw: Tensor) -> IntGroups:
    # block: 128 bytes of low nibbles | 64 bytes of high 2-bit pairs | 16 int8 scales | d f16; w = d*sc * (q - 32)
    blocks, rows = _blocks(raw, 210)
    low = _nibbles(blocks[:, :128], 64).reshape(-1, 8, 32)  # [blocks, 8, 32]
    pairs = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((pairs >> shifts) & 0x03).reshape(-1, 8, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(-1, QK_K)
    sc = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [blocks, 16]
    d = _f16(blocks[:, 208:210])
    return IntGroups(q.reshape(rows, -1), (d * sc).reshape(rows, -1), 16)


DECODERS = {
    "Q4_K": decode_q4_k,
    "Q4_0": decode_q4_0,
    "Q4_1": decode_q4_1,
    "Q8_0": decode_q8_0,
    "Q5_0": decode_q5_0,
    "Q6_K": decode_q6_k,
}
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# (values, bytes) per block and where a block keeps its float16 scales (ggml-common.h), for the types our
# integer kernels read as they are in the file.
BLOCK_LAYOUT = {"Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)), "Q5_1": (32, 24, (0, 2)),
                "Q8_0": (32, 34, (0,)), "IQ4_NL": (32, 18, (0,)), "Q2_K": (256, 84, (80, 82)),
                "Q3_K": (256, 110, (108,)), "Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)),
                "Q6_K": (256, 210, (208,)), "IQ4_XS": (256, 136, (0,)), "IQ3_S": (256, 110, (0,)),
                "IQ3_XXS": (256, 98, (0,)), "IQ2_S": (256, 82, (0,)), "IQ2_XS": (256, 74, (0,)),
                "IQ2_XXS": (256, 66, (0,)), "IQ1_S": (256, 50, (0,)), "IQ1_M": (256, 56, ())}
# IQ1_M keeps its float16 scale in the top nibbles of the four uint16 at this byte (d's bits 0-3 in the first).
PACKED_F16_AT = {"IQ1_M": 48}


def pack_f16(blocks: Tensor, at: int, bits: Tensor) -> None:
    """Writes float16 bit patterns `bits` (int16 [...]) into the top nibbles of the uint16 at `at`..`at + 7` of
    `blocks` ([..., block bytes] uint8), in place."""
    for w in range(4):
        nibble = ((bits.to(torch.int32) >> (4 * w)) & 0xF).to(torch.uint8)
        blocks[..., at + 2 * w + 1] = (blocks[..., at + 2 * w + 1] & 0x0F) | (nibble << 4)


@dataclass
class RawBlocks:
    """A tensor kept as the file's blocks: [rows, row_bytes] uint8 of GGML type `type_name`."""
    type_name: str
    data: Tensor
    in_features: int


def synthetic_blocks(type_name: str, rows: int, cols: int, scale: float = 1e-2, generator=None) -> RawBlocks:
    """Random blocks of a type whose float16 scales are finite and small (random bytes elsewhere are valid
    integers and 6-bit scales): for timing kernels and testing them."""
    values, nbytes, f16_at = BLOCK_LAYOUT[type_name]
    blocks = cols // values
    raw = torch.randint(0, 256, (rows, blocks, nbytes), dtype=torch.uint8, generator=generator)
    scales = (torch.rand(rows, blocks, len(f16_at), generator=generator) * scale).half()
    pairs = scales.view(torch.uint8).reshape(rows, blocks, len(f16_at), 2)
    for i, at in enumerate(f16_at):
        raw[:, :, at : at + 2] = pairs[:, :, i]
    if type_name in PACKED_F16_AT:
        d = (torch.rand(rows, blocks, generator=generator) * scale).half()
        pack_f16(raw, PACKED_F16_AT[type_name], d.view(torch.int16))
    return RawBlocks(type_name, raw.reshape(rows, blocks * nbytes), cols)


def dequantize(form: Int4Groups | IntGroups) -> Tensor:
    """float32 [rows, cols], computed as the `gguf` package computes it (same operations, same order)."""
    rows, cols = form.q.shape
    groups = form.q.reshape(rows, cols // form.group, form.group).float()  # [rows, groups, group]
    if isinstance(form, Int4Groups):
        values = form.scale.unsqueeze(-1) * groups - form.minimum.unsqueeze(-1)
    else:
        values = form.scale.unsqueeze(-1) * groups
    return values.reshape(rows, cols)


def decode(type_name: str, raw: np.ndarray | Tensor) -> Int4Groups | IntGroups | Tensor:
    """A tensor's bytes (or values, for float types) -> its decoded form; float tensors come back as they are.

    Raises KeyError for a type without a decoder here (the caller falls back to `gguf.quants.dequantize`).
    """
    data = torch.from_numpy(np.array(raw)) if isinstance(raw, np.ndarray) else raw  # a copy: the reader maps read-only
    if type_name in FLOAT_TYPES:
        return data.view(FLOAT_TYPES[type_name]) if data.dtype == torch.uint8 else data
    return DECODERS[type_name](data)


def as_values(form: Int4Groups | IntGroups | Tensor) -> Tensor:
    """A decoded form -> float32 values [rows, cols] (float weights as they are, in float32)."""
    return form.float() if isinstance(form, Tensor) else dequantize(form)


def decoded_rows(type_name: str, rows: Tensor) -> Tensor:
    """Rows of a tensor's blocks (uint8 [n, row bytes]) or float values -> float32 [n, cols], the bits of the `gguf`
    package's decoder: ours where we have one, else the package's own (the other types of our kernels' embedding
    rows, when the kernels are not built)."""
    if type_name in DECODERS or type_name in FLOAT_TYPES:
        return as_values(decode(type_name, rows))
    return package_dequantized(type_name, rows.numpy())


def package_dequantized(type_name: str, data: np.ndarray) -> Tensor:
    """A tensor's blocks of any type the `gguf` package reads -> float32 values, by the package's own decoder
    (NotImplementedError for a type it cannot read)."""
    import gguf

    values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def q4_0_as_q4_1(form: RawBlocks) -> RawBlocks:
    """Q4_0 blocks (w = d * (q - 8)) as Q4_1 blocks (w = d * q + m) with m = -8d: the same weights, bit for bit (d
    is a float16, so 8d is one too, and d * q and d * (q - 8) are exact in float32), and our Q4_1 tiles compute a
    Q4_0 block's products with the same operations (offset -8d times the activation sum). Why: Q4_1 has the tiles
    of 8 interleaved rows that wide passes need (a 9-row pass of a Q4_0 layer cost 4x its one-row pass); 2 bytes a
    block more. The form as it is where some 8d would overflow float16 (never in a real model)."""
    blocks = form.data.reshape(form.data.shape[0], -1, 18)  # [rows, blocks, d | 16 bytes of nibbles]
    d = blocks[..., 0:2].contiguous().view(torch.float16)  # [rows, blocks, 1]
    m = d.float() * -8
    if not torch.isfinite(m.half()).all():
        return form
    data = torch.cat([blocks[..., 0:2], m.half().view(torch.uint8), blocks[..., 2:]], dim=-1)  # [rows, blocks, 20]
    return RawBlocks("Q4_1", data.reshape(form.data.shape[0], -1), form.in_features)
