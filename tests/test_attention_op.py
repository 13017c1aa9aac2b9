"""The row-wise attention op (`torch.ops.specdec.attention`, utils/models/qkernels/attention.h) against a float64
reference of causal attention, and the property greedy speculative decoding needs of it: a query row's result is
the same bits alone as inside a pass of any width, on any number of threads, and on every code path (the AVX2
items against the plain C++ loops). rowwise_attention takes it for float32 on CPU; a KV budget keeps the Python
rows."""

import math

import pytest
import torch

from utils.models import qkernels
from utils.models.model_loader import cache_root
from utils.models.rowwise_attention import in_one_op, rowwise_attention


@pytest.fixture(autouse=True, scope="module")
def built():
    assert qkernels.ensure(cache_root()), qkernels.why()


def reference(q, k, v, scale):
    """float64 causal attention: query row i sees the keys up to position n - rows + i; -> [batch, rows, heads, dim]."""
    q, k, v = q.double(), k.double(), v.double()
    group, rows, n = q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * scale  # [batch, heads, rows, n]
    hidden = torch.arange(n)[None, :] > (n - rows + torch.arange(rows))[:, None]
    out = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v
    return out.transpose(1, 2)


SHAPES = [  # batch, heads, kv heads, rows, keys, dim
    (1, 12, 2, 1, 300, 128),  # the 1.5B decoding
    (1, 12, 2, 4, 40, 128),  # a verification
    (1, 14, 2, 33, 33, 64),  # the 0.5B, cache off
    (2, 4, 4, 3, 9, 12),  # a batch, no grouping, a dim that is no multiple of 8
    (1, 3, 1, 1, 1, 8),  # one key
]


@pytest.mark.parametrize("shape", SHAPES)
def test_attention_matches_the_float64_reference(shape):
    batch, heads, kv_heads, rows, n, dim = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(batch, heads, rows, dim, generator=gen)
    k, v = (torch.randn(batch, kv_heads, n, dim, generator=gen) for _ in range(2))
    out = torch.ops.specdec.attention(q, k, v, 1 / math.sqrt(dim))
    assert out.shape == (batch, rows, heads, dim)
    assert torch.allclose(out.double(), reference(q, k, v, 1 / math.sqrt(dim)), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_is_the_same_bits_alone_as_in_its_pass_and_on_any_threads(shape):
    batch, heads, kv_heads, rows, n, dim = shape
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(batch, heads, rows, dim, generator=gen)
    # keys and values as a cache hands them out: a view into a longer buffer
    k, v = (torch.randn(batch, kv_heads, n + 5, dim, generator=gen)[:, :, :n] for _ in range(2))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(torch.ops.specdec.attention(q, k, v, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    for i in range(rows):
        seen = n - rows + i + 1
        alone = torch.ops.specdec.attention(q[:, :, i : i + 1], k[:, :, :seen], v[:, :, :seen], 0.125)
        assert torch.equal(alone[:, 0], outs[0][:, i])


@pytest.mark.parametrize("group", range(1, 10))
@pytest.mark.parametrize("dim", [64, 128, 96])
def test_every_path_gives_the_portable_loops_bits(group, dim):
    """The AVX2 items (query heads per kv head 1..8, dim a multiple of 64; others run the portable loops) give
    the plain C++ reference's bits, over more keys than a block of KEY_BLOCK and a ragged last block."""
    gen = torch.Generator().manual_seed(group * dim)
    rows, n = 3, 37
    q = torch.randn(1, 2 * group, rows, dim, generator=gen)
    k, v = (torch.randn(1, 2, n + 4, dim, generator=gen)[:, :, :n] for _ in range(2))
    fast = torch.ops.specdec.attention(q, k, v, dim**-0.5)
    assert torch.equal(fast, torch.ops.specdec.attention_portable(q, k, v, dim**-0.5))
    assert torch.allclose(fast.double(), reference(q, k, v, dim**-0.5), atol=2e-6, rtol=1e-5)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_idx, self.config = 0, type("Config", (), {})()


def test_rowwise_attention_takes_the_op_for_float32_and_the_python_rows_otherwise(monkeypatch):
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    assert in_one_op(q) and not in_one_op(q.bfloat16())
    calls = []
    op = torch.ops.specdec.attention
    monkeypatch.setattr(torch.ops.specdec, "attention", lambda *a: calls.append(a) or op(*a), raising=False)
    out, _ = rowwise_attention(Layer(), q, k, v, None, scaling=0.25)
    assert len(calls) == 1 and torch.allclose(out.double(), reference(q, k, v, 0.25), atol=2e-6)
    python_rows, _ = rowwise_attention(Layer(), q.bfloat16(), k.bfloat16(), v.bfloat16(), None, scaling=0.25)
    assert len(calls) == 1 and python_rows.dtype == torch.bfloat16


def test_bad_shapes_raise_a_clear_error():
    with pytest.raises(RuntimeError, match="heads a multiple of kv heads"):
        torch.ops.specdec.attention(torch.randn(1, 3, 1, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.specdec.attention(torch.randn(1, 2, 1, 8).double(), torch.randn(1, 2, 4, 8),
                                    torch.randn(1, 2, 4, 8), 1.0)


def test_without_a_scaling_the_op_and_the_python_rows_take_sdpas_default():
    """transformers always passes `scaling`; a caller that leaves it out gets SDPA's 1/sqrt(dim) on either path."""
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    expected = reference(q, k, v, 16 ** -0.5)
    out, _ = rowwise_attention(Layer(), q, k, v, None)
    assert torch.allclose(out.double(), expected, atol=2e-6)
    rows, _ = rowwise_attention(Layer(), q.double(), k.double(), v.double(), None)
    assert torch.allclose(rows, expected, atol=1e-9)


def test_a_float32_layer_under_a_kv_budget_reads_only_its_sinks_and_window():
    """The op attends to everything: a layer with a KV budget (native mode's float32 included) takes the rows that
    keep to the budget, each query its 2 sinks and last 3 keys."""
    from utils.caching import KV_BUDGET_ATTRIBUTE

    layer = Layer()
    setattr(layer.config, KV_BUDGET_ATTRIBUTE, (2, 3))
    q, k, v = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    out, _ = rowwise_attention(layer, q, k, v, None, scaling=0.25)
    for row, seen in enumerate((11, 12)):
        keep = [0, 1, *range(seen - 3, seen)]
        expected = reference(q[:, :, row : row + 1], k[:, :, keep], v[:, :, keep], 0.25)
        assert torch.allclose(out[:, row : row + 1].double(), expected, atol=2e-6)
