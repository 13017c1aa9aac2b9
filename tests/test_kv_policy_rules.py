"""The rules the KV policies (`snapkv`, `h2o`) are built from, checked against their definitions: the budget's
split, attention weights against SDPA's, what an observation sums, and that a prompt is read with full attention.
The end-to-end tests (test_cache_policies.py) check that every generator agrees, which a rule wrong for all of
them alike still passes."""

import torch
import torch.nn.functional as F

import test_cache_policies as cache_policies
from conftest import ids, tiny_decoder
from utils import h2o, snapkv
from utils.caching import kv_budget
from utils.model_runner import ModelRunner
from utils.models.rowwise_attention import describe_budget

BUDGET, LONG = cache_policies.BUDGET, cache_policies.LONG


def test_the_snapkv_split_and_its_description():
    assert snapkv.split_budget(16) == (12, 4) and snapkv.split_budget(24) == (18, 6)
    assert snapkv.split_budget(8) == (6, 2) and snapkv.split_budget(9) == (7, 2)  # a window of at least 2
    model = cache_policies.budgeted(0, "snapkv")
    assert kv_budget(model) == (12, 4)
    assert describe_budget(model) == "the 12 most attended prompt positions + the 4 most recent"


def test_the_h2o_split_of_an_odd_budget():
    """An odd budget less the sinks does not halve: the recent window gets the smaller half."""
    assert h2o.split_budget(17, 4) == (6, 7) and h2o.split_budget(9, 4) == (2, 3)
    cache = h2o.H2OCache(sinks=4, window=13)
    assert cache.budget == 17 and cache.recent == 6
    model = cache_policies.budgeted(0, "h2o", budget=17)
    assert describe_budget(model) == "4 sinks + the 7 most attended so far (H2O) + the 6 most recent"


def test_row_weights_and_values_equal_sdpa_with_shared_kv_heads():
    """4 query heads over 2 kv heads: heads 0, 1 read kv head 0 and heads 2, 3 kv head 1 (transformers' grouping)."""
    torch.manual_seed(0)
    query, key, value = torch.randn(4, 8), torch.randn(2, 10, 8), torch.randn(2, 10, 8)
    for scaling in (None, 0.3):
        weights = snapkv.row_weights(query, key, scaling)
        assert weights.shape == (2, 2, 10)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2))
        out = snapkv.weighted_values(weights, value)  # [heads, dim]
        expected = F.scaled_dot_product_attention(query[None, :, None], key[None], value[None], scale=scaling,
                                                  enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out, expected)


def test_an_observation_sums_the_head_averaged_weights_of_its_queries_only():
    torch.manual_seed(0)
    query, key = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    observation = snapkv.Observation(2, 5)  # the queries at slots 2, 3 and 4
    expected = torch.zeros(2, 6)
    for slot in range(6):
        keys = key[:, :, : slot + 1]
        weights = observation.record(0, slot, query[:, :, slot : slot + 1], keys, None)
        assert (weights is None) == (slot not in (2, 3, 4))
        if weights is not None:
            expected[:, : slot + 1] += snapkv.row_weights(query[0, :, slot], keys[0], None).mean(1)
    torch.testing.assert_close(observation.scores(0, 6), expected)  # slot 5 was never seen by an observed query
    assert observation.scores(0, 6)[:, 5].eq(0).all() and observation.scores(0, 3).shape == (2, 3)
    torch.testing.assert_close(observation.scores(0, 5), expected[:, :5])  # up to the last observed key


def test_a_prompt_is_read_with_full_attention():
    """Both policies read the prompt with full attention (and keep positions only after it): the prompt pass's
    logits are those of the model without a budget."""
    full = ModelRunner(tiny_decoder("llama", seed=0, init=0.3), use_cache=True).logits(ids([LONG]), 1)
    for policy in ("snapkv", "h2o"):
        budgeted = ModelRunner(cache_policies.budgeted(0, policy), use_cache=True)
        torch.testing.assert_close(budgeted.logits(ids([LONG]), 1), full, rtol=1e-5, atol=1e-5)


def test_snapkv_chooses_among_the_candidates_only():
    """The next query's recent window (`protect`) stays whatever its scores: the kept positions are chosen among
    the entries before it, so none is held twice."""
    from utils.caching import BoundedCache

    cache = BoundedCache(sinks=3, window=4)
    keys = torch.arange(10.0).view(1, 1, 10, 1).expand(1, 2, 10, 1).contiguous()
    cache.update(keys, keys.clone(), 0)
    observation = snapkv.Observation(0, 10)
    observation.sums[0] = torch.zeros(2, 10)
    observation.sums[0][:, 8] = 5.0  # the most attended is in the protected window
    observation.sums[0][:, 1] = 1.0
    cache.compress(observation, protect=3)
    held = cache.layers[0].keys[0, :, :, 0]  # [kv_heads, slots]: the positions held
    assert held.shape == (2, 6) and held[:, 3:].tolist() == [[7.0, 8.0, 9.0]] * 2
    assert all(len(set(row)) == 6 and max(row[:3]) < 7 for row in held.tolist())


def test_h2o_observes_every_prompt_query_and_snapkv_its_last_ones(monkeypatch):
    """H2O's prefill scores the prompt with all its queries, SnapKV with its last OBSERVATION ones: with a prompt
    longer than OBSERVATION plus the sinks, the runner observes [0, 48) and [16, 48) (the first queries of so long a
    prompt reach past the sinks, so leaving them out would change what H2O keeps)."""
    windows = []
    observing = snapkv.observing

    def recorded(first, last):
        windows.append((first, last))
        return observing(first, last)

    monkeypatch.setattr(snapkv, "observing", recorded)
    prompt = cache_policies.PROMPT * 4  # 48 positions
    for policy in ("h2o", "snapkv"):
        ModelRunner(cache_policies.budgeted(0, policy), use_cache=True).logits(ids([prompt]), 1)
    assert windows == [(0, 48), (48 - snapkv.OBSERVATION, 48)]


def test_the_rowwise_attention_records_each_query_at_its_own_slot():
    """In a prompt pass the row-wise attention hands the observation each query at its slot (the position of its
    own key): an observation of slots [2, 5) sums the weights of those three queries exactly, and every row's
    output is causal attention's, observed or not."""
    from types import SimpleNamespace

    from utils.models.rowwise_attention import rowwise_attention

    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    module = SimpleNamespace(config=SimpleNamespace(), layer_idx=0)
    with snapkv.observing(2, 5) as observation:
        out, _ = rowwise_attention(module, query, key, value, None)
    expected = torch.zeros(2, 6)
    for slot in (2, 3, 4):
        expected[:, : slot + 1] += snapkv.row_weights(query[0, :, slot], key[0, :, : slot + 1], None).mean(1)
    torch.testing.assert_close(observation.scores(0, 6), expected)
    causal = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, causal.transpose(1, 2))
