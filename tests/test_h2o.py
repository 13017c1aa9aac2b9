"""`--kv-policy h2o`: each layer and kv head keeps the sinks, a recent window and the positions with the largest
accumulated attention; each query row follows H2O's greedy rule in order, so SD and NASD still equal AR under the
same policy and budget (with snapkv's: test_cache_policies.py), and a rollback restores the state before the
rejected rows exactly."""

import pytest
import torch

import test_cache_policies as cache_policies
from conftest import ids, tiny_decoder
from sampling import LoopSettings, autoregressive_generate, autoregressive_run, speculative_run
from utils import h2o
from utils.caching import cache_length, prune_cache
from utils.logits_processor import MultinomialProcessor
from utils.model_runner import ModelRunner
from utils.snapkv import Observation, weighted_values
from utils.models.rowwise_attention import describe_budget, use_kv_budget

BUDGET, LONG = cache_policies.BUDGET, cache_policies.LONG  # 4 sinks, 6 heavy hitters, a window of 6


def budgeted(seed: int, policy: str = "h2o"):
    return cache_policies.budgeted(seed, policy)


@pytest.fixture(scope="module")
def target():
    return budgeted(0)


@pytest.fixture(scope="module")
def reference(target):
    return autoregressive_generate(LONG, target, max_gen_len=30, eos_tokens_id=None, use_cache=True)


def test_the_split_and_its_description(target):
    assert h2o.split_budget(BUDGET, 4) == (6, 6) and h2o.split_budget(8, 4) == (2, 2)
    assert describe_budget(target) == "4 sinks + the 6 most attended so far (H2O) + the 6 most recent"


def test_evict_one_drops_each_heads_lowest_scored_candidate():
    visible = torch.tensor([[0, 1, 5, 7, 8, 9], [0, 1, 2, 6, 8, 9]])  # ascending slots, 2 sinks, 2 recent
    scores = torch.zeros(2, 10)
    scores[0, [5, 7]] = torch.tensor([0.3, 0.1])
    scores[1, [2, 6]] = torch.tensor([0.2, 0.4])
    scores[:, [0, 9]] = -1.0  # sinks and recent ones are never candidates, however low
    kept = h2o.evict_one(visible, scores, sinks=2, recent=2)
    assert kept.tolist() == [[0, 1, 5, 8, 9], [0, 1, 6, 8, 9]]


def test_a_position_every_query_attends_to_survives_and_each_row_attends_to_what_is_held():
    """A hand-made layer of one head: every query is all ones and position 5's key is large, so every query
    attends to it; H2O keeps it long after it left the recent window (streaming would not)."""
    torch.manual_seed(0)
    cache = h2o.H2OCache(sinks=2, window=6)  # budget 8: 2 sinks, 3 heavy hitters, a recent window of 3
    dim, length = 4, 14
    keys = torch.randn(1, 1, length, dim) * 0.1
    keys[0, 0, 5] = 5.0
    values = torch.randn(1, 1, length, dim)
    query = torch.ones(1, 1, length, dim)
    key, _ = cache.update(keys[:, :, :8], values[:, :, :8], 0)
    observation = Observation(0, 8)
    for i in range(8):
        observation.record(0, i, query[:, :, i : i + 1], key[:, :, : i + 1], None)
    best = observation.scores(0, 8)[0, 2:5].topk(2).indices.add(2).sort().values.tolist()
    cache.compress(observation)
    assert held_positions(cache, keys) == [0, 1, *best, 5, 6, 7]  # sinks, the 2 best of the rest, the window
    for position in range(8, length):  # one row at a time, as decoding runs
        seen = held_positions(cache, keys) + [position]
        k, v = cache.update(keys[:, :, position : position + 1], values[:, :, position : position + 1], 0)
        out = h2o.attend(cache, 0, query[:, :, position : position + 1], k, v, None)  # [1, 1, 1, dim]
        expected = (query[0, 0, position] @ keys[0, 0, seen].T * dim**-0.5).softmax(-1) @ values[0, 0, seen]
        torch.testing.assert_close(out[0, 0, 0], expected)
        cache.settle()
        held = held_positions(cache, keys)
        assert len(held) == 7 and held[-3:] == list(range(position - 2, position + 1))
    assert 5 in held  # left the window six rows ago: the heaviest hitter


