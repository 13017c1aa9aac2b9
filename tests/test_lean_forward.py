"""Our own tree (utils/models/native_tree.py) and its lean pass (utils/models/lean_forward.py) compute what
transformers' tree and forward compute, bit for bit, with the cache on and off, under a KV budget, for one sequence
and a batch; every call the tree does not understand goes to transformers' tree around the same weights.

Layers of GGUF blocks take the fused ops (`specdec::attn_in`, `attn_out_mlp`): they equal, bit for bit, the module
path with RMSNorm's sum of squares taken in the ops' eight lanes, and a row's logits do not depend on its pass.
A pass whose every layer is fused runs them all in one op (`specdec::decoder_stack`), with the same bits as the
per-layer loop, cache on and off, through rollbacks and the cache's growth."""

from contextlib import contextmanager

import pytest
import torch

from conftest import PROMPT
from gguf_models import TYPES, write_tiny_gguf
from utils.caching import KV_BUDGET_ATTRIBUTE, new_cache
from gguf import GGMLQuantizationType as Q

from utils.models import lean_forward, qkernels
from utils.models.gguf_native import build, prepare
from utils.models.kernel_choice import KernelChoice
from utils.models.model_loader import cache_root
from utils.models.rowwise_attention import use_kv_budget


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(tmp_path_factory, request):
    assert qkernels.ensure(cache_root()), qkernels.why()
    path = write_tiny_gguf(tmp_path_factory.mktemp("lean") / f"{request.param}.gguf", request.param, seed=3)
    return build(*prepare(path, KernelChoice(None, "gguf")))


# Every projection in GGUF blocks (the default file has a float16 one), both activation formats in one layer.
FUSABLE = TYPES | {"ffn_up": Q.Q8_0}


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def fused_model(tmp_path_factory, request):
    assert qkernels.ensure(cache_root()), qkernels.why()
    path = write_tiny_gguf(tmp_path_factory.mktemp("fused") / f"{request.param}.gguf", request.param, seed=4,
                           types=FUSABLE)
    model = build(*prepare(path, KernelChoice(None, "gguf")))
    assert all(lean_forward.fused_plan(layer, model.config) for layer in model.model.layers)
    return model


@contextmanager
def kv_budget_for_this_test(model, budget):
    """`model` under a KV budget of `budget` positions (None: none) for one test; the module's model is shared by
    the next tests, so the budget is taken off again."""
    if budget:
        use_kv_budget(model, budget)
    try:
        yield
    finally:
        if budget and hasattr(model.config, KV_BUDGET_ATTRIBUTE):
            delattr(model.config, KV_BUDGET_ATTRIBUTE)


def transformers_forward(model, **kwargs):
    return model.transformers_model()(**kwargs)  # transformers' modules and forward, our weights


@torch.no_grad()
def test_lean_logits_equal_transformers_logits_cache_off(model):
    ids = torch.tensor([PROMPT + [20, 21, 22]])
    lean = model(input_ids=ids, use_cache=False).logits
    full = transformers_forward(model, input_ids=ids, use_cache=False).logits
    assert lean.shape == full.shape and torch.equal(lean, full)
    assert torch.equal(model(input_ids=ids, use_cache=False, logits_to_keep=2).logits, full[:, -2:])


@torch.no_grad()
@pytest.mark.parametrize("budget", [None, 8])
def test_lean_logits_equal_transformers_logits_with_a_cache(model, budget):
    with kv_budget_for_this_test(model, budget):
        ids = torch.tensor([PROMPT + list(range(20, 32))])
        caches = [new_cache(model), new_cache(model)]
        outs = []
        for forward, cache in zip((model, lambda **kw: transformers_forward(model, **kw)), caches):
            steps = [forward(input_ids=ids[:, : len(PROMPT)], past_key_values=cache, use_cache=True).logits[:, -1]]
            for i in range(len(PROMPT), ids.shape[1], 3):  # passes of three, positions given as the runner does
                chunk = ids[:, i : i + 3]
                positions = torch.arange(i, i + chunk.shape[1]).unsqueeze(0)
                out = forward(input_ids=chunk, past_key_values=cache, use_cache=True, position_ids=positions)
                steps.append(out.logits[:, -1])
            outs.append(torch.cat(steps))
        assert torch.equal(outs[0], outs[1])


