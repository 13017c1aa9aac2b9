"""Logits processors and n-gram storages."""

from types import SimpleNamespace

import pytest
import torch

from ngram_assisted import NGramStorage, OneLevelNGramStorage
from utils.logits_processor import (
    GreedyProcessor,
    MultinomialProcessor,
    NucleusProcessor,
    TopKNucleusProcessor,
    TopKProcessor,
)

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0]])


@pytest.mark.parametrize("processor", [GreedyProcessor(), MultinomialProcessor(0.7), TopKProcessor(1.0, 2),
                                       NucleusProcessor(1.0, 0.5), TopKNucleusProcessor(0.9, 3, 0.8)])
def test_processors_never_modify_the_callers_tensor(processor):
    logits = LOGITS.clone()
    probs = processor(logits)
    assert torch.equal(logits, LOGITS)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1))


def test_greedy_is_one_hot_argmax():
    probs = GreedyProcessor()(LOGITS)
    assert probs[0, 4] == 1 and probs.sum() == 1
    assert GreedyProcessor().sample(probs).tolist() == [4]


@pytest.mark.parametrize("shape", [(1, 151936), (4, 1000), (1, 3, 385), (2, 255), (1, 5), (300,)])
def test_first_argmax_is_argmax_with_ties_nans_and_infinities(shape):
    from torch.nn import functional as F

    from utils.logits_processor import ARGMAX_CHUNK, first_argmax

    g = torch.Generator().manual_seed(shape[-1])
    cases = [torch.randn(shape, generator=g), (torch.randn(shape, generator=g) * 2).round(),  # many ties
             torch.full(shape, float("-inf")), torch.zeros(shape)]
    last = torch.randn(shape, generator=g)
    last[..., -1] = 1e9  # in the tail past the last whole chunk, where the vocabulary has one
    nan = torch.randn(shape, generator=g)
    nan[..., shape[-1] // 2] = float("nan")
    nan[..., -1] = float("nan")
    tail_nan = torch.randn(shape, generator=g)
    tail_nan[..., -1] = float("nan")  # the only NaN, in the last chunk (or the tail)
    inf_nan = torch.full(shape, float("-inf"))
    inf_nan[..., -2] = float("nan")
    ties = torch.zeros(shape)
    ties[..., ARGMAX_CHUNK - 1 :: ARGMAX_CHUNK] = float("inf")  # the same maximum in several chunks
    low = [torch.randn(shape, generator=g).to(dtype) for dtype in (torch.float16, torch.bfloat16, torch.float64)]
    for x in cases + [last, nan, tail_nan, inf_nan, ties] + low:
        assert torch.equal(first_argmax(x), x.argmax(-1))
        assert torch.equal(GreedyProcessor()(x), F.one_hot(x.argmax(-1), shape[-1]).to(
            torch.float64 if x.dtype == torch.float64 else torch.float32))


def test_greedy_verification_by_sampling_is_the_rejection_test_for_one_hot_drafts():
    """The loop verifies greedy drafts with `accept_by_sampling`: the same packed result as rejection sampling."""
    from sampling.verification import accept_by_rejection, accept_by_sampling

    greedy, g, seen = GreedyProcessor(), torch.Generator().manual_seed(3), set()
    for trial in range(60):
        target = torch.randn(1, 4, 50, generator=g)
        drafter = target[:, :3].clone() if trial % 2 else torch.randn(1, 3, 50, generator=g)
        drafter[:, trial % 3] += torch.randn(50, generator=g) * (trial % 4)  # a rejection here and there
        p, q = greedy(target), greedy(drafter)
        drafts = greedy.sample(q)
        expected = accept_by_rejection(p, q, drafts, greedy)
        assert torch.equal(accept_by_sampling(p, drafts, greedy), expected)
        assert torch.equal(accept_by_rejection(p, q, drafts, greedy, adjust=False), expected)
        seen.add(int(expected[0]))
    assert seen == {0, 1, 2, 3}  # every number of kept drafts came up


def test_rejection_sampling_of_no_drafts_draws_from_p():
    # q of a drafter that drafted nothing, [1, 0, vocab], lost its padding row: RuntimeError from index_select
    from sampling.verification import accept_by_rejection

    p = torch.tensor([[[0.0, 1.0, 0.0]]])  # [1, 1, vocab]
    packed = accept_by_rejection(p, torch.zeros(1, 0, 3), torch.zeros(1, 0, dtype=torch.long), MultinomialProcessor(1.0))
    assert packed.tolist() == [0, 1]  # no draft kept, then the one token p allows


def test_top_k_and_top_p_supports():
    assert (TopKProcessor(1.0, 2)(LOGITS)[0] > 0).tolist() == [True, False, False, False, True]
    soft = torch.softmax(LOGITS[0], -1)  # sorted: 4 (.61), 0 (.22), 1 (.08), ...
    assert (NucleusProcessor(1.0, 0.5)(LOGITS)[0] > 0).tolist() == [False, False, False, False, True]
    assert (NucleusProcessor(1.0, float(soft[4]) + 0.01)(LOGITS)[0] > 0).tolist() == [True, False, False, False, True]
    assert (TopKNucleusProcessor(1.0, 3, 0.99)(LOGITS)[0] > 0).tolist() == [True, True, False, False, True]


def test_top_k_cuts_before_top_p():
    """top-p over the top-k's renormalised mass, as transformers' warpers run: p = .4 .3 .2 .1, k 3, P .75 keeps
    two tokens (.4 / .9 < .75 <= .7 / .9); top-p first, then top-k, keeps three."""
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    assert (TopKNucleusProcessor(1.0, 3, 0.75)(logits)[0] > 0).tolist() == [True, True, False, False]


@pytest.mark.parametrize("processor", [MultinomialProcessor(1.0), NucleusProcessor(1.0, 0.9), TopKProcessor(0.7, 50)])
def test_low_precision_logits_are_processed_in_float32(processor):
    """A bfloat16 model's logits: a 20k-token nucleus kept ~4% fewer tokens when computed in bfloat16."""
    logits = (torch.randn(1, 20000, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    probs = processor(logits)
    assert probs.dtype == torch.float32 and torch.equal(probs, processor(logits.float()))


def test_temperature_sharpens():
    cold, hot = MultinomialProcessor(0.5)(LOGITS), MultinomialProcessor(2.0)(LOGITS)
    assert cold[0, 4] > hot[0, 4]


@pytest.mark.parametrize("bad", [lambda: MultinomialProcessor(0), lambda: TopKProcessor(1.0, 0),
                                 lambda: NucleusProcessor(1.0, 0.0), lambda: NucleusProcessor(1.0, 1.5)])
def test_bad_parameters_raise(bad):
    with pytest.raises(ValueError):
        bad()


def test_ngram_storage_prefers_the_longest_known_context():
    storage = NGramStorage(4, 20)
    storage.initialize(torch.tensor([[1, 2, 3, 7, 9, 2, 3, 8, 2, 3, 8]]))
    # Context (2, 3) was followed by 7 once and 8 twice; (1, 2, 3) only by 7.
    assert storage.next_token(torch.tensor([[5, 2, 3]]))[0].tolist() == [8]
    tokens, known = storage.next_token(torch.tensor([[1, 2, 3]]))
    assert tokens.tolist() == [7] and known.tolist() == [True]
    assert storage.next_token(torch.tensor([[19]]))[1].tolist() == [False]
    assert storage.has_gram(torch.tensor([1, 2, 3, 7])) and not storage.has_gram(torch.tensor([1, 2, 3, 9]))
    storage.update(torch.tensor([[4, 5]]), torch.tensor([[6, 6]]))
    assert storage.next_token(torch.tensor([[4, 5]]))[0].tolist() == [6]
    storage.reset()
    assert storage.next_token(torch.tensor([[2, 3]]))[1].tolist() == [False]


def test_one_level_storage_uses_only_full_contexts():
    storage = OneLevelNGramStorage(3, 20)
    storage.initialize(torch.tensor([[1, 2, 3, 4, 2, 5]]))
    assert storage.next_token(torch.tensor([[1, 2]]))[0].tolist() == [3]
    assert storage.next_token(torch.tensor([[9, 2]]))[1].tolist() == [False]  # a 2-gram storage would know "2"


def test_draft_stops_at_unknown_context():
    storage = NGramStorage(3, 20)
    storage.add_sequence([1, 2, 3, 4])
    assert storage.draft([1, 2], 5) == [3, 4]
    assert storage.draft([1, 2], 1) == [3]
    assert storage.draft([9], 3) == []
    with pytest.raises(ValueError):
        NGramStorage(1, 20)


def test_adaptive_length_grows_and_shrinks_within_bounds():
    from sampling.draft_stop import AdaptiveLength

    length = AdaptiveLength()
    assert length.next(4) == 4
    length.update(4, 4)
    assert length.next(8) == 6  # +2 after full acceptance
    length.update(2, 6)
    assert length.next(8) == 5  # -1 after a rejection
    for _ in range(10):
        length.update(0, 1)
    assert length.next(8) == 1  # never below 1
    length.update(1, 1)
    assert length.next(2) == 2  # never above gamma


def test_length_schedules_keep_what_they_learned_through_an_answers_short_last_round():
    # the last round's budget (2 drafts) was written into the schedule: a rule kept for the next turn (the chat's)
    # started it from 2
    from sampling.draft_stop import AdaptiveLength
    from sampling.drafters import DoublingLength

    for length, learned in ((AdaptiveLength(), 6), (DoublingLength(start=3), 6)):
        while length.next(6) < 6:
            length.update(6, 6)  # every draft accepted
        assert length.next(2) == 2  # the answer's budget bounds its last round...
        length.update(2, 2)
        assert length.next(6) == learned  # ...not the length it learned
        length.update(0, 6)
        assert length.next(6) < learned  # a rejection still shortens it


def test_doubling_length_starts_short_and_doubles_until_a_rejection():
    from sampling.drafters import DoublingLength

    length = DoublingLength(start=3)
    assert length.next(8) == 3
    length.update(3, 3)
    assert length.next(8) == 6  # x2 after full acceptance
    length.update(6, 6)
    assert length.next(8) == 8  # never above gamma
    length.update(2, 8)
    assert length.next(8) == 3  # back to the start after a rejection
    length.update(0, 0)
    assert length.next(8) == 3  # a round without drafts changes nothing
    with pytest.raises(ValueError):
        DoublingLength(start=0)


def test_ngram_drafter_follows_its_policys_length_schedule():
    from ngram_assisted import NGramDraftPolicy, NGramDrafter

    storage = NGramStorage(3, 50)
    storage.add_sequence(list(range(1, 40)))  # every context continues by counting up
    drafter = NGramDrafter(storage, 39, filler_top_k=1, policy=NGramDraftPolicy(min_context=2, length="double"))
    seq = torch.tensor([[1, 2]])
    drafts, q = drafter.get_candidates(seq, 8)
    assert drafts.tolist() == [[3, 4, 5]] and q is None
    drafter.adaptive.update(3, 3)
    assert drafter.get_candidates(seq, 8)[0].shape[1] == 6
    fixed = NGramDrafter(storage, 39, filler_top_k=1, policy=NGramDraftPolicy(min_context=2, length="fixed"))
    assert fixed.get_candidates(seq, 8)[0].shape[1] == 8
    with pytest.raises(ValueError, match="length must be one of"):
        NGramDraftPolicy(length="sometimes")


def test_a_short_history_drafts_from_its_longest_context_as_it_grows():
    storage = NGramStorage(4, 20)
    storage.add_sequence([1, 2, 3])
    storage.add_sequence([2, 4])
    storage.add_sequence([2, 4])
    assert storage.draft([1], 2) == [2, 3]  # the second draft reads (1, 2) -> 3, not (2,) -> 4


def test_unknown_contexts_are_guessed_without_stop_if_unknown():
    """The reference implementation's mode (`ngram_assisted_speculative_generate`'s default): the last token again."""
    storage = NGramStorage(3, 20)
    storage.add_sequence([1, 2, 3])
    assert storage.draft([9], 3, stop_if_unknown=False) == [9, 9, 9]
    assert storage.draft([1, 2], 3, stop_if_unknown=False) == [3, 3, 3]


def test_the_drafter_learns_each_verified_token_with_its_longest_context_and_the_fillers_of_its_position():
    from ngram_assisted import NGramDrafter

    # a round of 3 drafts, the first kept: 2 new tokens (3, 4) after the 2-token prompt; logits [1, 4, V]
    logits = torch.zeros(1, 4, 50)
    logits[0, 0, 7] = logits[0, 1, 8] = logits[0, 2, 9] = logits[0, 3, 9] = 5.0
    logits[0, :, 20] = 4.0  # each position's second
    storage = NGramStorage(3, 50)
    NGramDrafter(storage, 2, filler_top_k=2).learn(torch.tensor([[1, 2, 3, 4]]), logits)
    assert set(storage.counts[2][(1, 2)]) == {3, 7, 20} and set(storage.counts[2][(2, 3)]) == {4, 8, 20}
    alone = NGramStorage(3, 50)  # no fillers (top-1, sampled tokens outside it): the verified tokens still
    NGramDrafter(alone, 2, filler_top_k=1).learn(torch.tensor([[1, 2, 3, 4]]), torch.zeros(1, 3, 50))
    assert alone.draft([1, 2], 2) == [3, 4]
    longest = NGramStorage(4, 50)
    NGramDrafter(longest, 3, filler_top_k=1).learn(torch.tensor([[1, 2, 3, 4]]), torch.zeros(1, 1, 50))
    assert longest.best[3] == {(1, 2, 3): 4}


def test_a_picky_prior_drafts_for_a_bigram_storage():
    """PICKY asks the prior for 2-token contexts; a bigram storage (`/set_ngramstorage basic 2`) holds 1-token ones,
    so the drafter asks for those instead of never drafting from the prior."""
    from ngram_assisted import PICKY, NGramDrafter

    prior = NGramStorage(3, 50)
    prior.add([7], [9])
    drafter = NGramDrafter(NGramStorage(2, 50), 1, filler_top_k=1, policy=PICKY, prior=prior)
    assert drafter.get_candidates(torch.tensor([[7]]), 2)[0].tolist()[0][:1] == [9]


def test_nasd_refuses_a_storage_smaller_than_the_targets_vocabulary(monkeypatch):
    """It learned the target's ids past its own and saved a file that it then refused to load as corrupt."""
    import ngram_assisted.ngram_assisted as nasd

    monkeypatch.setattr(nasd, "token_ids", lambda inputs, target: inputs)
    monkeypatch.setattr(nasd, "check_runner", lambda runner, model, role: runner)
    storage = NGramStorage(3, 16)
    with pytest.raises(ValueError, match="holds ids below 16, the target outputs 64"):
        nasd.nasd_run([1, 2], storage, None, runner=SimpleNamespace(vocab_size=64, limit=None, use_cache=False))
    assert storage.counts[2] == {}


def test_nasd_drafts_from_bigram_contexts_only_with_the_cache_off(monkeypatch):
    # a rejected draft widens a one-row pass with the cache on, but adds a row to a whole-sequence pass with it off
    import ngram_assisted.ngram_assisted as nasd
    from ngram_assisted import PICKY, WIDE, NGramDrafter, policy_for

    assert policy_for(True) is PICKY and policy_for(False) is WIDE
    storage = NGramStorage(3, 50)
    storage.add_sequence([7, 9, 5, 7, 11])  # 7 was followed by 9 and by 11; no two-token context ends in 7 alone
    seq = torch.tensor([[1, 7]])
    assert NGramDrafter(storage, 2, filler_top_k=1, policy=PICKY).get_candidates(seq, 4)[0].numel() == 0
    assert NGramDrafter(storage, 2, filler_top_k=1, policy=WIDE).get_candidates(seq, 4)[0].tolist()[0][0] in (9, 11)
    # a bigram storage holds one-token contexts only: under PICKY it drafts from those instead of never drafting
    bigrams = NGramStorage(2, 50)
    bigrams.add_sequence([7, 9, 5])
    assert NGramDrafter(bigrams, 3, filler_top_k=1, policy=PICKY).get_candidates(seq, 2)[0].tolist() == [[9, 5]]
    used = []  # the policy nasd_run hands the loop by default (no model runs: the loop is replaced)
    monkeypatch.setattr(nasd, "token_ids", lambda inputs, target: inputs)
    monkeypatch.setattr(nasd, "generate", lambda runner, drafter, *args: used.append(drafter.policy))
    monkeypatch.setattr(nasd, "check_runner", lambda runner, model, role: runner)
    for cache in (True, False):
        nasd.nasd_run([1, 2], NGramStorage(3, 50), None, use_cache=cache, runner=SimpleNamespace(vocab_size=50, limit=None,
                                                                                        use_cache=cache))
    assert used == [PICKY, WIDE]


def test_nucleus_filter_keeps_each_token_whose_more_probable_tokens_hold_less_than_top_p():
    from utils.logits_processor import top_p_filter

    torch.manual_seed(0)
    # nuclei from a few tokens to most of the vocabulary: every branch of the candidate search
    logits = torch.randn(4, 5000) * torch.tensor([[8.0], [3.0], [1.0], [0.2]])
    kept = ~torch.isinf(top_p_filter(logits, 0.9))
    p, order = torch.softmax(logits.double(), -1).sort(-1, descending=True)
    expected = torch.zeros_like(kept).scatter(-1, order, (p.cumsum(-1) - p) < 0.9)
    assert torch.equal(kept, expected)
    assert kept.sum(-1).tolist()[0] < 64 < kept.sum(-1).tolist()[1]
    for row in range(4):  # a row's result does not depend on the rows beside it
        assert torch.equal(top_p_filter(logits[row:row + 1], 0.9), top_p_filter(logits, 0.9)[row:row + 1])


def test_nucleus_of_a_p_float32_rounds_to_zero_keeps_the_most_probable_token():
    from utils.logits_processor import NucleusProcessor, top_p_filter

    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]])
    for p in (1e-50, 1e-320):  # > 0, so accepted, but 0 in float32: once nothing was kept and sampling failed
        kept = ~torch.isinf(top_p_filter(logits, p))
        assert kept.tolist() == [[False, True, False, False]]
        processor = NucleusProcessor(1.0, p)
        assert processor.sample(processor(logits)).item() == 1