def held_positions(cache, keys) -> list[int]:
    """The positions whose keys a one-head layer holds, in slot order."""
    layer = cache.layers[0].keys[0, 0]
    return [next(p for p in range(keys.shape[2]) if torch.equal(row, keys[0, 0, p])) for row in layer]


def test_h2o_keeps_other_positions_than_streaming_and_snapkv(reference):
    full = autoregressive_generate(LONG, tiny_decoder("llama", seed=0, init=0.3), max_gen_len=30, eos_tokens_id=None)
    streaming = autoregressive_generate(LONG, budgeted(0, "streaming"), max_gen_len=30, eos_tokens_id=None)
    snapkv = autoregressive_generate(LONG, budgeted(0, "snapkv"), max_gen_len=30, eos_tokens_id=None, use_cache=True)
    assert len({tuple(reference), tuple(full), tuple(streaming), tuple(snapkv)}) == 4  # the policy decides


def test_the_cache_holds_the_budget_less_the_next_query(target):
    runner = ModelRunner(target, use_cache=True)
    runner.logits(ids([LONG]), 1)
    assert cache_length(runner.cache) == BUDGET - 1
    result = autoregressive_run(LONG, target, 40, None, None, True, runner=runner)
    assert len(result.tokens) == 40 and cache_length(runner.cache) <= BUDGET + h2o.SETTLE_EVERY
    runner.cache.settle()
    assert cache_length(runner.cache) == BUDGET - 1


def test_a_rollback_restores_the_state_before_the_rejected_rows(target, reference):
    """Rows fed one by one under a reserve (a drafter's round: its last 5 rows stay revocable while older ones
    settle), three rolled back, two others fed: the logits and, once settled, the cache equal a runner that
    never saw the rejected rows."""
    drafted, other = [7, 8, 9, 10, 11], [12, 13]
    accepted = LONG + reference[:25]
    rolled = ModelRunner(target, use_cache=True)
    rolled.rollback_reserve = len(drafted)
    for i in range(25 + len(drafted) + 1):  # the prompt pass, then one row each
        rolled.logits(ids([(accepted + drafted)[: len(LONG) + i]]), 1)
    assert 3 <= len(rolled.cache.layers[0].rows) < 25 + len(drafted)  # some rows settled, the latest revocable
    straight = ModelRunner(target, use_cache=True)
    for i in range(25 + 3):
        straight.logits(ids([(accepted + drafted)[: len(LONG) + i]]), 1)
    seq = ids([accepted + drafted[:2] + other])
    assert torch.equal(rolled.logits(seq, len(other)), straight.logits(seq, len(other)))
    for runner in (rolled, straight):
        runner.cache.settle()
    for a, b in zip(rolled.cache.layers, straight.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.scores, b.scores)


def test_a_rollback_into_final_evictions_is_refused_and_a_runner_reads_again(target, reference):
    runner = ModelRunner(target, use_cache=True)
    for i in range(4):
        runner.logits(ids([LONG + reference[:i]]), 1)
    runner.cache.settle()
    with pytest.raises(ValueError, match="cannot remove 2 positions"):
        prune_cache(runner.cache, 2)  # refused before anything is cut
    seq = ids([LONG + reference[:2]])
    again = runner.logits(seq, 1)  # a drafter's long rollback: the sequence is read again as a prompt
    assert torch.equal(again, ModelRunner(target, use_cache=True).logits(seq, 1))
    assert cache_length(runner.cache) == BUDGET - 1


class RecordingRunner(ModelRunner):
    """Records every pass's logits by the prefix each row conditions on."""

    def __init__(self, model):
        super().__init__(model, use_cache=True)
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, seq, k):
        out = super().logits(seq, k)
        ids = seq[0].tolist()
        for r in range(k):
            self.rows[tuple(ids[: len(ids) - k + 1 + r])] = out[0, r]
        return out


