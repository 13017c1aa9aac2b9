"""Our integer kernels (utils/models/qkernels) against a float64 reference of the same quantised arithmetic:
the file's dequantised weights (the gguf package's own numpy decoder) times the 8-bit activations."""

import gguf
import numpy as np
import pytest
import torch

from utils.models import qkernels
from utils.models.gguf_blocks import (BLOCK_LAYOUT, DECODERS, PACKED_F16_AT, RawBlocks, decode, dequantize,
                                      synthetic_blocks)

from utils.models.model_loader import cache_root


@pytest.fixture(autouse=True, scope="module")
def built():
    # CI machines have a compiler: a failed build is a failure here, not a skip (the fallback has its own test)
    assert qkernels.ensure(cache_root()), qkernels.why()

TYPES = sorted(BLOCK_LAYOUT)


def activations(xq: torch.Tensor, cols: int, type_name: str) -> torch.Tensor:
    """quantize_q8's (or quantize_q8k's) blocks -> the float64 values they stand for, d * q."""
    if type_name in qkernels.K_TYPES:  # 256 int8 | d float32 | 16 int16 sums per 16 | 8 per 32 | 12 unused
        blocks = xq.reshape(xq.shape[0], cols // 256, qkernels.K_ACTIVATION_BLOCK_BYTES)
        q = blocks[..., 0:256].contiguous().view(torch.int8).double()
        d = blocks[..., 256:260].contiguous().view(torch.float32).double()
    else:  # 32 int8 | d float32 | d * sum float32 | 2 int16 sums
        blocks = xq.reshape(xq.shape[0], cols // 32, qkernels.ACTIVATION_BLOCK_BYTES)
        q = blocks[..., :32].contiguous().view(torch.int8).double()
        d = blocks[..., 32:36].contiguous().view(torch.float32).double()
    return (q * d).reshape(xq.shape[0], cols)


def reference(raw, xq) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 x @ w.T, and the sum of |terms| (the scale of float32 rounding)."""
    kind = gguf.GGMLQuantizationType[raw.type_name]
    w = torch.from_numpy(gguf.quants.dequantize(raw.data.numpy(), kind).astype(np.float64))
    x = activations(xq, raw.in_features, raw.type_name)
    return x @ w.T, x.abs() @ w.abs().T


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows,out_features,blocks", [(1, 7, 1), (5, 33, 2), (64, 3, 3)])
def test_every_path_matches_the_float64_reference_and_each_other(type_name, rows, out_features, blocks):
    values = BLOCK_LAYOUT[type_name][0]
    cols = values * blocks * (1 if values == 256 else 5)
    g = torch.Generator().manual_seed(hash((type_name, rows)) % 2**31)
    raw = synthetic_blocks(type_name, out_features, cols, scale=0.05, generator=g)
    x = torch.randn(rows, cols, generator=g) * 3
    xq = qkernels.quantize(x, type_name)
    expected, scale = reference(raw, xq)
    kind = qkernels.TYPES[type_name]
    results = [torch.ops.specdec.gguf_mm(xq, raw.data, kind, cols, path) for path in qkernels.paths()]
    for path, y in zip(qkernels.paths(), results):
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        error = (y.double() - expected).abs()
        assert (error <= scale * 1e-5 + 1e-6).all(), (qkernels.PATHS[path], error.max().item())
        assert torch.equal(y, results[0]), f"{qkernels.PATHS[path]} differs from the portable path"


@pytest.mark.parametrize("type_name", ["Q3_K", "Q6_K"])
def test_a_layers_width_with_an_outlier_activation_keeps_the_reference_tolerance(type_name):
    """Q3_K and Q6_K centre their values (u - 4, u - 32): their offsets and values cancel. Added as two float steps
    a super-block, a 4096-input row with one outlier missed the float64 reference by more than 1e-5 of its terms
    (every path alike); the offsets now leave the integer lanes first, as the interleaved tiles do."""
    cols = 4096
    g = torch.Generator().manual_seed(5)
    raw = synthetic_blocks(type_name, 64, cols, scale=0.05, generator=g)
    x = torch.randn(19, cols, generator=g) * 3
    x[3] *= 1000
    x[5, 7] = 5e4
    xq = qkernels.quantize(x, type_name)
    expected, scale = reference(raw, xq)
    for path in qkernels.paths():
        y = torch.ops.specdec.gguf_mm(xq, raw.data, qkernels.TYPES[type_name], cols, path).double()
        error = (y - expected).abs()
        assert (error <= scale * 1e-5 + 1e-6).all(), (qkernels.PATHS[path], (error / scale).max().item())


@pytest.mark.parametrize("type_name", TYPES)
def test_a_rows_result_does_not_depend_on_the_width_of_its_pass(type_name):
    values = BLOCK_LAYOUT[type_name][0]
    cols = max(values, 64) * 2
    g = torch.Generator().manual_seed(7)
    raw = synthetic_blocks(type_name, 19, cols, generator=g)
    x = torch.randn(64, cols, generator=g)
    for path in qkernels.paths():
        full = torch.ops.specdec.gguf_mm(qkernels.quantize(x, type_name), raw.data, qkernels.TYPES[type_name], cols, path)
        for width in (1, 2, 3, 4, 5, 9, 17, 63):
            part = torch.ops.specdec.gguf_mm(qkernels.quantize(x[:width], type_name), raw.data,
                                             qkernels.TYPES[type_name], cols, path)
            assert torch.equal(part, full[:width]), (qkernels.PATHS[path], width)
        # and the last row alone, at an offset that is no tile boundary
        alone = torch.ops.specdec.gguf_mm(qkernels.quantize(x[37:38], type_name), raw.data,
                                          qkernels.TYPES[type_name], cols, path)
        assert torch.equal(alone[0], full[37])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0"])
def test_results_do_not_depend_on_the_number_of_threads(type_name):
    """Threads split the output rows, never a sum (from 2 rows in parts taken by whichever thread is free): 1, 2
    and 3 threads give the same bits (the suite's parallel workers run with one thread each, so it is pinned here)."""
    values = BLOCK_LAYOUT[type_name][0]
    g = torch.Generator().manual_seed(11)
    raw = synthetic_blocks(type_name, 301, values * 2, generator=g)
    xq = qkernels.quantize(torch.randn(6, values * 2, generator=g), type_name)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(torch.ops.specdec.gguf_mm(xq, raw.data, qkernels.TYPES[type_name], values * 2))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_activation_quantisation_rounds_half_to_even_and_keeps_zero_rows():
    x = torch.randn(3, 64)
    x[1] = 0
    xq = torch.ops.specdec.quantize_q8(x)
    blocks = xq.reshape(3, 2, qkernels.ACTIVATION_BLOCK_BYTES)
    q = blocks[..., :32].contiguous().view(torch.int8)
    d = blocks[..., 32:36].contiguous().view(torch.float32).squeeze(-1)
    groups = x.reshape(3, 2, 32)
    expected_d = groups.abs().amax(-1) / 127
    assert torch.equal(d, expected_d)
    inverse = torch.where(expected_d == 0, torch.zeros_like(expected_d), 1 / expected_d)
    assert torch.equal(q, torch.round(groups * inverse.unsqueeze(-1)).clamp(-127, 127).to(torch.int8))
    assert not q[1].any()
    sums = blocks[..., 40:44].contiguous().view(torch.int16)
    assert torch.equal(sums, q.reshape(3, 2, 2, 16).sum(-1).to(torch.int16))


def test_k_activation_blocks_hold_one_scale_per_256_and_sums_per_16_and_per_32():
    x = torch.randn(2, 512)
    xq = torch.ops.specdec.quantize_q8k(x)
    blocks = xq.reshape(2, 2, qkernels.K_ACTIVATION_BLOCK_BYTES)
    q = blocks[..., 0:256].contiguous().view(torch.int8)
    d = blocks[..., 256:260].contiguous().view(torch.float32).squeeze(-1)
    sums = blocks[..., 260:292].contiguous().view(torch.int16)
    sums32 = blocks[..., 292:308].contiguous().view(torch.int16)
    assert qkernels.K_ACTIVATION_BLOCK_BYTES == 320  # five cache lines: the values' loads never straddle two
    groups = x.reshape(2, 2, 256)
    assert torch.equal(d, groups.abs().amax(-1) / 127)
    assert torch.equal(q, torch.round(groups * (1 / d).unsqueeze(-1)).clamp(-127, 127).to(torch.int8))
    assert torch.equal(sums, q.reshape(2, 2, 16, 16).sum(-1).to(torch.int16))
    # the interleaved Q4_K tile reads these as int32 pairs (sub-blocks 2j, 2j + 1)
    assert torch.equal(sums32, q.reshape(2, 2, 8, 32).sum(-1).to(torch.int16))


@pytest.mark.parametrize("quantize", ["quantize_q8", "quantize_q8k"])
def test_vector_quantisation_gives_the_plain_loops_bytes(quantize):
    # path 0 quantises in plain C++, the default in AVX2 where built: every byte the same, on rows of every scale,
    # rounding ties, zeros, signed zeros, subnormals, an infinity and NaNs (passed over by the scale's search)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 1536, generator=g) * torch.logspace(-30, 30, 40).unsqueeze(1)
    ties = (torch.arange(256) % 254 - 127).float() + 0.5  # -126.5 .. 126.5
    ties[31::32] = 127.0  # every block's largest magnitude 127: its scale 1, so k + 0.5 is a rounding tie
    x[0] = 0
    x[1, :7] = float("nan")
    x[2, 100] = float("inf")
    x[3, ::3] = -0.0
    x[4, :256], x[5, :256], x[6, :256] = ties, -ties, 1e-40
    op = getattr(torch.ops.specdec, quantize)
    plain, default = op(x, 0), op(x)
    assert torch.equal(plain, default)
    assert plain[0].count_nonzero() == 0  # a zero row: zero values, scale and sums (and the padding)
    per_block = 256 if quantize == "quantize_q8k" else 32
    q = default.reshape(40, -1, default.shape[1] // (1536 // per_block))[4, :, :per_block].reshape(-1)
    assert torch.equal(q[:256].view(torch.int8), torch.round(ties).to(torch.int8))  # half to even: 0.5 -> 0, 1.5 -> 2


def test_bad_arguments_raise_instead_of_reading_past_the_buffer():
    raw = synthetic_blocks("Q4_0", 4, 64)
    xq = torch.ops.specdec.quantize_q8(torch.randn(2, 64))
    with pytest.raises(RuntimeError, match="in_features"):
        torch.ops.specdec.gguf_mm(xq, raw.data, qkernels.TYPES["Q4_K"], 64)
    k_raw = synthetic_blocks("Q4_K", 4, 256)
    with pytest.raises(RuntimeError, match="quantize_q8k"):  # legacy blocks for a K-quant weight
        torch.ops.specdec.gguf_mm(torch.ops.specdec.quantize_q8(torch.randn(2, 256)), k_raw.data, 12, 256)
    with pytest.raises(RuntimeError, match="quantize_q8"):
        torch.ops.specdec.gguf_mm(torch.ops.specdec.quantize_q8(torch.randn(2, 96)), raw.data, 2, 64)
    with pytest.raises(RuntimeError, match="no kernel"):
        torch.ops.specdec.gguf_mm(xq, raw.data, 1, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.specdec.quantize_q8(torch.randn(2, 40))


def test_fused_layers_refuse_weights_of_other_shapes_before_writing():
    """attn_out_mlp checked none of its weights' output rows (one short left columns of at::empty in the answer, one
    long wrote past the buffer: SIGSEGV); decoder_stack wrote a negative `start`'s rows in front of the cache buffer;
    gguf_mm over 0 inputs returned uninitialised memory."""
    ops = torch.ops.specdec
    rows, width, heads, kv_heads, dim = 4, 64, 2, 1, 32
    q8 = qkernels.TYPES["Q8_0"]

    def blocks(out, cols):
        return synthetic_blocks("Q8_0", out, cols).data

    none, norm = torch.empty(0), torch.ones(width)
    hidden, attn = torch.randn(1, rows, width), torch.randn(1, rows, width)
    for o_rows in (32, 4096):
        with pytest.raises(RuntimeError, match="weight 0 has .* output rows where 64 are expected"):
            ops.attn_out_mlp(hidden, attn, [blocks(o_rows, width)] + [blocks(width, width)] * 3, [q8] * 4,
                             [none] * 4, norm, 1e-6)
    with pytest.raises(RuntimeError, match="weight 3 has 32 output rows"):  # down, the last product
        ops.attn_out_mlp(hidden, attn, [blocks(width, width)] * 3 + [blocks(32, width)], [q8] * 4, [none] * 4, norm,
                         1e-6)
    weights = [blocks(heads * dim, width), blocks(kv_heads * dim, width), blocks(kv_heads * dim, width),
               blocks(width, heads * dim), blocks(width, width), blocks(width, width), blocks(width, width)]
    backing = torch.zeros(1, kv_heads, 16, dim)
    keys, values = backing[:, :, 8:], torch.zeros(1, kv_heads, 16, dim)[:, :, 8:]  # buffers inside a larger tensor
    with pytest.raises(RuntimeError, match="start -3 is negative"):
        ops.decoder_stack(hidden, torch.ones(1, rows, dim), torch.zeros(1, rows, dim), weights, [q8] * 7, [none] * 7,
                          [norm] * 2, [1e-6] * 2, heads, kv_heads, [keys], [values], -3, 0, dim ** -0.5)
    assert not backing.any()  # nothing written in front of the buffer
    with pytest.raises(RuntimeError, match="in_features 0 is not a positive multiple"):
        ops.gguf_mm(ops.quantize_q8(torch.empty(3, 0)), torch.empty(16, 0, dtype=torch.uint8), q8, 0)


def test_layer_benchmark_times_every_compiled_path():
    # `python -m benchmarks.layer_kernels --paths`: one median per compiled path and width, the portable one left out
    from benchmarks.layer_kernels import time_paths

    times = time_paths("Q4_K", 16, 256, (1, 3))
    assert sorted(times) == [p for p in qkernels.paths() if p != 0]
    assert all(sorted(t) == [1, 3] and min(t.values()) > 0 for t in times.values())
    grouped = time_paths("Q4_1", 16, 256, (9,), x8=True)  # --paths --x8: the interleaved layout on every path
    assert sorted(grouped) == sorted(times) and all(min(t.values()) > 0 for t in grouped.values())


def test_whole_pass_benchmark_runs_every_quantised_weight_of_a_file(tmp_path):
    # `python -m benchmarks.layer_kernels --pass MODEL` on a tiny file of every block type
    from benchmarks.layer_kernels import time_pass
    from gguf_models import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    times = time_pass(path, (1, 2), repeats=1)
    assert sorted(times) == sorted(qkernels.PATHS[p] for p in qkernels.paths() if p != 0)
    assert all(sorted(t) == [1, 2] and min(t.values()) > 0 for t in times.values())
    layouts = time_pass(path, (1,), repeats=1, x8=True)  # --x8: the file's layout (best path), gguf8 (each path)
    assert len(layouts) == len(times) + 1 and all("/".join(qkernels.X8) in label for label in layouts)
    assert sum("interleaved" in label for label in layouts) == len(times)
    from benchmarks.layer_kernels import interleaved_as_run  # Q4_0 as native mode runs it: Q4_1, interleaved

    raw = synthetic_blocks("Q4_0", 16, 64)
    assert interleaved_as_run("Q4_0", 64, raw.data, qkernels.TYPES["Q4_0"])[3] == qkernels.X8["Q4_1"]


# -- the K-quants, IQ4_XS, Q4_1 and Q8_0 with 8 rows interleaved (interleaved.h, kernel `gguf8`) ----------------

X8_TYPES = sorted(qkernels.X8)


def interleaved(raw):
    return torch.ops.specdec.interleave(raw.data, qkernels.TYPES[raw.type_name])


@pytest.mark.parametrize("type_name", X8_TYPES)
def test_interleaving_round_trips_byte_for_byte_and_checks_its_shape(type_name):
    g = torch.Generator().manual_seed(5)
    raw = synthetic_blocks(type_name, 24, 512, generator=g)
    x8 = interleaved(raw)
    file_bytes, grouped = qkernels.X8_ROW_BYTES[type_name]
    assert x8.shape == (24, raw.data.shape[1] // file_bytes * grouped) and x8.dtype == torch.uint8
    assert torch.equal(torch.ops.specdec.deinterleave(x8, qkernels.TYPES[type_name]), raw.data)
    assert not torch.equal(x8[:, :file_bytes], raw.data[:, :file_bytes])  # the layout really differs
    with pytest.raises(RuntimeError, match="interleave"):
        torch.ops.specdec.interleave(raw.data[:12], qkernels.TYPES[type_name])  # not a multiple of 8 rows
    with pytest.raises(RuntimeError, match="Q2_K .10., Q3_K .11., Q4_K .12., Q5_K .13., Q6_K .14., IQ4_XS .23., Q4_1 .3. or Q8_0 .8. only"):
        torch.ops.specdec.interleave(raw.data, qkernels.TYPES["Q5_0"])


@pytest.mark.parametrize("type_name", X8_TYPES)
@pytest.mark.parametrize("rows,out_features,blocks", [(1, 8, 1), (5, 24, 2), (64, 16, 3)])
def test_interleaved_rows_match_the_float64_reference_on_every_path(type_name, rows, out_features, blocks):
    cols = BLOCK_LAYOUT[type_name][0] * blocks * (1 if type_name == "Q4_K" else 5)
    g = torch.Generator().manual_seed(rows * 31 + blocks)
    raw = synthetic_blocks(type_name, out_features, cols, scale=0.05, generator=g)
    xq = qkernels.quantize(torch.randn(rows, cols, generator=g) * 3, type_name)
    expected, scale = reference(raw, xq)
    kind = qkernels.X8[type_name]
    results = [torch.ops.specdec.gguf_mm(xq, interleaved(raw), kind, cols, p) for p in qkernels.paths()]
    for path, y in zip(qkernels.paths(), results):
        assert y.shape == (rows, out_features)
        error = (y.double() - expected).abs()
        assert (error <= scale * 1e-5 + 1e-6).all(), (qkernels.PATHS[path], error.max().item())
        assert torch.equal(y, results[0]), f"{qkernels.PATHS[path]} differs from the portable path"


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("fill", [0xFF, 0x80])
def test_extreme_blocks_and_activations_stay_exact_on_every_path(type_name, fill):
    # Every weight byte at its extreme (nibbles 15, 6-bit values 63 and scales 63; 0x80 for Q8_0's -128) against
    # activations all +127 or all -127: the tiles' integer sums at their bounds (the interleaved tiles add 16
    # products of 15 * 127 in an int16 before their scales apply, Q5_K's 8 of 31 * 127), so an overflow would show
    # against float64.
    values, nbytes, f16_at = BLOCK_LAYOUT[type_name]
    cols = values * (8 if values == 32 else 2)
    raw = synthetic_blocks(type_name, 16, cols, scale=0.05, generator=torch.Generator().manual_seed(3))
    blocks = raw.data.reshape(16, -1, nbytes)
    keep = torch.zeros(nbytes, dtype=torch.bool)
    for at in f16_at:
        keep[at:at + 2] = True
    original = blocks.clone()
    blocks[:, :, ~keep] = fill
    if type_name in PACKED_F16_AT:  # IQ1_M's d lives in the top nibbles of four bytes: keep those nibbles
        at = PACKED_F16_AT[type_name]
        nibbles = slice(at + 1, at + 8, 2)
        blocks[:, :, nibbles] = (blocks[:, :, nibbles] & 0x0F) | (original[:, :, nibbles] & 0xF0)
    x = torch.ones(33, cols)  # 33: past every type's first width on AMX's tile unit (matmul.cpp's amx_min_rows)
    x[1::2] = -1.0  # rows of +127 and of -127
    xq = qkernels.quantize(x, type_name)
    expected, scale = reference(raw, xq)
    layouts = [(raw.data, qkernels.TYPES[type_name])]
    if type_name in qkernels.X8:
        layouts.append((interleaved(raw), qkernels.X8[type_name]))
    for w, kind in layouts:
        results = [torch.ops.specdec.gguf_mm(xq, w, kind, cols, p) for p in qkernels.paths()]
        for path, y in zip(qkernels.paths(), results):
            error = (y.double() - expected).abs()
            assert (error <= scale * 1e-5 + 1e-6).all(), (qkernels.PATHS[path], kind, error.max().item())
            assert torch.equal(y, results[0]), (qkernels.PATHS[path], kind)


@pytest.mark.parametrize("type_name", X8_TYPES)
def test_interleaved_rows_do_not_depend_on_width_or_threads(type_name):
    g = torch.Generator().manual_seed(9)
    raw = synthetic_blocks(type_name, 304, 512, generator=g)  # 38 groups: a split between threads mid-way
    w, x = interleaved(raw), torch.randn(64, 512, generator=g)
    kind = qkernels.X8[type_name]
    for path in qkernels.paths():
        full = torch.ops.specdec.gguf_mm(qkernels.quantize(x, type_name), w, kind, 512, path)
        for width in (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 24, 33, 63):  # AMX: tiles of 16 rows, the last overlapping
            part = torch.ops.specdec.gguf_mm(qkernels.quantize(x[:width], type_name), w, kind, 512, path)
            assert torch.equal(part, full[:width]), (qkernels.PATHS[path], width)
        alone = torch.ops.specdec.gguf_mm(qkernels.quantize(x[37:38], type_name), w, kind, 512, path)
        assert torch.equal(alone[0], full[37])
    xq, before = qkernels.quantize(x[:6], type_name), torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(torch.ops.specdec.gguf_mm(xq, w, kind, 512))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("type_name", sorted(qkernels.TYPES))
def test_embedding_rows_are_the_bits_of_the_torch_and_numpy_decoders(type_name):
    from utils.models import native_linear

    values = BLOCK_LAYOUT[type_name][0]
    cols = values * (3 if values == 256 else 5)
    g = torch.Generator().manual_seed(11)
    raw = synthetic_blocks(type_name, 300, cols, scale=0.5, generator=g)
    ids = torch.tensor([[0, 299, 17], [17, 5, 123]])  # a batch, a repeat, both ends of the table
    rows = raw.data.index_select(0, ids.reshape(-1))
    numpy = gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType[type_name])
    expected = torch.from_numpy(numpy.astype(np.float32)).reshape(2, 3, cols)
    if type_name in DECODERS:  # ours, where we decode in torch: the same bits
        assert torch.equal(dequantize(decode(type_name, rows)).reshape(2, 3, cols), expected)
    got = torch.ops.specdec.embedding_rows(raw.data, qkernels.TYPES[type_name], cols, ids)
    assert got.shape == (6, cols) and got.dtype == torch.float32
    assert torch.equal(got.reshape(2, 3, cols), expected)
    table = native_linear.GGUFEmbedding(type_name, raw.data, cols)
    assert table.type_id == qkernels.TYPES[type_name] and qkernels.loaded()  # the lookup takes the op
    assert torch.equal(table(ids), expected)
    wide = torch.cat([raw.data, raw.data[:, :7]], dim=1)[:, : raw.data.shape[1]]  # rows a longer stride apart
    assert not wide.is_contiguous()
    assert torch.equal(torch.ops.specdec.embedding_rows(wide, qkernels.TYPES[type_name], cols, ids), got)
    native_linear.EMBEDDING_OP = False  # the torch decode the layer falls back on
    try:
        assert torch.equal(table(ids), expected)
    finally:
        native_linear.EMBEDDING_OP = True


def test_embedding_rows_refuse_bad_ids_and_tables():
    raw = synthetic_blocks("Q8_0", 10, 64, generator=torch.Generator().manual_seed(0))
    op = torch.ops.specdec.embedding_rows
    with pytest.raises(RuntimeError, match="index 10 is out of range for 10 rows"):
        op(raw.data, qkernels.TYPES["Q8_0"], 64, torch.tensor([3, 10]))
    with pytest.raises(RuntimeError, match="out of range"):
        op(raw.data, qkernels.TYPES["Q8_0"], 64, torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="rows of 96 values"):
        op(raw.data, qkernels.TYPES["Q8_0"], 96, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="no decoder for GGML type 34"):  # TQ1_0
        op(raw.data, 34, 64, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="int64"):
        op(raw.data, qkernels.TYPES["Q8_0"], 64, torch.tensor([0], dtype=torch.int32))
    assert op(raw.data, qkernels.TYPES["Q8_0"], 64, torch.tensor([], dtype=torch.long)).shape == (0, 64)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(raw.data.t().contiguous().t(), qkernels.TYPES["Q8_0"], 64, torch.tensor([0]))


@pytest.mark.parametrize("type_name", sorted(qkernels.TYPES))
def test_requantising_to_q4_1_gives_the_torch_references_bits(type_name):
    """A drafter's weights re-quantised in our op (row by row, no float32 copy) are the bytes of the torch
    reference applied to the decoded weights, for every type the op decodes."""
    from utils.models.native_linear import dense, q4_1_reference, requantize_q4_1

    values = BLOCK_LAYOUT[type_name][0]
    cols = values * (3 if values == 256 else 5)
    raw = synthetic_blocks(type_name, 37, cols, scale=0.5, generator=torch.Generator().manual_seed(5))
    got = requantize_q4_1(raw)
    assert got.type_name == "Q4_1" and got.in_features == cols and got.data.shape == (37, cols // 32 * 20)
    assert torch.equal(got.data, q4_1_reference(dense(raw)).data)


def test_requantising_to_q4_1_rounds_ties_to_even_and_keeps_constant_blocks():
    from utils.models.native_linear import dense, q4_1_reference, requantize_q4_1

    # Q8_0 blocks with d = 1: block 0 holds 0..30 and 30 (range 30: d = 2, the odd values halfway, rounded to
    # even), block 1 holds 7 everywhere (d = 0: every q is 0, m = 7)
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    ramp = torch.tensor(list(range(31)) + [30], dtype=torch.int8).view(torch.uint8)
    flat = torch.full((32,), 7, dtype=torch.int8).view(torch.uint8)
    raw = RawBlocks("Q8_0", torch.cat([one, ramp, one, flat]).reshape(1, 68), 64)
    got = requantize_q4_1(raw).data.reshape(2, 20)
    assert torch.equal(got, q4_1_reference(dense(raw)).data.reshape(2, 20))
    d, m = got[:, :2].contiguous().view(torch.float16).float(), got[:, 2:4].contiguous().view(torch.float16).float()
    assert d.flatten().tolist() == [2.0, 0.0] and m.flatten().tolist() == [0.0, 7.0]
    q = torch.stack([got[0, 4:] & 15, got[0, 4:] >> 4], dim=0).flatten()  # values 0..15, then 16..31
    assert q[:8].tolist() == [0, 0, 1, 2, 2, 2, 3, 4]  # 0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5 half to even
    assert torch.equal(got[1, 4:], torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="no decoder for GGML type 34"):
        torch.ops.specdec.requantize_q4_1(raw.data, 34, 64)
    with pytest.raises(RuntimeError, match="rows of 96 values"):
        torch.ops.specdec.requantize_q4_1(raw.data, qkernels.TYPES["Q8_0"], 96)


def test_q4_0_runs_as_q4_1_with_the_same_weights_and_products():
    """A Q4_0 file's layers run as Q4_1 (for its interleaved tiles): the weights the gguf package decodes and every
    path's products are the Q4_0 blocks' own, bit for bit."""
    from utils.models.gguf_blocks import q4_0_as_q4_1

    g = torch.Generator().manual_seed(3)
    raw = synthetic_blocks("Q4_0", 24, 160, scale=0.05, generator=g)
    as_q4_1 = q4_0_as_q4_1(raw)
    assert as_q4_1.type_name == "Q4_1" and as_q4_1.data.shape == (24, 5 * 20)
    q40 = gguf.quants.dequantize(raw.data.numpy(), gguf.GGMLQuantizationType.Q4_0)
    q41 = gguf.quants.dequantize(as_q4_1.data.numpy(), gguf.GGMLQuantizationType.Q4_1)
    assert np.array_equal(q40, q41)
    xq = qkernels.quantize(torch.randn(13, 160, generator=g) * 3, "Q4_0")
    for path in qkernels.paths():
        y0 = torch.ops.specdec.gguf_mm(xq, raw.data, qkernels.TYPES["Q4_0"], 160, path)
        y1 = torch.ops.specdec.gguf_mm(xq, as_q4_1.data, qkernels.TYPES["Q4_1"], 160, path)
        assert torch.equal(y0, y1), qkernels.PATHS[path]


def linux_grants_the_tile_unit() -> bool:
    """Whether this process may use AMX's tile data: Linux's arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
    asked here as the kernels ask it (a second request is granted again)."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl on x86-64


def compiler_targets_amx() -> bool:
    import subprocess

    done = subprocess.run([qkernels.compiler_command(), *qkernels.arch_flags(), "-dM", "-E", "-x", "c++", "-"],
                          input="", capture_output=True, text=True)
    needed = ("__AMX_INT8__", "__AMX_TILE__", "__AVX512F__", "__AVX512BW__", "__AVX512DQ__", "__AVX512VL__",
              "__AVX512VNNI__", "__AVX2__", "__FMA__")  # the AMX path sits on the AVX-512 one (common.h, amx.h)
    return all(macro in done.stdout for macro in needed)


def test_the_amx_path_is_listed_exactly_where_cpu_compiler_and_linux_allow_it():
    # On every machine: listed where the build targets AMX and Linux grants the tile data, absent elsewhere (so a
    # build that silently lost it on an AMX machine fails here; on others the path must not appear)
    import os

    expected = compiler_targets_amx() and linux_grants_the_tile_unit() and os.environ.get("SPECDEC_AMX") != "off"
    assert (4 in qkernels.paths()) == expected, (qkernels.paths(), qkernels.arch_flags())


def test_specdec_amx_off_leaves_the_amx_path_out():
    import os
    import subprocess
    import sys

    code = ("from utils.models import qkernels; from utils.models.model_loader import cache_root; "
            "assert qkernels.ensure(cache_root(), progress=False); print(qkernels.paths())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "SPECDEC_AMX": "off"}).stdout
    assert out.strip() == str([p for p in qkernels.paths() if p != 4])


@pytest.mark.parametrize("type_name", X8_TYPES)
def test_an_odd_number_of_groups_and_every_split_between_threads_keep_the_bits(type_name):
    # 39 groups of 8 rows: on the AMX path pairs of groups take the tile unit and a group left alone (the last, or
    # one next to a thread's part boundary) AVX-512's tiles; 40 rows reach every type's tile-unit width
    g = torch.Generator().manual_seed(13)
    raw = synthetic_blocks(type_name, 312, 512, generator=g)
    w, xq = interleaved(raw), qkernels.quantize(torch.randn(40, 512, generator=g), type_name)
    kind, before = qkernels.X8[type_name], torch.get_num_threads()
    expected = torch.ops.specdec.gguf_mm(xq, w, kind, 512, 0)  # portable
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for path in qkernels.paths():
                assert torch.equal(torch.ops.specdec.gguf_mm(xq, w, kind, 512, path), expected), (path, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q4_1"])
def test_amx_tiles_and_onednn_share_the_tile_registers(type_name):
    # torch's bfloat16 products run oneDNN's AMX kernels on an AMX CPU, in the same threads as ours: each
    # configures the tile registers for itself, so products in turns keep their bits
    if 4 not in qkernels.paths():
        pytest.skip("no AMX path on this machine (checked by the test above)")
    g = torch.Generator().manual_seed(5)
    raw = synthetic_blocks(type_name, 96, 512, generator=g)
    w, x = interleaved(raw), torch.randn(40, 512, generator=g)
    xq, kind = qkernels.quantize(x, type_name), qkernels.X8[type_name]
    expected = torch.ops.specdec.gguf_mm(xq, w, kind, 512, 3)  # AVX-512's tiles
    a, b = torch.randn(64, 512, dtype=torch.bfloat16, generator=g), torch.randn(512, 512, dtype=torch.bfloat16, generator=g)
    product = a.float() @ b.float()
    for _ in range(3):
        assert (torch.nn.functional.linear(a, b.T).float() - product).abs().max() < 1.0
        assert torch.equal(torch.ops.specdec.gguf_mm(xq, w, kind, 512, 4), expected)