@torch.no_grad()
def test_a_batch_runs_in_the_tree_and_equals_transformers(model):
    ids = torch.tensor([PROMPT, PROMPT[::-1]])  # beam search's call: rows of one length, no padding
    ours = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(ours, transformers_forward(model, input_ids=ids, use_cache=False).logits)
    assert torch.equal(ours[1:], model(input_ids=ids[1:], use_cache=False).logits)


def test_calls_it_does_not_understand_go_to_transformers(model, monkeypatch):
    from utils.models import native_tree

    ids = torch.tensor([PROMPT])
    called = []
    monkeypatch.setattr(native_tree, "lean_pass", lambda *a, **k: called.append(1))
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        padded = model(input_ids=ids, attention_mask=torch.tensor([[0] + [1] * (len(PROMPT) - 1)]), use_cache=False)
        model(input_ids=ids, use_cache=False)
    assert len(hidden.hidden_states) == model.config.num_hidden_layers + 1 and padded.logits.shape[1] == len(PROMPT)
    assert called == [1]


@torch.no_grad()
def test_generate_and_an_assistant_go_through_transformers_tree(model):
    """transformers' `generate` (the benchmark's hf-* peers) runs on the tree's weights: its greedy tokens are the
    tree's own argmax tokens, with the tree as its own assistant too."""
    from utils.models.native_tree import transformers_form

    ids = torch.tensor([PROMPT])
    greedy = ids
    for _ in range(4):
        greedy = torch.cat([greedy, model(input_ids=greedy, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), greedy)
    assisted = transformers_form(model).generate(ids, assistant_model=transformers_form(model), **kwargs)
    assert torch.equal(assisted, greedy)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
])
def test_the_trees_rotary_embedding_equals_transformers(rope):
    """The GGUF files' rope types the tree runs (the tiny files above carry only the default one)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from utils.models.native_tree import RotaryEmbedding, tree_applicable

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters=rope)
    x, positions = torch.randn(1, 5, 64), torch.arange(100, 105)[None]
    assert tree_applicable(config)
    for ours, theirs in zip(RotaryEmbedding(config)(x, positions), LlamaRotaryEmbedding(config)(x, positions)):
        assert torch.equal(ours, theirs)


def test_a_dynamic_rope_or_a_sliding_window_keeps_transformers_tree():
    from transformers import LlamaConfig, Qwen2Config

    from utils.models.native_tree import tree_applicable

    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert not tree_applicable(LlamaConfig(rope_parameters=dynamic))
    assert not tree_applicable(Qwen2Config(use_sliding_window=True, sliding_window=64))
    assert tree_applicable(Qwen2Config())


def test_the_tree_imports_no_modelling_code_of_transformers(tmp_path):
    """The point of the tree: a warm start builds and runs a model from its prepared state without importing
    transformers' modelling modules (2.9 s of a warm start)."""
    import subprocess
    import sys

    config, layout, state = prepare(write_tiny_gguf(tmp_path / "qwen2.gguf", "qwen2", seed=3), KernelChoice(None, "f32"))
    config.save_pretrained(tmp_path)
    torch.save({"layout": layout, "tensors": state}, tmp_path / "state.pt")
    code = ("import sys, torch; from transformers import AutoConfig; from utils.models.gguf_native import build; "
            f"folder = {str(tmp_path)!r}; saved = torch.load(folder + '/state.pt', weights_only=True); "
            "model = build(AutoConfig.from_pretrained(folder), saved['layout'], saved['tensors']); "
            "print(model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape, "
            "sorted(m for m in sys.modules if m.startswith('transformers.models.') and '.modeling_' in m "
            "and '.auto.' not in m))")  # the auto classes' name tables are not an architecture's code
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == f"torch.Size([1, 3, {config.vocab_size}]) []"


