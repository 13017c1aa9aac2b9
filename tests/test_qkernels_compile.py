"""Our ops compose with torch.compile, as registering them with torch.library promised: each op's schema, fake
(meta) kernel and declared mutations pass `torch.library.opcheck` on the arguments a native model really hands it,
and a compiled native model gives the eager model's logits (bit for bit through AOT autograd with our kernels; within
float rounding where inductor fuses torch's own ops around them)."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch.library import opcheck

from conftest import PROMPT
from gguf_models import TYPES, write_tiny_gguf
from utils.caching import new_cache
from utils.models import qkernels
from utils.models.gguf_blocks import synthetic_blocks
from utils.models.gguf_native import build, prepare
from utils.models.kernel_choice import KernelChoice
from utils.models.model_loader import cache_root
from utils.models.native_linear import GGUFLinear


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    assert qkernels.ensure(cache_root()), qkernels.why()
    # every projection in GGUF blocks, so that the layers run fused (attn_in, attn_out_mlp, decoder_stack)
    path = write_tiny_gguf(tmp_path_factory.mktemp("compile") / "qwen2.gguf", "qwen2", seed=5,
                           types=TYPES | {"ffn_up": Q.Q8_0})
    return build(*prepare(path, KernelChoice(None, "gguf")))


IDS = torch.tensor([PROMPT[:7]])


class Recorder:
    """An op namespace for `qkernels.use_ops` that keeps the first call of each op (and of the one-op stack with a
    cache's buffers: it mutates them) and runs it."""

    def __init__(self):
        self.calls = {}

    def __getattr__(self, name):
        op = getattr(torch.ops.specdec, name)

        def call(*args):
            kind = f"{name} with a cache" if name == "decoder_stack" and args[10] else name
            self.calls.setdefault(kind, (op, args))
            return op(*args)
        return call


def recorded_calls(model) -> dict:
    recorder = Recorder()
    qkernels.use_ops(recorder)
    try:
        with torch.no_grad():
            model(input_ids=IDS, use_cache=False)
            cache = new_cache(model)
            model(input_ids=IDS, past_key_values=cache, use_cache=True)
            model(input_ids=IDS[:, :1], past_key_values=cache, use_cache=True)
    finally:
        qkernels.use_ops(None)
    return recorder.calls


def test_every_op_a_native_model_calls_passes_opcheck(model):
    calls = recorded_calls(model)
    assert {"decoder_stack", "decoder_stack with a cache", "quantize_q8k"} <= set(calls), sorted(calls)
    for name, (op, args) in calls.items():
        opcheck(op, args)  # raises with the op's name where its schema, fake kernel or mutations are wrong


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q4_1", "Q8_0", "Q5_0"])
def test_the_product_quantising_interleaving_and_lookup_ops_pass_opcheck(type_name):
    assert qkernels.ensure(cache_root()), qkernels.why()
    g = torch.Generator().manual_seed(1)
    raw = synthetic_blocks(type_name, 16, 512, generator=g)
    kind = qkernels.TYPES[type_name]
    x = torch.randn(5, 512, generator=g)
    opcheck(torch.ops.specdec.quantize_q8k if type_name in qkernels.K_TYPES else torch.ops.specdec.quantize_q8, (x,))
    opcheck(torch.ops.specdec.gguf_mm, (qkernels.quantize(x, type_name), raw.data, kind, 512))
    opcheck(torch.ops.specdec.embedding_rows, (raw.data, kind, 512, torch.tensor([[3, 0, 15]])))
    opcheck(torch.ops.specdec.requantize_q4_1, (raw.data, kind, 512))
    if type_name in qkernels.X8:
        opcheck(torch.ops.specdec.interleave, (raw.data, kind))
        opcheck(torch.ops.specdec.deinterleave, (torch.ops.specdec.interleave(raw.data, kind), kind))


def test_a_compiled_native_model_gives_the_eager_logits_bit_for_bit(model):
    # AOT autograd traces the model on fake tensors and functionalises the cache writes, then runs our kernels
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        eager = model(input_ids=IDS, use_cache=False).logits
        assert torch.equal(compiled(input_ids=IDS, use_cache=False).logits, eager)
        ours, theirs = new_cache(model), new_cache(model)
        for ids in (IDS, IDS[:, :1], IDS[:, 2:4]):  # a prompt, then a step and a two-row pass on the cache
            assert torch.equal(compiled(input_ids=ids, past_key_values=ours, use_cache=True).logits,
                               model(input_ids=ids, past_key_values=theirs, use_cache=True).logits)


def test_inductor_compiles_a_native_model_without_a_cache(model):
    # Inductor (torch 2.13) cannot lower the one-op stack's empty buffer lists, so a compiled cache-off pass takes
    # the per-layer ops; it fuses torch's own ops around ours, so the logits agree to float rounding.
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor")
    with torch.no_grad():
        got, want = compiled(input_ids=IDS, use_cache=False).logits, model(input_ids=IDS, use_cache=False).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-4 * want.abs().max().item()), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_projection_compiles_in_one_graph_after_eager_calls_on_the_same_input():
    # The shared quantisation remembers the last input (`is`, `_version`); a traced graph must not read that memo
    assert qkernels.ensure(cache_root()), qkernels.why()
    g = torch.Generator().manual_seed(2)
    layer = GGUFLinear(synthetic_blocks("Q4_K", 32, 512, generator=g).data, "Q4_K", torch.randn(32, generator=g), 512)
    x = torch.randn(1, 3, 512, generator=g)
    eager = layer(x)  # the memo now holds x
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), eager)
