"""The lean forward pass (utils/models/lean_forward.py) computes what transformers' forward computes, bit for bit,
with the cache on and off, under a KV budget, and hands every call it does not understand to transformers."""

import pytest
import torch

from conftest import PROMPT
from gguf_models import write_tiny_gguf
from utils.caching import KV_BUDGET_ATTRIBUTE, new_cache
from utils.models import qkernels
from utils.models.gguf_native import build, prepare
from utils.models.kernel_choice import KernelChoice
from utils.models.model_loader import cache_root
from utils.models.rowwise_attention import use_kv_budget


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(tmp_path_factory, request):
    assert qkernels.ensure(cache_root()), qkernels.why()
    path = write_tiny_gguf(tmp_path_factory.mktemp("lean") / f"{request.param}.gguf", request.param, seed=3)
    return build(*prepare(path, KernelChoice(None, "gguf")))


def transformers_forward(model, **kwargs):
    return type(model).forward(model, **kwargs)  # the class's forward, not the lean one set on the instance


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
    if budget:
        use_kv_budget(model, budget)
    try:
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
    finally:
        if budget and hasattr(model.config, KV_BUDGET_ATTRIBUTE):
            delattr(model.config, KV_BUDGET_ATTRIBUTE)  # the module's model is shared by the next tests


def test_calls_it_does_not_understand_go_to_transformers(model, monkeypatch):
    from utils.models import lean_forward

    ids = torch.tensor([PROMPT, PROMPT])  # a batch of two
    called = []
    monkeypatch.setattr(lean_forward, "lean_pass", lambda *a, **k: called.append(1))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
        model(input_ids=ids[:1], output_hidden_states=True, use_cache=False)
        model(input_ids=ids[:1], use_cache=False)
    assert out.logits.shape[0] == 2 and called == [1]