@pytest.fixture(scope="module")
def native():
    """A tiny GGUF pair on our kernels (batch invariant: a row's bits do not depend on its pass's width)."""
    from test_drafter_window import native_pair

    target, drafter = native_pair()
    for model in (target, drafter):
        use_kv_budget(model, BUDGET, policy="h2o")
    return target, drafter


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_sd_reads_the_logits_of_the_targets_own_decoding(native, seed):
    """Sampling keeps the target's distribution under H2O if every row the acceptance rule reads is bit for bit
    the row the target's own decoding gives (prompt pass, then one row at a time): checked for every prefix of
    the output, after accepted runs (the target as its own drafter) and rejections (another drafter), in the
    native mode, whose rows are batch invariant (transformers' float path differs in the last bits)."""
    target, other = native
    for drafter in (target, other):
        runner = RecordingRunner(target)
        torch.manual_seed(seed)
        settings = LoopSettings(max_gen_len=30, gamma=4, eos_tokens_id=None)
        result = speculative_run(LONG, drafter, target, MultinomialProcessor(1.0), settings, use_cache=True,
                                 runners=(runner, ModelRunner(drafter, use_cache=True)))
        alone = ModelRunner(target, use_cache=True)
        for n in range(len(result.tokens)):
            prefix = tuple(LONG + result.tokens[:n])
            assert torch.equal(runner.rows[prefix], alone.logits(torch.tensor([prefix]), 1)[0, 0])


@torch.no_grad()
def test_a_rollback_of_every_row_since_the_last_settle_is_exact(target, reference):
    """Three rows fed after the prompt pass (none settled), all three rolled back: the rollback is within what H2O
    can still undo (`can_remove`, `H2OLayer.crop` at their boundary), and the next row reads as in a runner that
    never saw them."""
    rolled, straight = ModelRunner(target, use_cache=True), ModelRunner(target, use_cache=True)
    for i in range(4):  # the prompt pass, then three rows
        rolled.logits(ids([LONG + reference[:i]]), 1)
    assert len(rolled.cache.layers[0].rows) == 3
    straight.logits(ids([LONG]), 1)
    seq = ids([LONG + [(reference[0] + 1) % 50 + 5]])
    assert torch.equal(rolled.logits(seq, 1), straight.logits(seq, 1))
    for a, b in zip(rolled.cache.layers, straight.cache.layers):
        assert torch.equal(a.keys, b.keys) and len(a.rows) == len(b.rows) == 1


def test_a_layers_crop_reads_its_argument_as_transformers_does(target, reference):
    """`H2OLayer.crop(max_length)` keeps that many slots, or removes as many for a negative one (DynamicLayer's
    contract, which `Cache.crop` passes on), and refuses to reach slots whose evictions are final."""
    runners = [ModelRunner(target, use_cache=True) for _ in range(2)]
    for runner in runners:
        for i in range(4):  # the prompt pass, then three rows, none settled
            runner.logits(ids([LONG + reference[:i]]), 1)
    by_length, by_count = (runner.cache.layers[0] for runner in runners)
    held = by_length.get_seq_length()
    by_length.crop(held)  # keeps every slot
    assert by_length.get_seq_length() == held and len(by_length.rows) == 3
    by_length.crop(held - 2)
    by_count.crop(-2)
    assert by_length.get_seq_length() == by_count.get_seq_length() == held - 2
    assert torch.equal(by_length.keys, by_count.keys) and len(by_length.rows) == len(by_count.rows) == 1
    with pytest.raises(ValueError, match="cannot remove 2 positions"):
        by_length.crop(held - 4)


def reference_h2o(query, key, value, prompt: int, sinks: int, budget: int):
    """H2O written out per kv head from its definition, one query at a time: `query` [heads, L, dim], `key`/`value`
    [kv_heads, L, dim] -> (outputs [L, heads, dim], the positions each head keeps after the last query, their
    scores). The prompt's queries attend to everything before them and score it; the prompt is then cut to the
    sinks, the best-scored and the recent window (budget less one); each later query sees what is kept and
    itself, adds its weights, and once it sees the budget, drops its lowest-scored position between the sinks and
    the recent window (the first on a tie)."""
    kv_heads, length, dim = key.shape
    group = query.shape[0] // kv_heads
    recent = h2o.split_budget(budget, sinks)[0]
    outputs = torch.zeros(length, query.shape[0], dim)
    kept, scores = [], []
    for h in range(kv_heads):
        q = query[h * group : (h + 1) * group]  # [group, L, dim]
        score = torch.zeros(length)
        seen = []
        for t in range(length):
            seen = list(range(t + 1)) if t < prompt else seen + [t]
            weights = (q[:, t] @ key[h, seen].T * dim**-0.5).float().softmax(-1)  # [group, n]
            outputs[t, h * group : (h + 1) * group] = weights @ value[h, seen]
            score[seen] += weights.mean(0)
            if t == prompt - 1 and prompt > budget - 1:
                heavy = budget - 1 - sinks - recent
                middle = score[sinks : prompt - recent].topk(heavy).indices.add(sinks).sort().values.tolist()
                seen = [*range(sinks), *middle, *range(prompt - recent, prompt)]
            elif t >= prompt and len(seen) >= budget:
                candidates = seen[sinks : len(seen) - recent]
                drop = min(candidates, key=lambda p: (score[p].item(), p))
                seen = [p for p in seen if p != drop]
        kept.append(seen)
        scores.append(score[seen])
    return outputs, kept, scores


