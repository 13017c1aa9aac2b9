"""`GGUFLinear.rows` / `file_rows` (a shortlist head's subsets of a layer, interleaved or not) and the shared
quantisation of a layer's input (`quantise_shared`): tests found missing by a mutation review."""

import torch

from utils.models import qkernels
from utils.models.gguf_blocks import synthetic_blocks
from utils.models.model_loader import cache_root
from utils.models.native_linear import GGUFLinear


def layer(type_name: str, rows: int, cols: int, seed: int, interleaved: bool = False, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    raw = synthetic_blocks(type_name, rows, cols, generator=g)
    blocks = torch.ops.specdec.interleave(raw.data, qkernels.TYPES[type_name]) if interleaved else raw.data
    return raw, GGUFLinear(blocks, type_name, torch.randn(rows, generator=g) if bias else None, cols,
                           interleaved=interleaved)


def test_rows_keep_the_bias_of_the_rows_they_take():
    assert qkernels.ensure(cache_root()), qkernels.why()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    for interleaved, ids in ((False, [5, 0, 11]), (True, [0, 3, 9, 17, 20, 21, 30, 31])):
        _, full = layer("Q4_K", 32, 256, seed=0, interleaved=interleaved, bias=True)
        sub = full.rows(torch.tensor(ids))
        assert sub.interleaved == interleaved and torch.equal(sub.bias, full.bias[ids])
        assert torch.equal(sub(x), full(x)[:, ids])


def test_whole_groups_of_a_type_without_an_interleaved_layout_stay_the_file_s_rows():
    """Eight rows of a layer in the file's layout (Q4_0: no interleaved layout at all) are not interleaved: only a
    layer that is interleaved is interleaved again."""
    assert qkernels.ensure(cache_root()), qkernels.why()
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    for type_name in ("Q4_0", "Q4_1"):
        raw, full = layer(type_name, 32, 64, seed=3)
        ids = [1, 4, 6, 9, 15, 22, 23, 31]
        sub = full.rows(torch.tensor(ids))
        assert not sub.interleaved and torch.equal(sub.blocks, raw.data[ids])
        assert torch.equal(sub(x), full(x)[:, ids])


def test_file_rows_of_scattered_groups_of_an_interleaved_layer():
    """Rows of groups 0, 2 and 3 only (not the first groups in a row): each row is found among the groups
    converted back, any order, repeats."""
    assert qkernels.ensure(cache_root()), qkernels.why()
    raw, full = layer("Q4_K", 32, 256, seed=4, interleaved=True)
    ids = torch.tensor([30, 5, 17, 5, 24, 0])
    assert torch.equal(full.file_rows(ids), raw.data[ids])


def test_an_input_changed_in_place_is_quantised_again():
    """The shared quantisation keys on the tensor and its `_version`: the same tensor, changed in place, is another
    input."""
    assert qkernels.ensure(cache_root()), qkernels.why()
    _, one = layer("Q4_K", 16, 256, seed=5)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(6))
    before = one(x)
    x.mul_(-2)
    assert torch.equal(one(x), one(x.clone())) and not torch.equal(one(x), before)


def test_layers_of_both_activation_formats_on_one_input_each_read_their_own_blocks():
    """q8 blocks (32 values: Q4_0) and q8k blocks (256 values: Q4_K) of one input, one after the other, as a layer's
    projections of two types read it."""
    assert qkernels.ensure(cache_root()), qkernels.why()
    _, legacy = layer("Q4_0", 16, 256, seed=7)
    _, k_quant = layer("Q4_K", 16, 256, seed=8)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(9))
    got = [legacy(x), k_quant(x), legacy(x)]
    assert torch.equal(got[0], legacy(x.clone())) and torch.equal(got[1], k_quant(x.clone()))
    assert torch.equal(got[2], got[0])


def test_a_layer_runs_under_inference_mode():
    """`torch.inference_mode()` is how a library user commonly runs a model (the README's library use loads one with `load_model`), and inference tensors have no version
    counter: `quantise_shared` reading `x._version` raised "Inference tensors do not track version counter", so a
    native GGUF model could not run inside it (`autoregressive_generate` too)."""
    assert qkernels.ensure(cache_root()), qkernels.why()
    _, one = layer("Q4_K", 16, 256, seed=10)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(11))
    expected = one(x)
    with torch.inference_mode():
        inside = torch.randn(2, 256, generator=torch.Generator().manual_seed(11))
        assert torch.equal(one(inside), expected)
        inside.mul_(-2)  # changed in place: not the blocks of before
        assert torch.equal(one(inside), one(inside.clone()))
