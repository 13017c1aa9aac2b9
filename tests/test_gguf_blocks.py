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
