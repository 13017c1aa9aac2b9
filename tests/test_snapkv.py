"""`--kv-policy snapkv`: after a prompt is read with full attention, each layer and kv head keeps the prompt
positions its last queries attended to most (what it shares with h2o, SD = AR among it: test_cache_policies.py)."""

import pytest
import torch

import test_cache_policies as cache_policies
from conftest import ids, tiny_decoder
from sampling import autoregressive_generate, autoregressive_run
from utils import snapkv
from utils.caching import cache_length
from utils.model_runner import ModelRunner
from utils.models.rowwise_attention import use_kv_budget

BUDGET, LONG = cache_policies.BUDGET, cache_policies.LONG  # 12 kept prompt positions + a recent window of 4


def budgeted(seed: int, policy: str = "snapkv"):
    return cache_policies.budgeted(seed, policy)


@pytest.fixture(scope="module")
def target():
    return budgeted(0)


@pytest.fixture(scope="module")
def reference(target):
    return autoregressive_generate(LONG, target, max_gen_len=30, eos_tokens_id=None, use_cache=True)


def test_kept_slots_are_the_most_attended_with_their_neighbours():
    scores = torch.zeros(2, 40)
    scores[0, 20], scores[1, 5], scores[1, 33] = 1.0, 1.0, 0.5
    kept = snapkv.kept_slots(scores, candidates=30, keep=7)  # slot 33 is not a candidate
    assert kept.shape == (2, 7) and torch.equal(kept, kept.sort(-1).values)
    assert kept[0].tolist() == list(range(17, 24))  # the peak and its pooled neighbours
    assert set(range(2, 9)) == set(kept[1].tolist())


def test_snapkv_keeps_other_positions_than_streaming(target, reference):
    full = autoregressive_generate(LONG, tiny_decoder("llama", seed=0, init=0.3), max_gen_len=30, eos_tokens_id=None)
    streaming = autoregressive_generate(LONG, budgeted(0, "streaming"), max_gen_len=30, eos_tokens_id=None)
    assert reference != full and reference != streaming  # the policy really decides (else the tests prove nothing)


def test_the_cache_is_compressed_after_the_prompt_and_stays_bounded(target):
    runner = ModelRunner(target, use_cache=True)
    runner.logits(ids([LONG]), 1)
    kept, window = snapkv.split_budget(BUDGET)
    assert cache_length(runner.cache) == kept + window - 1  # what the next query sees besides itself
    result = autoregressive_run(LONG, target, 40, None, None, True, runner=runner)
    assert len(result.tokens) == 40 and cache_length(runner.cache) <= BUDGET


def test_snapkv_without_the_cache_or_with_a_bad_name_is_refused(target):
    with pytest.raises(ValueError, match="turn the cache on"):
        ModelRunner(target, use_cache=False)
    with pytest.raises(ValueError, match="unknown KV policy 'lru'; use one of streaming, h2o, snapkv"):
        use_kv_budget(tiny_decoder("llama", seed=0), BUDGET, policy="lru")
    with pytest.raises(ValueError, match="larger than the model's context"):
        use_kv_budget(tiny_decoder("llama", seed=0), 10_000, policy="snapkv")
