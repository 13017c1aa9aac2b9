"""GGUF block decoding: the file's integers and scales, dequantized bit-identically to the `gguf` package."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from gguf_models import random_blocks
from utils.models.gguf_blocks import Int4Groups, IntGroups, decode, dequantize

ROWS, COLS = 5, 512


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_blocks_dequantize_exactly_as_the_gguf_package(qtype):
    raw = random_blocks(np.random.default_rng(int(qtype)), qtype, ROWS, COLS, scale=2.0)
    expected = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))  # [rows, cols]
    ours = dequantize(decode(qtype.name, raw))
    assert ours.dtype == torch.float32 and ours.shape == (ROWS, COLS)
    assert torch.equal(ours, expected)  # bit for bit, not approximately


@pytest.mark.parametrize("qtype, form, group, low, high", [
    (Q.Q4_K, Int4Groups, 32, 0, 15), (Q.Q4_0, Int4Groups, 32, 0, 15), (Q.Q4_1, Int4Groups, 32, 0, 15),
    (Q.Q6_K, IntGroups, 16, -32, 31), (Q.Q5_0, IntGroups, 32, -16, 15), (Q.Q8_0, IntGroups, 32, -128, 127),
])
def test_decoded_forms_hold_the_files_integers(qtype, form, group, low, high):
    raw = random_blocks(np.random.default_rng(1), qtype, ROWS, COLS, scale=1.0)
    decoded = decode(qtype.name, raw)
    assert isinstance(decoded, form) and decoded.group == group
    assert decoded.q.shape == (ROWS, COLS) and decoded.scale.shape == (ROWS, COLS // group)
    assert int(decoded.q.min()) >= low and int(decoded.q.max()) <= high
    assert int(decoded.q.min()) == low and int(decoded.q.max()) == high  # random bytes reach both ends


@pytest.mark.parametrize("name, dtype", [("F32", np.float32), ("F16", np.float16)])
def test_float_tensors_come_back_as_they_are(name, dtype):
    values = np.random.default_rng(2).normal(size=(3, 8)).astype(dtype)
    assert torch.equal(decode(name, values), torch.from_numpy(values))


def test_a_row_count_that_does_not_fit_the_block_is_refused():
    with pytest.raises(ValueError, match="144-byte blocks"):
        decode("Q4_K", np.zeros((2, 100), dtype=np.uint8))


def test_bfloat16_tensors_are_read_from_their_bytes():
    """The reader gives a BF16 tensor as its bytes (numpy has no bfloat16): decoded as bfloat16, not float16 and
    not left as bytes, the values are the gguf package's."""
    from gguf_models import tensor_data

    raw, _ = tensor_data(np.random.default_rng(3), Q.BF16, 3, 8)  # [3, 16] bytes
    decoded = decode("BF16", raw)
    assert decoded.dtype == torch.bfloat16 and decoded.shape == (3, 8)
    assert torch.equal(decoded.float(), torch.from_numpy(gguf_dequantize(raw, Q.BF16).astype(np.float32)))


# ---- found by a mutation review (benchmarks/RESULTS.md, fifty-ninth pass) ----


@pytest.mark.parametrize("raw", [
    np.zeros((2, 34), dtype=np.int8),  # the right size, signed: shifts and views of it would read other values
    np.zeros((2, 34, 34), dtype=np.uint8),  # not rows: its 68 blocks would be read as 2 rows
], ids=["int8", "3-d"])
def test_blocks_that_are_not_rows_of_bytes_are_refused(raw):
    with pytest.raises(ValueError, match="34-byte blocks"):
        decode("Q8_0", raw)


def test_bfloat16_embedding_rows_are_decoded_in_torch():
    """A BF16 embedding keeps bfloat16 rows (numpy has no bfloat16, so the gguf package cannot take them): a lookup
    widens them in torch."""
    from utils.models.gguf_blocks import decoded_rows

    rows = torch.randn(3, 8, generator=torch.Generator().manual_seed(4)).bfloat16()
    values = decoded_rows("BF16", rows)
    assert values.dtype == torch.float32 and torch.equal(values, rows.float())


def test_a_q4_0_block_whose_offset_overflows_float16_stays_q4_0():
    """Q4_1's minimum -8d is a float16: where it would be infinite the layer keeps its Q4_0 blocks (converted, its
    weights would be inf/nan); where it fits, the conversion keeps every weight."""
    from utils.models.gguf_blocks import q4_0_as_q4_1, synthetic_blocks

    raw = synthetic_blocks("Q4_0", 2, 64, generator=torch.Generator().manual_seed(5))
    raw.data.reshape(2, 2, 18)[1, 0, 0:2] = torch.tensor([9000.0], dtype=torch.float16).view(torch.uint8)
    assert q4_0_as_q4_1(raw) is raw  # 8 * 9000 > 65504, float16's largest
    raw.data.reshape(2, 2, 18)[1, 0, 0:2] = torch.tensor([8000.0], dtype=torch.float16).view(torch.uint8)
    converted = q4_0_as_q4_1(raw)  # 64000 fits
    assert converted.type_name == "Q4_1"
    assert np.array_equal(gguf_dequantize(converted.data.numpy(), Q.Q4_1), gguf_dequantize(raw.data.numpy(), Q.Q4_0))
