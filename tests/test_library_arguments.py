"""The library as a user calls it: its defaults, and arguments that are wrong in a way the earlier checks let
through (each case's comment says what it did before). A wrong argument is a ValueError naming it."""

import numpy as np
import pytest
import torch
from conftest import CONTEXT, PROMPT, tiny_decoder, tiny_encoder_decoder

from ngram_assisted import NGramDraftPolicy, NGramStorage, nasd_run, ngram_assisted_speculative_generate
from sampling import (MODEL_EOS, LoopSettings, autoregressive_generate, autoregressive_generate_encoder_decoder,
                      autoregressive_run, beam_search_generate, speculative_generate, speculative_run)
from ngram_assisted import ngram_assisted as nasd_module
from sampling import speculative
from sampling.draft_stop import make_draft_stop
from sampling.loop import generate
from utils.caching import prune_cache
from utils.logits_processor import GreedyProcessor, NucleusProcessor, TopKNucleusProcessor, TopKProcessor
from utils.model_runner import ModelRunner


@pytest.fixture(scope="module")
def pair():
    return tiny_decoder("llama", seed=0), tiny_decoder("llama", seed=1)


def test_the_end_tokens_default_to_the_models_own(pair):
    # the default was id 1 for every model: T5's end token, but '"' in Qwen's vocabulary, which cut answers short
    target, drafter = pair
    free = autoregressive_generate(PROMPT, target, max_gen_len=30, eos_tokens_id=None)
    end = free[len(free) // 2]  # a token the answer writes, made the model's end token
    cut = free[: free.index(end) + 1]
    before = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = [end]
    try:
        assert autoregressive_generate(PROMPT, target, max_gen_len=30) == cut
        assert speculative_generate(PROMPT, drafter, target, gamma=3, max_gen_len=30)[0] == cut  # the target's
        assert ngram_assisted_speculative_generate(PROMPT, NGramStorage(3, 64), target, max_gen_len=30)[0] == cut
        assert beam_search_generate(PROMPT, target, max_gen_len=30, num_beams=1, top_k=1)[-1:] == [end]
        assert autoregressive_generate(PROMPT, target, max_gen_len=30, eos_tokens_id=MODEL_EOS) == cut
        assert autoregressive_generate(PROMPT, target, max_gen_len=30, eos_tokens_id=None) == free
    finally:
        target.generation_config.eos_token_id = before
    assert LoopSettings().eos_tokens_id == MODEL_EOS


def test_end_tokens_as_a_numpy_array_and_a_bad_one_named_as_given(pair):
    target, _ = pair
    free = autoregressive_generate(PROMPT, target, max_gen_len=20, eos_tokens_id=None)
    # a numpy array was refused, though prompts take them
    assert autoregressive_generate(PROMPT, target, max_gen_len=20, eos_tokens_id=np.array([free[3]])) == free[:4]
    with pytest.raises(ValueError, match=r"eos_tokens_id must be .* got 5\.0$"):  # was shown as [5.0]
        LoopSettings(eos_tokens_id=5.0)


def test_the_encoder_decoder_entries_refuse_a_decoder_only_model(pair):
    # the prompt was never read: every prompt gave the same answer, from the start token alone
    target, drafter = pair
    with pytest.raises(ValueError, match="LlamaForCausalLM is no encoder-decoder model"):
        autoregressive_generate_encoder_decoder([3, 17, 42], target, max_gen_len=5)
    with pytest.raises(ValueError, match="is no encoder-decoder model"):
        speculative_generate(PROMPT, drafter, target, encoder_decoder=True, max_gen_len=5)
    t5 = tiny_encoder_decoder("t5")
    with pytest.raises(ValueError, match="is no encoder-decoder model"):  # a decoder-only drafter for a T5
        speculative_generate([3, 17, 42], drafter, t5, encoder_decoder=True, max_gen_len=5)
    assert len(autoregressive_generate_encoder_decoder([3, 17, 42], t5, max_gen_len=5, eos_tokens_id=None)) == 5


def test_the_encoder_decoder_ar_samples_through_its_processor():
    """A processor that allows one token only: every new token is that one, so the processor given is the one used
    (a greedy default in its place would decode the model's own choices)."""
    from utils.logits_processor import LogitsProcessor

    class OnlyFive(LogitsProcessor):
        def _filter(self, logits):
            keep = torch.full_like(logits, float("-inf"))
            keep[..., 5] = 0.0
            return keep

    t5 = tiny_encoder_decoder("t5")
    greedy = autoregressive_generate_encoder_decoder([3, 17, 42], t5, max_gen_len=6, eos_tokens_id=None)
    assert greedy != [5] * 6  # the model's own choices differ, so the check below can fail
    assert autoregressive_generate_encoder_decoder([3, 17, 42], t5, max_gen_len=6, logits_processor=OnlyFive(),
                                                   eos_tokens_id=None) == [5] * 6


def test_the_encoder_decoder_ar_checks_its_processor_and_refuses_a_kept_runner():
    """The encoder-decoder AR is `autoregressive_run` with the encoder's inputs (it was a copy of its set-up)."""
    from sampling import autoregressive_run
    from utils.model_runner import ModelRunner

    t5 = tiny_encoder_decoder("t5")
    with pytest.raises(ValueError, match="logits_processor must be a LogitsProcessor instance"):
        autoregressive_generate_encoder_decoder([3, 17, 42], t5, max_gen_len=5, logits_processor="greedy")
    with pytest.raises(ValueError, match="a runner is kept for decoder-only models"):
        autoregressive_run([3, 17, 42], t5, 5, runner=ModelRunner(t5, encoder_input_ids=[3, 17, 42]),
                           encoder_decoder=True)


def test_a_model_in_training_mode_is_refused(pair):
    # dropout on: cache on and off, SD and AR, and two runs all disagreed, silently
    target, drafter = pair
    target.train()
    try:
        for call in (lambda: autoregressive_generate(PROMPT, target, max_gen_len=3),
                     lambda: speculative_generate(PROMPT, drafter, target, max_gen_len=3),
                     lambda: beam_search_generate(PROMPT, target, max_gen_len=3)):
            with pytest.raises(ValueError, match=r"LlamaForCausalLM is in training mode .* call model\.eval\(\)"):
                call()
    finally:
        target.eval()


def test_a_runner_of_another_model_is_refused(pair):
    # the runner's model answered in place of the one passed: SD returned the drafter's own tokens
    target, drafter = pair
    with pytest.raises(ValueError, match="the target's runner runs another model"):
        speculative_run(PROMPT, drafter, target, runners=(ModelRunner(drafter), ModelRunner(target)))
    with pytest.raises(ValueError, match="the model's runner runs another model"):
        autoregressive_run(PROMPT, target, runner=ModelRunner(drafter))
    with pytest.raises(ValueError, match="runners must be a pair"):
        speculative_run(PROMPT, drafter, target, runners=ModelRunner(target))
    kept = ModelRunner(target, use_cache=True)
    assert autoregressive_run(PROMPT, target, 8, runner=kept).tokens == autoregressive_generate(PROMPT, target, 8)


def test_a_drafters_runner_of_another_window_is_refused(pair):
    # a kept drafter's runner reads the window it was built with: a run asking for another would silently draft
    # from another view of the context than the one asked for
    target, drafter = pair
    runners = (ModelRunner(target, use_cache=True), ModelRunner(drafter, use_cache=True, window=16))
    with pytest.raises(ValueError, match="the drafter's runner was built with another window"):
        speculative_run(PROMPT, drafter, target, settings=LoopSettings(6, 3), runners=runners, drafter_window=32)
    assert len(speculative_run(PROMPT, drafter, target, settings=LoopSettings(6, 3), runners=runners,
                               drafter_window=16).tokens) == 6


def test_nasd_never_feeds_the_target_a_draft_outside_its_vocabulary(pair):
    # a storage filled by hand with ids past the target's vocabulary: IndexError in the embedding
    target, _ = pair
    storage = NGramStorage(3, 1000)
    for _ in range(3):
        storage.add_sequence([5, 6, 500, 501])
    for cache in (False, True):
        assert ngram_assisted_speculative_generate(PROMPT, storage, target, max_gen_len=12, use_cache=cache,
                                                   first_target=False)[0] == autoregressive_generate(PROMPT, target, 12)


def test_auto_follows_the_cache_of_the_runners_given(pair, monkeypatch):
    # it followed `use_cache` (False by default): cache-on runners drafted under the cache-off threshold
    target, drafter = pair
    made = []
    real = speculative.make_draft_stop
    monkeypatch.setattr(speculative, "make_draft_stop", lambda *a: made.append(a[2]) or real(*a))
    runners = (ModelRunner(target, use_cache=True), ModelRunner(drafter, use_cache=True))
    speculative_run(PROMPT, drafter, target, settings=LoopSettings(6, 3), draft_stop="auto", runners=runners)
    speculative_run(PROMPT, drafter, target, settings=LoopSettings(6, 3), draft_stop="auto")
    assert made == [True, False]


def test_a_drafter_that_proposes_more_than_asked_is_refused(pair):
    # its extra drafts were kept: an answer of 5 tokens where 3 were asked
    target, _ = pair
    reference = autoregressive_generate(PROMPT, target, 12, eos_tokens_id=None)

    class Eager:  # right every time, but three drafts past what the loop asks
        calls = 0

        def get_candidates(self, seq, gamma):
            done = seq.shape[1] - len(PROMPT)
            return torch.tensor([reference[done:done + gamma + 3]]), None

        def update_candidate_strategy(self, seq, n, g, logits):
            pass

    settings = LoopSettings(3, 1, None, first_target=False)
    with pytest.raises(ValueError, match="the drafter proposed 4 drafts where at most 1 were asked"):
        generate(ModelRunner(target), Eager(), list(PROMPT), GreedyProcessor(), settings)


def test_nasd_drafts_by_the_policy_of_the_runners_cache(pair, monkeypatch):
    # it followed `use_cache` (False by default): a cache-on runner drafted under the cache-off policy
    target, _ = pair
    asked = []
    real = nasd_module.policy_for
    monkeypatch.setattr(nasd_module, "policy_for", lambda use_cache: asked.append(use_cache) or real(use_cache))
    nasd_run(PROMPT, NGramStorage(3, 64), target, settings=LoopSettings(6, 3), runner=ModelRunner(target, use_cache=True))
    nasd_run(PROMPT, NGramStorage(3, 64), target, settings=LoopSettings(6, 3))
    assert asked == [True, False]


def test_the_storage_methods_of_the_reference_implementation_take_lists_and_tensors():
    storage = NGramStorage(3, 64)
    storage.update([[5, 6], [7, 8]], [9, 10])  # one follower a row
    assert storage.has_gram([5, 6, 9]) and storage.has_gram(torch.tensor([7, 8, 10]))  # a list: AttributeError
    assert not storage.has_gram([5, 6, 10])


def test_a_draft_stop_rule_by_name(pair):
    # "adaptive", as the command line spells it: AttributeError once drafting began
    target, drafter = pair
    expected = autoregressive_generate(PROMPT, target, 16)
    assert speculative_run(PROMPT, drafter, target, settings=LoopSettings(16, 3), draft_stop="adaptive").tokens == expected
    with pytest.raises(ValueError, match="draft_stop must be a DraftStopConfig"):
        speculative_run(PROMPT, drafter, target, draft_stop=0.5)
    # make_draft_stop took no name (AttributeError: 'str' object has no attribute 'rule')
    rule = make_draft_stop("adaptive", drafter)
    assert speculative_run(PROMPT, drafter, target, settings=LoopSettings(16, 3), draft_stop=rule).tokens == expected
    with pytest.raises(ValueError, match="the rule must be a DraftStopConfig or a rule's name, got 0.5"):
        make_draft_stop(0.5, drafter)


@pytest.mark.parametrize("make, message", [
    # each raised TypeError, OverflowError or a bare int() message, or was silently rounded
    (lambda: TopKProcessor(1, float("inf")), "top_k must be an integer >= 1, got inf"),
    (lambda: TopKProcessor(1, None), "top_k must be an integer >= 1, got None"),
    (lambda: TopKProcessor(1, 2.7), "top_k must be an integer >= 1, got 2.7"),
    (lambda: TopKProcessor(1, "5"), "top_k must be an integer >= 1, got '5'"),
    (lambda: NucleusProcessor(1, None), r"top_p must be a number in \(0, 1\], got None"),
    (lambda: NucleusProcessor(1, "0.5"), r"top_p must be a number in \(0, 1\], got '0.5'"),
    (lambda: TopKNucleusProcessor(1, 5, float("nan")), r"top_p must be a number in \(0, 1\], got nan"),
    (lambda: NGramStorage(None, 128), "n must be an integer from 2 to 16, got None"),
    (lambda: NGramStorage(1, 128), "n must be an integer from 2 to 16, got 1"),
    (lambda: NGramStorage(3, "128"), "vocab_size must be an integer >= 1, got '128'"),
    # counted, drafted, then an IndexError in the embedding (or a saved file that loads as corrupt)
    (lambda: NGramStorage(3, 64).initialize(torch.tensor([[5, 6, -1]])), "input_ids must be token ids from 0 to 63"),
    (lambda: NGramStorage(3, 64).add_sequence([5, 6, 64]), "tokens must be token ids from 0 to 63, got 5..64"),
    # a float follower was stored as a key (5.7) and drafted as 5; a row count that does not match: RuntimeError
    (lambda: NGramStorage(3, 64).update([[5, 6]], torch.tensor([5.7])), "next_tokens must be token ids of shape"),
    (lambda: NGramStorage(3, 64).update([[5, 6], [7, 8]], [1, 2, 3]), "next_tokens must have a row for each of the 2"),
    # TypeError: unhashable type: 'list'
    (lambda: NGramDraftPolicy(length=["double"]), "length must be one of fixed, follow, double"),
])
def test_processor_and_storage_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_generator_arguments_of_the_wrong_kind(pair):
    target, drafter = pair
    t5, t5_drafter = tiny_encoder_decoder("t5"), tiny_encoder_decoder("t5", seed=1)
    storage = NGramStorage(3, 64)
    cases = [
        (lambda: speculative_generate(PROMPT, drafter, target, drafter_window=8.0),
         "drafter_window must be an integer >= 0, got 8.0"),
        (lambda: speculative_generate(PROMPT, drafter, target, drafter_window="16"),
         "drafter_window must be an integer >= 0, got '16'"),
        (lambda: ngram_assisted_speculative_generate(PROMPT, storage, target, filler_top_k=2.5),
         "filler_top_k must be an integer >= 0, got 2.5"),
        (lambda: ngram_assisted_speculative_generate(PROMPT, None, target), "ngramstorage must be an n-gram storage"),
        (lambda: nasd_run(PROMPT, storage, target, prior=[1, 2]), "prior must be an n-gram storage"),
        (lambda: speculative_run(PROMPT, drafter, target, confidence="0.5"), "confidence must be a number, got '0.5'"),
        (lambda: speculative_run(PROMPT, drafter, target, settings={"gamma": 3}),
         "settings must be a LoopSettings, got dict"),
        (lambda: autoregressive_generate(PROMPT, target, logits_processor="greedy"),
         "logits_processor must be a LogitsProcessor instance"),
        (lambda: autoregressive_generate(PROMPT, target, logits_processor=GreedyProcessor),
         "logits_processor must be a LogitsProcessor instance"),
        (lambda: nasd_run(PROMPT, storage, target, logits_processor="greedy"),
         "logits_processor must be a LogitsProcessor instance"),
        (lambda: nasd_run(PROMPT, storage, target, settings={}), "settings must be a LoopSettings, got dict"),
        (lambda: speculative_run(PROMPT, drafter, target, runners=(object(), object())),
         "the target's runner must be a ModelRunner"),
        (lambda: speculative_run(PROMPT, drafter, target, draft_stop="sometimes"), "unknown draft stop 'sometimes'"),
        # gamma 0 ran AR's loop under the speculative name, drafting nothing
        (lambda: speculative_generate(PROMPT, drafter, target, gamma=0), "gamma must be an integer >= 1"),
        (lambda: speculative_run(PROMPT, drafter, target, settings=LoopSettings(10, 0)), "gamma must be an integer >= 1"),
        (lambda: ngram_assisted_speculative_generate(PROMPT, storage, target, gamma=0), "gamma must be an integer >= 1"),
        # a sweep: a gamma that is no integer was told ">= 0", one of 0 ">= 1"
        (lambda: ngram_assisted_speculative_generate(PROMPT, storage, target, gamma="x"),
         "gamma must be an integer >= 1, got 'x'"),
        (lambda: speculative_generate(PROMPT, drafter, target, gamma="x"), "gamma must be an integer >= 1, got 'x'"),
        # AttributeError: 'str' object has no attribute 'min_context'; a min_context of -3 was taken
        (lambda: nasd_run(PROMPT, storage, target, policy="picky"), "policy must be an NGramDraftPolicy"),
        (lambda: NGramDraftPolicy(min_context=-3), "min_context must be an integer >= 1, got -3"),
        (lambda: NGramDraftPolicy(min_context="a"), "min_context must be an integer >= 1, got 'a'"),
        (lambda: NGramDraftPolicy(stop_if_unknown="no"), "stop_if_unknown must be True or False, got 'no'"),
        # a string switch was truthy: "no" turned the cache on
        (lambda: autoregressive_generate(PROMPT, target, use_cache="no"), "use_cache must be True or False, got 'no'"),
        (lambda: speculative_run(PROMPT, drafter, target, adaptive_gamma="yes"), "adaptive_gamma must be True or False"),
        (lambda: LoopSettings(first_target="no"), "first_target must be True or False, got 'no'"),
        # AttributeError: 'str' object has no attribute 'get_vocab', from inside same_vocabulary
        (lambda: speculative_generate(PROMPT, drafter, target, tokenizer="qwen", drafter_tokenizer=object()),
         "tokenizer must be a tokenizer"),
        (lambda: ngram_assisted_speculative_generate(PROMPT, storage, target, tokenizer=42, debug=True),
         "tokenizer must be a tokenizer .*, got int"),
        (lambda: speculative_generate(PROMPT, drafter, target, debug="no"), "debug must be True or False, got 'no'"),
        # accepted and ignored: AR printed nothing with debug=True
        (lambda: autoregressive_generate(PROMPT, target, debug="yes"), "debug must be True or False, got 'yes'"),
        # ignored: fresh runners were built whatever was given
        (lambda: speculative_run([3, 17, 42], t5_drafter, t5, encoder_decoder=True, runners=(1, 2)),
         "runners are kept for decoder-only models"),
        # the older switches were dropped without a word beside a built rule (refused beside a config or a name)
        (lambda: speculative_run(PROMPT, drafter, target, draft_stop=make_draft_stop("fixed"), confidence=0.5),
         "give draft_stop or the older adaptive_gamma/confidence, not both"),
        # refused by the loop only after the storage had counted it (and --ngram-cache would have saved it)
        (lambda: ngram_assisted_speculative_generate([5, 6] * CONTEXT, storage, target),
         f"the prompt has {2 * CONTEXT} tokens, more than the model's context of {CONTEXT}"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert len(storage.best[1]) == 0  # a refused call counted nothing into the storage


def test_a_storage_counts_one_row_as_a_batch_of_one():
    # a 1-D row failed with "TypeError: object of type 'int' has no len()" inside the counting
    row, batch = NGramStorage(3, 64), NGramStorage(3, 64)
    row.initialize(torch.tensor([5, 6, 7, 5, 6]))
    batch.initialize(torch.tensor([[5, 6, 7, 5, 6]]))
    assert row.counts == batch.counts and row.best == batch.best
    row.update(torch.tensor([7, 5, 6]), torch.tensor(9))
    assert row.counts[2][(5, 6)] == {7: 1, 9: 1}
    assert row.next_token(torch.tensor([6, 7])) == (torch.tensor([5]), torch.tensor([True]))
    for bad in (torch.tensor(3), torch.zeros(1, 2, 3, dtype=torch.long), torch.tensor([1.5, 2.0])):
        with pytest.raises(ValueError, match=r"input_ids must be token ids of shape \[batch, L\] or \[L\]"):
            row.initialize(bad)


def test_prune_cache_takes_the_counts_the_generators_take(pair):
    # numpy and 0-d tensor counts were refused here while max_gen_len and gamma took them
    target, _ = pair
    runner = ModelRunner(target, use_cache=True)
    runner.logits(torch.tensor([PROMPT], device=target.device), 1)
    length = runner.cache.get_seq_length()
    prune_cache(runner.cache, np.int64(2))
    prune_cache(runner.cache, torch.tensor(1))
    assert runner.cache.get_seq_length() == length - 3
    with pytest.raises(ValueError, match="num_tokens_to_discard must be an integer, got 1.0"):
        prune_cache(runner.cache, 1.0)


def test_a_model_without_weights_or_on_another_device_is_named(pair):
    # a meta-device model failed in transformers' masking code ("Tensor.item() cannot be called on meta tensors")
    target, drafter = pair
    with pytest.raises(ValueError, match="LlamaForCausalLM has no weights"):
        autoregressive_generate(PROMPT, tiny_decoder("llama", seed=2).to("meta"), max_gen_len=3)
    # a pair on two devices failed in torch at the drafter's first pass; no GPU here, so a runner says it is elsewhere
    runners = (ModelRunner(target), ModelRunner(drafter))
    runners[1].device = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="the drafter is on cuda:0 and the target on cpu: put both on one device"):
        speculative_run(PROMPT, drafter, target, runners=runners)


def test_the_argument_checks_take_what_their_docstrings_say_and_refuse_the_rest():
    """The checks directly: the generators' cases above never give a bool as a count, a tensor as a switch or a
    number, or a tokenizer missing one method, so these held by chance."""
    from utils.arguments import count, flag, integer, real, tokenizer_like

    # a bool is an int to Python (operator.index(True) == 1): `max_gen_len=True` must not mean 1
    for value in (True, False):
        with pytest.raises(ValueError, match=f"n must be an integer, got {value}$"):
            integer("n", value)
        with pytest.raises(ValueError, match=f"n must be a number, got {value}$"):
            real("n", value)
    assert integer("n", np.int64(3)) == 3 and integer("n", torch.tensor(4)) == 4
    assert count("n", 0) == 0  # the default low is 0, inclusive
    # 0-d tensors are what a model's output hands back: a bool one is a switch, a number one a number
    assert flag("f", torch.tensor(True)) is True and flag("f", torch.tensor(False)) is False
    assert real("x", torch.tensor(0.5)) == 0.5 and isinstance(real("x", torch.tensor(2)), float)
    with pytest.raises(ValueError, match="f must be True or False"):  # not torch's "ambiguous" RuntimeError
        flag("f", torch.tensor([True, False]))
    with pytest.raises(ValueError, match="x must be a number, got tensor"):  # a bool tensor is no number either
        real("x", torch.tensor(True))

    class Tokenizer:
        def __call__(self, text):
            return [1]

        def decode(self, ids):
            return ""

        def get_vocab(self):
            return {}

    tokenizer = Tokenizer()
    assert tokenizer_like("t", tokenizer) is tokenizer and tokenizer_like("t", None) is None
    no_vocab = type("NoVocab", (), {"__call__": Tokenizer.__call__, "decode": Tokenizer.decode})()
    not_callable = type("NotCallable", (), {"decode": Tokenizer.decode, "get_vocab": Tokenizer.get_vocab})()
    for broken in (no_vocab, not_callable):  # each failed later, inside a generation, with an AttributeError/TypeError
        with pytest.raises(ValueError, match=f"t must be a tokenizer .*, got {type(broken).__name__}$"):
            tokenizer_like("t", broken)
