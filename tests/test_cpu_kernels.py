"""oneDNN linear layers: same logits up to float rounding; an int8 drafter: other logits. Either way speculative
decoding stays exactly lossless."""

import torch

from conftest import PROMPT, tiny_decoder
from sampling import autoregressive_generate, speculative_generate
from utils.models import cpu_kernels
from utils.models.cpu_kernels import (
    PackedLinear,
    int8_applicable,
    int8_layers,
    onednn_applicable,
    packing_available,
    quantize_int8,
    use_onednn_linear,
)


def tiny_float32(seed):
    # oneDNN and int8 layers are CPU features: on CPU whatever SPECDEC_TEST_DEVICE puts the other tests on
    model = tiny_decoder("qwen2", seed=seed).float().cpu()
    # transformers starts every bias at 0: a swapped layer that dropped its bias gave the same logits
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(".bias"):
                weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    assert any(name.endswith(".bias") and weight.abs().sum() > 0 for name, weight in model.named_parameters())
    return model


def test_swapped_model_computes_the_same_logits():
    model = tiny_float32(0)
    x = torch.tensor([PROMPT])
    with torch.no_grad():
        before = model(x).logits
        assert onednn_applicable(model)
        assert use_onednn_linear(model) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + lm_head
        after = model(x).logits
    assert packing_available() and isinstance(model.lm_head, PackedLinear)  # torch 2.13 CPU has the packing op
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_fallback_without_the_packing_op(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "packing_available", lambda: False)
    model = tiny_float32(0)
    x = torch.tensor([PROMPT])
    with torch.no_grad():
        before = model(x).logits
        use_onednn_linear(model)
        after = model(x).logits
    assert type(model.lm_head).__name__ == "MkldnnLinear"
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_greedy_speculative_still_equals_autoregressive():
    target, drafter = tiny_float32(0), tiny_float32(1)
    use_onednn_linear(target)
    use_onednn_linear(drafter)
    for use_cache in (False, True):
        reference = autoregressive_generate(PROMPT, target, max_gen_len=30, eos_tokens_id=-1, use_cache=use_cache)
        for gamma in (1, 4, 8):
            out, _ = speculative_generate(PROMPT, drafter, target, gamma=gamma, max_gen_len=30, eos_tokens_id=-1,
                                          use_cache=use_cache)
            assert out == reference


def test_not_applied_to_other_dtypes():
    assert not onednn_applicable(tiny_decoder("llama"))  # float64


# -- int8 drafter -------------------------------------------------------------------------------------------------

def test_int8_quantises_all_linear_layers_but_the_down_projection():
    model = tiny_float32(1)
    x = torch.tensor([PROMPT])
    with torch.no_grad():
        before = model(x).logits
        assert int8_applicable(model)
        assert quantize_int8(model) == 2 * 6 + 1  # q, k, v, o, gate, up per layer + lm_head
        after = model(x).logits
    assert int8_layers(model) == 2 * 6 + 1
    assert all(type(layer.mlp.down_proj) is torch.nn.Linear for layer in model.model.layers)
    assert not torch.equal(after, before)  # lossy, as expected of int8 ...
    torch.testing.assert_close(after, before, rtol=0.1, atol=0.1)  # ... but close
    assert use_onednn_linear(model) == 2  # the float layers left over still get oneDNN
    assert not int8_applicable(tiny_decoder("llama"))  # float64


def test_greedy_speculative_with_an_int8_drafter_equals_autoregressive():
    target, drafter = tiny_float32(0), tiny_float32(1)
    use_onednn_linear(target)
    quantize_int8(drafter)
    use_onednn_linear(drafter)
    for use_cache in (False, True):
        reference = autoregressive_generate(PROMPT, target, max_gen_len=30, eos_tokens_id=-1, use_cache=use_cache)
        for gamma in (1, 4, 8):
            out, _ = speculative_generate(PROMPT, drafter, target, gamma=gamma, max_gen_len=30,
                                          eos_tokens_id=-1, use_cache=use_cache)
            assert out == reference