class LaneRMSNorm(torch.nn.Module):
    """transformers' RMSNorm with the sum of squares in the fused ops' order: eight lanes, then halves, pairs, last
    two; every other step as transformers' (float32 throughout)."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x):
        squares = (x * x).reshape(*x.shape[:-1], -1, 8)  # [..., n / 8, 8]
        lanes = torch.zeros_like(squares[..., 0, :])
        for i in range(squares.shape[-2]):
            lanes = lanes + squares[..., i, :]
        s = lanes[..., :4] + lanes[..., 4:]  # a0 + a4 .. a3 + a7
        total = (s[..., 0] + s[..., 2]) + (s[..., 1] + s[..., 3])
        mean = total / x.shape[-1]
        inverse = torch.rsqrt(mean + self.eps)  # as transformers
        return self.weight * (x * inverse.unsqueeze(-1))


@contextmanager
def lane_norms(layers):
    """Each layer's two norms as LaneRMSNorm for a while. Not by monkeypatch: from pytest 9.2 its undo restores
    what the instance's `__dict__` held, and a module's submodules live elsewhere, so it deleted the norms of the
    module-scoped model the next tests share."""
    norms = [(layer.input_layernorm, layer.post_attention_layernorm) for layer in layers]
    try:
        for layer, (first, second) in zip(layers, norms):
            layer.input_layernorm, layer.post_attention_layernorm = LaneRMSNorm(first), LaneRMSNorm(second)
        yield
    finally:
        for layer, (first, second) in zip(layers, norms):
            layer.input_layernorm, layer.post_attention_layernorm = first, second


@torch.no_grad()
def test_fused_layers_equal_the_module_path_with_the_same_norm_sum(fused_model, monkeypatch):
    ids = torch.tensor([PROMPT + [20, 21, 22]])
    fused = fused_model(input_ids=ids, use_cache=False).logits
    monkeypatch.setattr(lean_forward, "FUSED_LAYERS", False)
    torch_norm = fused_model(input_ids=ids, use_cache=False).logits
    with lane_norms(fused_model.model.layers):
        lanes = fused_model(input_ids=ids, use_cache=False).logits
    assert torch.equal(fused, lanes)
    # the two orders of one sum differ in the last bits only; 8-bit activations can turn such a bit into a step
    assert (fused - torch_norm).abs().max() < 0.05 * torch_norm.abs().max()


@torch.no_grad()
@pytest.mark.parametrize("budget", [None, 8])
def test_fused_logits_do_not_depend_on_the_width_of_their_pass(fused_model, budget):
    with kv_budget_for_this_test(fused_model, budget):
        ids = torch.tensor([PROMPT + list(range(20, 32))])
        whole = fused_model(input_ids=ids, use_cache=False).logits[0]  # [positions, vocab]
        for width in (1, 3):
            cache = new_cache(fused_model)
            steps = [fused_model(input_ids=ids[:, :len(PROMPT)], past_key_values=cache, use_cache=True).logits[0]]
            for i in range(len(PROMPT), ids.shape[1], width):
                steps.append(fused_model(input_ids=ids[:, i : i + width], past_key_values=cache, use_cache=True,
                                         position_ids=torch.arange(i, min(i + width, ids.shape[1]))[None]).logits[0])
            assert torch.equal(torch.cat(steps), whole)


@pytest.fixture(scope="module")
def interleaved_model(tmp_path_factory):
    assert qkernels.ensure(cache_root()), qkernels.why()
    path = write_tiny_gguf(tmp_path_factory.mktemp("fused8") / "qwen2.gguf", "qwen2", seed=5, types=FUSABLE)
    return build(*prepare(path, KernelChoice(None, "gguf8")))


@torch.no_grad()
def test_interleaved_fused_logits_do_not_depend_on_the_width_of_their_pass(interleaved_model):
    # The fused ops run q/k/v and gate/up as one product of several weights of mixed types. 40 positions in one pass
    # take AMX's tile unit where the CPU has one (Q4_K from 8 rows, Q6_K from 16, Q4_1 from 12: matmul.cpp), one
    # and three at a time the vector tiles: the same logits
    layers = [m for m in interleaved_model.modules() if getattr(m, "interleaved", False)]
    assert {m.type_name for m in layers} >= {"Q4_K", "Q6_K", "Q4_1"}
    ids = torch.tensor([(PROMPT * 4)[:40]])
    whole = interleaved_model(input_ids=ids, use_cache=False).logits[0]  # [positions, vocab]
    for width in (1, 3):
        cache = new_cache(interleaved_model)
        steps = []
        for i in range(0, ids.shape[1], width):
            steps.append(interleaved_model(input_ids=ids[:, i : i + width], past_key_values=cache, use_cache=True,
                                           position_ids=torch.arange(i, min(i + width, ids.shape[1]))[None]).logits[0])
        assert torch.equal(torch.cat(steps), whole), width


@torch.no_grad()
@pytest.mark.parametrize("fused", [True, False])
def test_keeping_fewer_logits_trims_the_last_layer_and_changes_no_bit(fused_model, monkeypatch, fused):
    monkeypatch.setattr(lean_forward, "FUSED_LAYERS", fused)
    monkeypatch.setattr(lean_forward, "STACKED", False)  # the per-layer loop, whose calls this test counts
    kept = []
    for name in ("fused_decoder_layer", "decoder_layer"):
        layer_fn = getattr(lean_forward, name)
        monkeypatch.setattr(lean_forward, name, lambda *a, f=layer_fn: kept.append(a[-1]) or f(*a))
    ids = torch.tensor([PROMPT + list(range(20, 32))])
    whole = fused_model(input_ids=ids, use_cache=False).logits[0]  # [positions, vocab]
    for k in (1, 2):
        kept.clear()
        assert torch.equal(fused_model(input_ids=ids, use_cache=False, logits_to_keep=k).logits[0], whole[-k:])
        assert kept[-1] == k and set(kept[:-1]) == {0}  # the last layer alone ran k rows
    # with a cache: the trimmed passes still store every row's keys and values, so the next steps see them
    cache, steps = new_cache(fused_model), []
    steps.append(fused_model(input_ids=ids[:, :len(PROMPT)], past_key_values=cache, use_cache=True,
                             logits_to_keep=1).logits[0])
    for i in range(len(PROMPT), ids.shape[1], 3):
        steps.append(fused_model(input_ids=ids[:, i : i + 3], past_key_values=cache, use_cache=True,
                                 position_ids=torch.arange(i, min(i + 3, ids.shape[1]))[None],
                                 logits_to_keep=1).logits[0])
    ends = [len(PROMPT) - 1] + [min(i + 3, ids.shape[1]) - 1 for i in range(len(PROMPT), ids.shape[1], 3)]
    assert torch.equal(torch.cat(steps), whole[ends])


def passes_of_a_decoding(model, ids, cache_on: bool) -> list:
    """Logits of passes a speculative decoding makes: a prompt, verifications of several widths with rollbacks
    in between (the kept rows trimmed as the generators ask), one-row steps; cache off, whole-sequence passes."""
    if not cache_on:
        return [model(input_ids=ids[:, :n], use_cache=False, logits_to_keep=k).logits for n, k in ((6, 0), (9, 3), (14, 1))]
    cache, out = new_cache(model), []
    out.append(model(input_ids=ids[:, :6], past_key_values=cache, use_cache=True, logits_to_keep=1).logits)
    at = 6
    for width, rejected in ((4, 2), (1, 0), (3, 3), (5, 1), (1, 0)):
        out.append(model(input_ids=ids[:, at : at + width], past_key_values=cache, use_cache=True,
                         logits_to_keep=width).logits)
        if rejected:
            cache.crop(-rejected)
        at += width - rejected
    return out


@torch.no_grad()
@pytest.mark.parametrize("cache_on", [True, False])
def test_the_one_op_stack_equals_the_per_layer_loop(fused_model, monkeypatch, cache_on):
    from utils import caching

    monkeypatch.setattr(caching, "MIN_ROOM", 1)  # the buffers fill and grow within the test's few positions
    ids = torch.tensor([PROMPT + list(range(20, 40))])
    ran = []  # per call of the op's path: whether it ran the pass (None: declined, the loop ran it)
    original = lean_forward.stacked_pass
    monkeypatch.setattr(lean_forward, "stacked_pass", lambda *a: ran.append(original(*a)) or ran[-1])
    one_op = passes_of_a_decoding(fused_model, ids, cache_on)
    assert len(ran) == len(one_op) and all(out is not None for out in ran)
    # the op trims the last layer to the kept rows itself: [1, kept, hidden]
    assert [out.shape[1] for out in ran] == ([1, 4, 1, 3, 5, 1] if cache_on else [6, 3, 1])
    monkeypatch.setattr(lean_forward, "STACKED", False)
    loop = passes_of_a_decoding(fused_model, ids, cache_on)
    assert len(ran) == len(one_op)  # not asked again
    assert all(torch.equal(a, b) for a, b in zip(one_op, loop))


@torch.no_grad()
def test_caches_the_op_cannot_write_and_kv_budgets_take_the_per_layer_loop(fused_model, monkeypatch):
    from transformers import DynamicCache

    ids = torch.tensor([PROMPT + [20, 21]])
    ran = []
    original = lean_forward.stacked_pass
    monkeypatch.setattr(lean_forward, "stacked_pass", lambda *a: ran.append(original(*a)) or ran[-1])
    dynamic = DynamicCache(config=fused_model.config)
    plain = fused_model(input_ids=ids, past_key_values=dynamic, use_cache=True).logits
    assert ran == [None] and dynamic.get_seq_length() == ids.shape[1]  # asked, declined: the loop filled it
    with kv_budget_for_this_test(fused_model, 8):
        fused_model(input_ids=ids, past_key_values=new_cache(fused_model), use_cache=True)
    assert len(ran) == 1  # under a budget the op is not asked
    assert torch.equal(plain, fused_model(input_ids=ids, past_key_values=new_cache(fused_model), use_cache=True).logits)
    assert len(ran) == 2 and ran[-1] is not None


@torch.no_grad()
def test_a_tensor_of_rows_to_keep_and_the_default_cache_are_transformers(model):
    """transformers' `logits_to_keep` may be a tensor of row indices (the tree's pass takes an int alone: such a
    call goes to transformers' tree); `use_cache=None` follows the config (a cache comes back); `return_dict=False`
    gives a tuple."""
    ids = torch.tensor([PROMPT])
    rows = torch.tensor([0, 2])
    kept = model(input_ids=ids, use_cache=False, logits_to_keep=rows).logits
    full = model(input_ids=ids, use_cache=False).logits
    assert kept.shape[1] == 2 and torch.equal(kept, full[:, rows])
    assert model.config.use_cache and model(input_ids=ids).past_key_values is not None
    out = model(input_ids=ids, use_cache=False, return_dict=False)
    assert isinstance(out, tuple) and torch.equal(out[0], full)


@torch.no_grad()
def test_a_cached_pass_without_positions_continues_from_the_cache(model):
    """transformers' rule, which library callers rely on: with no `position_ids`, a pass over a cache starts at the
    cache's length (the runner always gives positions; the test above does too)."""
    ids = torch.tensor([PROMPT + [20, 21, 22]])
    outs = []
    for forward in (model, lambda **kw: transformers_forward(model, **kw)):
        cache = new_cache(model)
        forward(input_ids=ids[:, : len(PROMPT)], past_key_values=cache, use_cache=True)
        outs.append(forward(input_ids=ids[:, len(PROMPT):], past_key_values=cache, use_cache=True).logits)
    assert torch.equal(outs[0], outs[1])
    full = model(input_ids=ids, use_cache=False).logits[:, len(PROMPT):]
    assert torch.allclose(outs[0], full, atol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_h2o_and_snapkv_see_every_row_of_the_last_layer(tmp_path, policy):
    """H2O and SnapKV record every query row's attention in every layer, so a pass keeping one row's logits
    must not trim the last layer there: its cache then follows the same rule as the other layers', and the
    tokens equal those of transformers' tree over the same weights under the same budget."""
    from utils.model_runner import ModelRunner
    from utils.models.native_tree import transformers_form
    from utils.models.rowwise_attention import use_kv_budget

    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama", seed=3)
    model = build(*prepare(path, KernelChoice(None, "gguf")))
    use_kv_budget(model, 12, policy=policy)
    prompt = torch.tensor([PROMPT + list(range(20, 40))])
    tokens = []
    for forward in (model, transformers_form(model)):
        runner = ModelRunner(forward, use_cache=True)
        seq, out = prompt, []
        for _ in range(6):
            logits = runner.logits(seq, 1)  # [1, 1, vocab]: one row kept, though every row is attended
            assert logits.shape[1] == 1
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            out.append(int(nxt))
        if policy == "h2o":
            assert len({len(layer.rows) for layer in runner.cache.layers}) == 1
        tokens.append(out)
    assert tokens[0] == tokens[1]


@torch.no_grad()
def test_transformers_tree_takes_the_head_of_the_moment(tmp_path):
    """A shortlist head set after transformers' tree was first built (`/draft_vocab` in a chat) is the head a
    call that goes there computes (hidden states for the acceptance head, `generate`), not the one it was built
    with: -inf outside the shortlist, the same logits as the tree's own pass."""
    from utils.models.draft_vocab import ShortlistHead

    path = write_tiny_gguf(tmp_path / "qwen2.gguf", "qwen2", seed=3)
    model = build(*prepare(path, KernelChoice(None, "gguf")))
    ids, vocab = torch.tensor([PROMPT]), model.config.vocab_size
    torch.manual_seed(0)
    head = torch.nn.Linear(model.config.hidden_size, vocab, bias=False)  # a head whose rows a shortlist gathers
    model.set_output_embeddings(head)
    model(input_ids=ids, output_hidden_states=True, use_cache=False)  # builds transformers' tree
    model.set_output_embeddings(ShortlistHead(head, torch.arange(0, vocab, 2), vocab))
    there = model(input_ids=ids, output_hidden_states=True, use_cache=False).logits
    here = model(input_ids=ids, use_cache=False).logits
    assert torch.isneginf(there[..., 1::2]).all() and torch.equal(there, here)


def test_the_tree_reads_the_config_s_head_dim_and_keeps_transformers_for_another_activation():
    """A Llama file whose heads are narrower than hidden / heads (Mistral-Nemo's GGUF is `llama`: 5120 wide, 32
    heads of 128) gives `head_dim` in its config; the tree's attention and rotary embedding use it, as
    transformers' do. The tree's MLP is SiLU: another activation keeps transformers' tree."""
    from transformers import LlamaConfig

    from utils.models.native_tree import Attention, RotaryEmbedding, tree_applicable

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert Attention(config, 0).head_dim == 8 and RotaryEmbedding(config).inv_freq.numel() == 4
    assert tree_applicable(config) and not tree_applicable(LlamaConfig(hidden_act="gelu"))


@torch.no_grad()
def test_a_batch_of_a_fused_model_runs_each_row_as_its_own_pass(fused_model, monkeypatch):
    """The fused ops take one sequence: a batch (beam search) takes the layers' modules, each row's logits those
    of its own pass on the modules, bit for bit."""
    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    batch = fused_model(input_ids=ids, use_cache=False).logits
    monkeypatch.setattr(lean_forward, "FUSED_LAYERS", False)
    for row in range(2):
        assert torch.equal(batch[row : row + 1], fused_model(input_ids=ids[row : row + 1], use_cache=False).logits)
