"""Tiny randomly initialised models built from transformers configs: no network, no hub."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# One build of our integer kernels for the whole session, subprocesses included, whatever cache folder a test
# points SPECDEC_CACHE_DIR at (each build is ~35 s of compiling).
from utils.models.cache_folder import cache_root  # noqa: E402

os.environ.setdefault("SPECDEC_QKERNELS_DIR", str(cache_root()))

# pytest-xdist runs test files in one worker process per core (pyproject's addopts): one thread each, for the
# worker and the infer.py processes it starts. Two workers with two OpenMP threads each on two cores make every
# tiny operation wait for a descheduled thread (measured: a 24 us linear layer took 0.5 ms).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"

# The longest files start first, so that the workers finish together instead of one waiting for the real model.
LONGEST_FIRST = ("test_embedded_e2e.py", "test_cli.py", "test_cli_robustness.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within each file stays

VOCAB = 64
CONTEXT = 128
# Where the tiny models run: cpu here and in CI; on a machine with a GPU, SPECDEC_TEST_DEVICE=cuda runs the tests
# built on them (lossless greedy, sampling distributions, cache roll-back, draft-stop rules) on it.
TEST_DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")


def ids(rows) -> torch.Tensor:
    """Token ids for a tiny model's direct call, on the tests' device."""
    return torch.tensor(rows, device=TEST_DEVICE)


def decoder_config(arch: str, vocab: int = VOCAB, context: int = CONTEXT, init: float = 0.02):
    common = dict(vocab_size=vocab, initializer_range=init, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    if arch == "llama":
        return LlamaForCausalLM, LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, max_position_embeddings=context, **common)
    if arch == "qwen2":
        return Qwen2ForCausalLM, Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, max_position_embeddings=context, **common)
    if arch == "mistral":  # sliding window of 8: generations run well past it
        return MistralForCausalLM, MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2, max_position_embeddings=context, sliding_window=8, **common)
    if arch == "gpt2":
        return GPT2LMHeadModel, GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=context, **common)
    if arch == "gpt_neox":
        return GPTNeoXForCausalLM, GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                 max_position_embeddings=context, **common)
    if arch == "opt":
        return OPTForCausalLM, OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                         word_embed_proj_dim=32, max_position_embeddings=context, **common)
    raise ValueError(arch)


def tiny_decoder(arch: str = "llama", seed: int = 0, **kwargs) -> torch.nn.Module:
    cls, config = decoder_config(arch, **kwargs)
    torch.manual_seed(seed)
    return cls(config).double().eval().to(TEST_DEVICE)


def tiny_encoder_decoder(arch: str = "t5", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch == "t5":
        config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                          decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
        return T5ForConditionalGeneration(config).double().eval().to(TEST_DEVICE)
    config = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=CONTEXT,
                        decoder_start_token_id=2, eos_token_id=1, pad_token_id=0, bos_token_id=0, forced_eos_token_id=None)
    return BartForConditionalGeneration(config).double().eval().to(TEST_DEVICE)


DECODER_ARCHS = ["llama", "qwen2", "gpt2", "gpt_neox", "opt", "mistral"]
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6]


@pytest.fixture(scope="session")
def decoder_pairs():
    """(target, drafter) per architecture, each a different random model."""
    return {arch: (tiny_decoder(arch, seed=0), tiny_decoder(arch, seed=1)) for arch in DECODER_ARCHS}


# Noise, in each tensor's own standard deviations, that makes a copy of the seed-0 target agree with it on some
# tokens and not on others at every gamma and cache setting of tests/test_lossless_greedy.py (a random drafter of
# gpt_neox never agreed: its tests never reached an accepted draft). Chosen by a sweep of 0.2-4.
NEAR_NOISE = {"llama": 0.3, "qwen2": 0.3, "gpt2": 3.0, "gpt_neox": 0.3, "opt": 1.0, "mistral": 0.3}


def near_drafter(target: torch.nn.Module, noise: float, seed: int = 1) -> torch.nn.Module:
    """The target with every weight tensor perturbed by `noise` of its standard deviation."""
    drafter = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in drafter.parameters():
            if weight.numel() > 1:
                step = torch.randn(weight.shape, generator=g, dtype=weight.dtype).to(weight.device)
                weight.add_(step * noise * weight.std().clamp_min(1e-3))
    return drafter


@pytest.fixture(scope="session")
def near_pairs(decoder_pairs):
    """(target, drafter) per architecture whose drafts are kept in part: both verdicts occur in every answer."""
    return {arch: (target, near_drafter(target, NEAR_NOISE[arch])) for arch, (target, _) in decoder_pairs.items()}