@pytest.mark.parametrize("prompt", [5, 9, 14])
def test_h2o_cache_follows_the_rule_written_out_head_by_head(prompt):
    """A hand-made layer of 4 query heads over 2 kv heads (budget 9: 2 sinks, a recent window of 3), random queries:
    the prompt observed and compressed as a runner does, then passes of several rows, settles under a reserve
    and a rollback of rows re-fed after it. Every row's output, what each head keeps and its scores equal
    `reference_h2o` (prompts shorter than, equal to and longer than the budget)."""
    torch.manual_seed(prompt)
    sinks, budget, dim, length = 2, 9, 8, 70
    query, key, value = torch.randn(4, length, dim) + 0.5, torch.randn(2, length, dim), torch.randn(2, length, dim)
    key[:, prompt - 3] = 2.0  # the most attended is the recent window's first position: a compression keeps it once
    expected, kept, scores = reference_h2o(query, key, value, prompt, sinks, budget)
    cache = h2o.H2OCache(sinks=sinks, window=budget - sinks)
    k, v = cache.update(key[None, :, :prompt], value[None, :, :prompt], 0)
    observation = Observation(0, prompt)
    for i in range(prompt):  # what the row-wise attention does in a prompt pass
        weights = observation.record(0, i, query[None, :, i : i + 1], k[:, :, : i + 1], None)
        torch.testing.assert_close(weighted_values(weights, v[0, :, : i + 1]), expected[i])
    cache.compress(observation)
    position, widths, reserves, n = prompt, [1, 3, 2, 1, 4, 1, 1, 5, 2, 3, 1, 2], [0, 3, 1, 0, 2], 0
    while position < 40:
        width = min(widths[n % len(widths)], length - position)
        k, v = cache.update(key[None, :, position : position + width], value[None, :, position : position + width], 0)
        out = h2o.attend(cache, 0, query[None, :, position : position + width], k, v, None)  # [1, width, heads, dim]
        torch.testing.assert_close(out[0], expected[position : position + width])
        position += width
        if width > 1 and n % 2:  # a rollback of the pass's last rows: they are fed again in the next pass
            prune_cache(cache, width - 1)
            position -= width - 1
        if n % 3 == 2:
            cache.settle(reserves[n % len(reserves)])
        else:
            cache.evict(reserves[n % len(reserves)])
        n += 1
    fed = 0
    while position < length:  # rows one at a time under a drafter's reserve of 3: evictions settle 16 rows at once
        k, v = cache.update(key[None, :, position : position + 1], value[None, :, position : position + 1], 0)
        out = h2o.attend(cache, 0, query[None, :, position : position + 1], k, v, None)
        torch.testing.assert_close(out[0], expected[position : position + 1])
        position, fed = position + 1, fed + 1
        if fed % 7 == 0 and len(cache.layers[0].rows) >= 2:  # a rollback within the reserve, the rows fed again
            prune_cache(cache, 2)
            position -= 2
        if cache.evict(3):  # 16 rows settled, the reserve's 3 kept: a drafter's whole round may still be rejected
            prune_cache(cache, 3)
            position -= 3
    assert 3 <= len(cache.layers[0].rows) < h2o.SETTLE_EVERY + 3
    layer = cache.layers[0]
    layer.crop(layer.get_seq_length())  # keeps every slot
    assert len(layer.rows) >= 3
    cache.settle()
    assert layer.keys.shape[2] == budget - 1
    for h in range(2):
        assert torch.equal(layer.keys[0, h], key[h, kept[h]]) and torch.equal(layer.values[0, h], value[h, kept[h]])
        torch.testing.assert_close(layer.scores[h], scores[h])
