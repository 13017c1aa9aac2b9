"""oneDNN linear layers: same logits up to float rounding, and speculative decoding stays exactly lossless."""

import torch

from conftest import PROMPT, tiny_decoder
from sampling import autoregressive_generate, speculative_generate
from utils import cpu_kernels
from utils.cpu_kernels import PackedLinear, onednn_applicable, packing_available, use_onednn_linear


def tiny_float32(seed):
    return tiny_decoder("qwen2", seed=seed).float()


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
