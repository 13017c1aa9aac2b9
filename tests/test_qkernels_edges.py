"""Edges of the integer kernels that the main kernel tests' shapes do not reach (a mutation review): products whose
thread parts span several of mm_many's L2 chunks, ops whose threaded loops split the work only past their grain,
and the activation blocks' float offset term."""

import gguf
import numpy as np
import pytest
import torch

from utils.models import qkernels
from utils.models.gguf_blocks import synthetic_blocks
from utils.models.model_loader import cache_root


@pytest.fixture(autouse=True, scope="module")
def built():
    assert qkernels.ensure(cache_root()), qkernels.why()


class threads:
    """torch's thread count for a block, restored after."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def float64_product(raw, xq, cols):
    """x @ w.T in float64 from the activation blocks' d * q and the gguf package's dequantised weights."""
    blocks = xq.reshape(xq.shape[0], cols // 256, qkernels.K_ACTIVATION_BLOCK_BYTES)
    q = blocks[..., 0:256].contiguous().view(torch.int8).double()
    d = blocks[..., 256:260].contiguous().view(torch.float32).double()
    x = (q * d).reshape(xq.shape[0], cols)
    w = torch.from_numpy(gguf.quants.dequantize(raw.data.numpy(), gguf.GGMLQuantizationType[raw.type_name])
                         .astype(np.float64))
    return x @ w.T, x.abs() @ w.abs().T


@pytest.mark.parametrize("type_name,out,x8", [("Q6_K", 1280, True), ("Q4_K", 2048, False)])
def test_thread_parts_longer_than_an_l2_chunk_keep_the_bits(type_name, out, x8):
    """mm_many walks a thread's part in chunks of 64 KiB of weights, every tile of activation rows over a chunk
    before the next; with several tiles the first tile of each chunk unpacks Q6_K_X8's values for the others
    (x8_tile_unpacked). A part longer than one chunk (one thread: 8 parts; Q6_K_X8 1280 rows of 512 inputs, 160
    groups, 19 a chunk; Q4_K 2048 rows, 227 a chunk) needs each chunk whole and its own unpacking: the main tests'
    shapes (at most 312 rows) never reach a second chunk in a part."""
    cols = 512
    g = torch.Generator().manual_seed(21)
    raw = synthetic_blocks(type_name, out, cols, scale=0.05, generator=g)
    w = torch.ops.specdec.interleave(raw.data, qkernels.TYPES[type_name]) if x8 else raw.data
    kind = qkernels.X8[type_name] if x8 else qkernels.TYPES[type_name]
    xq = qkernels.quantize(torch.randn(9, cols, generator=g) * 3, type_name)  # 9 rows: more than one tile on every path
    expected, scale = float64_product(raw, xq, cols)
    with threads(1):
        results = {p: torch.ops.specdec.gguf_mm(xq, w, kind, cols, p) for p in qkernels.paths()}
    for path, y in results.items():
        error = (y.double() - expected).abs()
        assert (error <= scale * 1e-5 + 1e-6).all(), (qkernels.PATHS[path], error.max().item())
        assert torch.equal(y, results[0]), qkernels.PATHS[path]


def test_activation_blocks_hold_d_times_the_sum_of_their_values_as_one_float_product():
    """BlockQ8::ds, the legacy types' offset factor (Q4_0, Q4_1, Q5_0, Q5_1: w = a * v + b, the offsets b * ds), is
    d * float(s0 + s1), one rounding, on both paths. Summed as d * s0 + d * s1 it moved products by an ulp, which the
    float64 tolerance does not see and every path shared."""
    g = torch.Generator().manual_seed(17)
    x = torch.randn(7, 256, generator=g) * torch.logspace(-3, 3, 7).unsqueeze(1)
    for path in (0, -1):
        blocks = torch.ops.specdec.quantize_q8(x, path).reshape(7, 8, qkernels.ACTIVATION_BLOCK_BYTES)
        d = blocks[..., 32:36].contiguous().view(torch.float32).squeeze(-1)
        ds = blocks[..., 36:40].contiguous().view(torch.float32).squeeze(-1)
        sums = blocks[..., 40:44].contiguous().view(torch.int16).sum(-1, dtype=torch.int32)
        assert torch.equal(ds, d * sums.float()), path


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "IQ4_XS"])
def test_embedding_rows_past_the_threads_grain_are_each_ids_row(type_name):
    """decode_rows shares the ids out between threads from 64 on: 200 ids on two threads, each its own row."""
    cols = 256
    g = torch.Generator().manual_seed(23)
    raw = synthetic_blocks(type_name, 300, cols, scale=0.5, generator=g)
    ids = torch.randint(0, 300, (200,), generator=g)
    expected = gguf.quants.dequantize(raw.data.index_select(0, ids).numpy(), gguf.GGMLQuantizationType[type_name])
    with threads(2):
        got = torch.ops.specdec.embedding_rows(raw.data, qkernels.TYPES[type_name], cols, ids)
    assert torch.equal(got, torch.from_numpy(expected.astype(np.float32)))


@pytest.mark.parametrize("type_name", sorted(qkernels.X8))
def test_interleaving_more_groups_than_the_threads_grain_round_trips_and_multiplies(type_name):
    """interleave_rows shares groups of 8 rows out between threads from 16 groups on: 40 groups on two threads
    round-trip byte for byte, and their product matches the float64 reference."""
    from test_qkernels import reference

    values = 256 if type_name in qkernels.K_TYPES else 32
    cols = values * 2
    g = torch.Generator().manual_seed(29)
    raw = synthetic_blocks(type_name, 320, cols, scale=0.05, generator=g)
    kind = qkernels.TYPES[type_name]
    xq = qkernels.quantize(torch.randn(3, cols, generator=g) * 3, type_name)
    expected, scale = reference(raw, xq)
    with threads(2):
        w = torch.ops.specdec.interleave(raw.data, kind)
        assert torch.equal(torch.ops.specdec.deinterleave(w, kind), raw.data)
        y = torch.ops.specdec.gguf_mm(xq, w, qkernels.X8[type_name], cols, 0)
    assert ((y.double() - expected).abs() <= scale * 1e-5 + 1e-6).all()


def q8_0_blocks(out, cols, g):
    return synthetic_blocks("Q8_0", out, cols, scale=0.05, generator=g).data


def test_a_wide_fused_pass_equals_its_halves_past_the_elementwise_grain():
    """attn_in's and attn_out_mlp's element-wise loops (biases, residuals, RMSNorm) share rows out between threads
    only past their grains (32768 values for the residuals, 32768 / width rows for a bias): 160 rows of 256 on two
    threads give the bits of the same op on each half (a row's result does not depend on its pass)."""
    ops, q8 = torch.ops.specdec, qkernels.TYPES["Q8_0"]
    g = torch.Generator().manual_seed(31)
    rows, width, heads, kv_heads, dim = 160, 256, 4, 2, 64
    hidden, attn = torch.randn(1, rows, width, generator=g), torch.randn(1, rows, heads * dim, generator=g)
    norm = 1 + 0.1 * torch.randn(width, generator=g)
    w_out = [q8_0_blocks(width, heads * dim, g)] + [q8_0_blocks(width, width, g) for _ in range(3)]
    b_out = [torch.randn(width, generator=g) for _ in range(4)]
    w_in = [q8_0_blocks(heads * dim, width, g), q8_0_blocks(kv_heads * dim, width, g),
            q8_0_blocks(kv_heads * dim, width, g)]
    b_in = [torch.randn(heads * dim, generator=g), torch.randn(kv_heads * dim, generator=g),
            torch.randn(kv_heads * dim, generator=g)]
    angles = torch.randn(rows, dim // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def both(r):
        out = ops.attn_out_mlp(hidden[:, r], attn[:, r], w_out, [q8] * 4, b_out, norm, 1e-6)
        q, k, v = ops.attn_in(hidden[:, r], norm, 1e-6, w_in, [q8] * 3, b_in, cos[r], sin[r], heads, kv_heads)
        return out, q, k, v

    with threads(2):
        whole = both(slice(0, rows))
        halves = [both(slice(0, rows // 2)), both(slice(rows // 2, rows))]
    assert torch.equal(whole[0], torch.cat([h[0] for h in halves], 1))
    for i in (1, 2, 3):  # [1, heads, rows, dim]
        assert torch.equal(whole[i], torch.cat([h[i] for h in halves], 2)), i


def test_activation_quantisation_and_requantising_on_two_threads_give_the_one_thread_bytes():
    """quantize_rows and requantize_rows_q4_1 share their blocks and rows out between threads past their grains
    (256 or 64 activation blocks, 16 weight rows). The main tests reach those splits only where the session runs
    more than one thread (pytest-xdist's workers run one): pinned here to two."""
    from utils.models.native_linear import dense, q4_1_reference, requantize_q4_1

    g = torch.Generator().manual_seed(37)
    x = torch.randn(24, 1024, generator=g)
    raw = synthetic_blocks("Q4_K", 40, 512, scale=0.5, generator=g)
    with threads(1):
        one = [torch.ops.specdec.quantize_q8(x, p) for p in (0, -1)] + [torch.ops.specdec.quantize_q8k(x, p)
                                                                         for p in (0, -1)]
    with threads(2):
        two = [torch.ops.specdec.quantize_q8(x, p) for p in (0, -1)] + [torch.ops.specdec.quantize_q8k(x, p)
                                                                         for p in (0, -1)]
        requantised = requantize_q4_1(raw).data
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    assert torch.equal(requantised, q4_1_reference(dense(raw)).data)


@pytest.mark.parametrize("quantize,per_block", [("quantize_q8", 32), ("quantize_q8k", 256)])
def test_a_nan_anywhere_in_a_block_is_passed_over_alike_on_both_paths(quantize, per_block):
    """The scale's search passes over a NaN (absmax: std::max(amax, |v|); AVX2: maxps with the running maximum as
    its second operand). With the operands of the vector maxps swapped, a NaN in a block's first values was still
    passed over (the next maxps replaced it), one in its last 8 made the scale NaN: the main test puts its NaNs in
    the first 7 values only. One NaN a row, at every position of a block."""
    g = torch.Generator().manual_seed(41)
    x = torch.randn(per_block, 2 * per_block, generator=g)
    positions = torch.arange(per_block)
    x[positions, positions + per_block] = float("nan")  # row p: a NaN at value p of its second block
    op = getattr(torch.ops.specdec, quantize)
    plain, default = op(x, 0), op(x)
    assert torch.equal(plain, default)
    scales = plain.reshape(per_block, 2, -1)[:, 1, per_block:per_block + 4].contiguous().view(torch.float32)
    assert torch.isfinite(scales).all()
