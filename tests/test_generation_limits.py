"""End tokens, length limits, the context limit and acceptance-rate edge cases."""

import pytest
import torch

from conftest import PROMPT, ids, tiny_decoder
from ngram_assisted import NGramStorage, ngram_assisted_speculative_generate
from sampling import autoregressive_generate, beam_search_generate, speculative_generate


@pytest.fixture(scope="module")
def target():
    return tiny_decoder("llama", seed=0)


@pytest.fixture(scope="module")
def full(target):
    return autoregressive_generate(PROMPT, target, max_gen_len=40, eos_tokens_id=-1)


def first_new_token(tokens, start):
    """A token at index >= start whose first occurrence is there, usable as an end token."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i, tokens[i]
    pytest.skip("no fresh token in the reference output")


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("as_list", [False, True])
def test_end_token_inside_accepted_drafts(target, full, use_cache, as_list):
    """With the target as its own drafter every draft is accepted, so the end token lies inside a run of drafts."""
    index, eos = first_new_token(full, 6)
    eos_arg = [63, eos] if as_list else eos
    expected = full[: index + 1]
    ar = autoregressive_generate(PROMPT, target, max_gen_len=40, eos_tokens_id=eos_arg, use_cache=use_cache)
    sd, rate = speculative_generate(PROMPT, target, target, gamma=8, max_gen_len=40, eos_tokens_id=eos_arg,
                                    use_cache=use_cache)
    nasd, _ = ngram_assisted_speculative_generate(PROMPT, NGramStorage(3, 64), target, gamma=8, max_gen_len=40,
                                                  eos_tokens_id=eos_arg, use_cache=use_cache)
    assert ar == expected and sd == expected and nasd == expected
    assert sd[-1] == eos and rate == 1.0


@pytest.mark.parametrize("max_gen_len", [0, 1, 2, 3, 7, 9, 17])
@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_never_more_than_max_gen_len(target, full, max_gen_len, gamma):
    drafter = tiny_decoder("llama", seed=1)
    sd, _ = speculative_generate(PROMPT, drafter, target, gamma=gamma, max_gen_len=max_gen_len, eos_tokens_id=-1,
                                 use_cache=True)
    same, _ = speculative_generate(PROMPT, target, target, gamma=gamma, max_gen_len=max_gen_len, eos_tokens_id=-1)
    assert sd == full[:max_gen_len] and same == full[:max_gen_len]


def test_nothing_drafted_gives_zero_rate(target):
    out, rate = speculative_generate(PROMPT, target, target, gamma=4, max_gen_len=1, eos_tokens_id=-1)
    assert len(out) == 1 and rate == 0.0


@pytest.mark.parametrize("use_cache", [False, True])
def test_prompt_at_the_context_limit(use_cache):
    small = tiny_decoder("gpt2", seed=0, context=16)  # learned positions: position 16 does not exist
    drafter = tiny_decoder("gpt2", seed=1, context=16)
    prompt = list(range(2, 18))  # 16 tokens: exactly the context
    ar = autoregressive_generate(prompt, small, max_gen_len=10, eos_tokens_id=-1, use_cache=use_cache)
    sd, _ = speculative_generate(prompt, drafter, small, gamma=4, max_gen_len=10, eos_tokens_id=-1, use_cache=use_cache)
    assert len(ar) == 1 and sd == ar  # the last token is never fed back, so one token still fits
    shorter = prompt[:10]
    ar = autoregressive_generate(shorter, small, max_gen_len=20, eos_tokens_id=-1, use_cache=use_cache)
    sd, _ = speculative_generate(shorter, drafter, small, gamma=4, max_gen_len=20, eos_tokens_id=-1, use_cache=use_cache)
    assert len(ar) == 7 and sd == ar
    with pytest.raises(ValueError, match="context"):
        autoregressive_generate(prompt + [3], small, use_cache=use_cache)
    with pytest.raises(ValueError, match="context"):
        speculative_generate(prompt + [3], drafter, small, use_cache=use_cache)


def test_empty_prompt_is_refused(target):
    with pytest.raises(ValueError, match="empty"):
        autoregressive_generate([], target)


def test_cache_is_off_by_default():
    import inspect

    from ngram_assisted import ngram_assisted_speculative_generate as nasd
    from sampling import autoregressive_generate_encoder_decoder, speculative_generate_encoder_decoder

    for fn in (autoregressive_generate, speculative_generate, nasd, autoregressive_generate_encoder_decoder,
               speculative_generate_encoder_decoder):
        assert inspect.signature(fn).parameters["use_cache"].default is False


def test_beam_search_finds_the_best_beam_by_enumeration():
    """With as many beams and candidates as tokens and two steps, beam search is exhaustive: its answer must be
    the best of all sequences (ending early at the end token, or of length two) under the length penalty."""
    vocab, min_length, alpha, eos = 6, 5.0, 1.2, 1
    model = tiny_decoder("llama", seed=7, vocab=vocab, init=0.5)
    prompt = [2, 3, 4]
    with torch.no_grad():
        first = torch.log_softmax(model(ids([prompt])).logits[0, -1], -1)
        second = torch.log_softmax(model(ids([prompt + [a] for a in range(vocab)])).logits[:, -1], -1)

    def lp(length):
        return ((min_length + length) / (min_length + 1)) ** alpha

    scores = {(eos,): float(first[eos]) / lp(1)}
    for a in range(vocab):
        if a != eos:
            for b in range(vocab):
                scores[(a, b)] = float(first[a] + second[a, b]) / lp(2)
    best = max(scores, key=scores.get)
    out = beam_search_generate(prompt, model, max_gen_len=2, num_beams=vocab * vocab, top_k=vocab,
                               min_length=min_length, alpha=alpha, eos_tokens_id=eos)
    assert tuple(out) == best
    # Fewer beams cannot score better than the exhaustive answer.
    narrow = beam_search_generate(prompt, model, max_gen_len=2, num_beams=2, top_k=2, min_length=min_length,
                                  alpha=alpha, eos_tokens_id=eos)
    assert scores[tuple(narrow)] <= scores[best]


@pytest.mark.parametrize("eos", [lambda t: torch.tensor(t), lambda t: torch.tensor([63, t]), lambda t: {63, t},
                                 lambda t: (t,), lambda t: frozenset([t])])
def test_end_tokens_as_tensor_or_set_stop_generation(target, full, eos):
    index, token = first_new_token(full, 4)
    expected = full[: index + 1]
    assert autoregressive_generate(PROMPT, target, max_gen_len=40, eos_tokens_id=eos(token)) == expected
    sd, _ = speculative_generate(PROMPT, target, target, gamma=3, max_gen_len=40, eos_tokens_id=eos(token))
    assert sd == expected
    assert beam_search_generate(PROMPT, target, max_gen_len=40, num_beams=1, top_k=1, eos_tokens_id=eos(token)) == expected


@pytest.mark.parametrize("call, message", [
    (lambda m: autoregressive_generate(PROMPT, m, max_gen_len=2.5), "max_gen_len must be an integer >= 0"),
    (lambda m: autoregressive_generate(PROMPT, m, max_gen_len=-1), "max_gen_len must be an integer >= 0"),
    (lambda m: speculative_generate(PROMPT, m, m, gamma=2.5), "gamma must be an integer >= 1"),
    (lambda m: speculative_generate(PROMPT, m, m, gamma=True), "gamma must be an integer >= 1"),
    (lambda m: autoregressive_generate(PROMPT, m, eos_tokens_id=1.5), "eos_tokens_id must be a token id"),
    (lambda m: autoregressive_generate(PROMPT, m, eos_tokens_id=torch.tensor(1.0)), "eos_tokens_id must be"),
    (lambda m: autoregressive_generate(PROMPT, m, eos_tokens_id=["a"]), "eos_tokens_id must be"),
    (lambda m: beam_search_generate(PROMPT, m, max_gen_len=-1), "max_gen_len must be an integer >= 0"),
    (lambda m: beam_search_generate(PROMPT, m, max_gen_len=2.5), "max_gen_len must be an integer >= 0"),
    (lambda m: beam_search_generate(PROMPT, m, min_length=-1.0), "min_length must be a finite number >= 0"),
    (lambda m: beam_search_generate(PROMPT, m, alpha=float("nan")), "alpha must be a finite number"),
    (lambda m: beam_search_generate(PROMPT, m, num_beams=0), "num_beams must be an integer >= 1"),
])
def test_bad_library_arguments_raise_value_errors_that_say_what_is_accepted(target, call, message):
    with pytest.raises(ValueError, match=message):
        call(target)


def test_integer_like_counts_are_accepted(target, full):
    import numpy as np

    assert autoregressive_generate(PROMPT, target, max_gen_len=np.int64(5), eos_tokens_id=None) == full[:5]
    sd, _ = speculative_generate(PROMPT, target, target, gamma=torch.tensor(2), max_gen_len=5, eos_tokens_id=None)
    assert sd == full[:5]


def padded_target(drafter, favoured: int, vocab: int = 96):
    """The drafter with its head padded to `vocab` ids, as Qwen2.5-7B's is against the 0.5B's: the same weights,
    except that id 90, past the drafter's embedding, wins wherever `favoured` would have."""
    big = tiny_decoder("llama", seed=0, vocab=vocab)
    with torch.no_grad():
        for name, value in drafter.state_dict().items():
            big.state_dict()[name][: value.shape[0]].copy_(value)  # the embedding and head: their first 64 rows
        big.lm_head.weight[64:] = 0
        big.lm_head.weight[90] = drafter.lm_head.weight[favoured] * 1.01
    return big


@pytest.mark.parametrize("use_cache", [False, True])
def test_target_tokens_past_the_drafters_vocabulary_are_read_as_another_id(use_cache):
    """A target may sample ids the drafter has no embedding for (a padded head): the drafter reads another id
    there and the output stays the target's, instead of an IndexError or a stop mid-answer."""
    small = tiny_decoder("llama", seed=1)  # 64 ids
    plain = autoregressive_generate(PROMPT, small, max_gen_len=30, eos_tokens_id=None)
    big = padded_target(small, favoured=max(set(plain), key=plain.count))
    ar = autoregressive_generate(PROMPT, big, max_gen_len=30, eos_tokens_id=None, use_cache=use_cache)
    assert sum(i >= 64 for i in ar) >= 2  # the case under test: the target emits id 90, more than once
    sd, acceptance = speculative_generate(PROMPT, small, big, gamma=3, max_gen_len=30, eos_tokens_id=None,
                                          use_cache=use_cache)
    assert sd == ar
    assert acceptance > 0  # drafting goes on past each id 90 (its drafts of `favoured` there are all rejected)


def test_a_kept_drafter_cache_holds_what_it_read_in_place_of_such_ids():
    """The next turn's prompt holds the target's id 90 where the drafter's kept cache holds what it read there:
    compared as read, the whole earlier turn is kept, not cut at the first id 90."""
    from sampling import LoopSettings, speculative_run
    from utils.model_runner import ModelRunner

    small = tiny_decoder("llama", seed=1)
    plain = autoregressive_generate(PROMPT, small, max_gen_len=30, eos_tokens_id=None)
    big = padded_target(small, favoured=max(set(plain), key=plain.count))
    runners = ModelRunner(big, use_cache=True), ModelRunner(small, use_cache=True)
    settings = LoopSettings(max_gen_len=30, gamma=3, eos_tokens_id=None)
    first = speculative_run(PROMPT, small, big, settings=settings, use_cache=True, runners=runners).tokens
    assert 90 in first[:-1]  # the case under test: the drafter read id 90 in place, and its cache holds that
    turn = PROMPT + first + [5, 6]
    held = runners[1].cached  # positions the drafter's cache holds after the first turn
    assert held > len(PROMPT) + first.index(90)
    kept = []
    reuse = runners[1].reuse
    runners[1].reuse = lambda ids: kept.append(reuse(ids)) or kept[-1]
    second = speculative_run(turn, small, big, settings=settings, use_cache=True, runners=runners).tokens
    assert kept == [held]  # all of it: compared as the raw ids, it was cut at the first id 90
    assert second == autoregressive_generate(turn, big, max_gen_len=30, eos_tokens_id=None)


def every_entry_point(model, inputs):
    from conftest import tiny_encoder_decoder
    from ngram_assisted import nasd_run
    from sampling import (autoregressive_generate_encoder_decoder, autoregressive_run,
                          speculative_generate_encoder_decoder, speculative_run)

    t5 = tiny_encoder_decoder("t5")
    return {
        "autoregressive": lambda: autoregressive_run(inputs, model, 3),
        "speculative": lambda: speculative_run(inputs, model, model),
        "speculative cached": lambda: speculative_run(inputs, model, model, use_cache=True),
        "nasd": lambda: nasd_run(inputs, NGramStorage(3, 64), model),
        "beam search": lambda: beam_search_generate(inputs, model, max_gen_len=2),
        "encoder-decoder": lambda: autoregressive_generate_encoder_decoder(inputs, t5, max_gen_len=2),
        "encoder-decoder speculative": lambda: speculative_generate_encoder_decoder(inputs, t5, t5, max_gen_len=2),
    }


@pytest.mark.parametrize("inputs, message", [
    ([5, 6, 64], "token id 64 in inputs is outside the model's vocabulary \\(ids 0 to 63\\)"),
    ([5, -1, 6], "token id -1 in inputs is outside the model's vocabulary"),
    ([[5, 6, 7]], "inputs must be a flat list of token ids \\(one sequence, no batch\\)"),
    ([5, 6.0], "inputs must be a flat list of token ids"),
    ([5, True], "inputs must be a flat list of token ids"),
    (torch.tensor([[5, 6]]), "inputs must be a 1-D integer tensor \\(one sequence\\), got torch.int64 of shape \\(1, 2\\)"),
    (torch.tensor([5.0, 6.0]), "inputs must be a 1-D integer tensor"),
    ("hello", "got text; tokenize it first"),
])
@pytest.mark.parametrize("entry", ["autoregressive", "speculative", "speculative cached", "nasd", "beam search",
                                   "encoder-decoder", "encoder-decoder speculative"])
def test_bad_token_ids_are_value_errors_at_every_entry_point(target, inputs, message, entry):
    """Issue 25: out-of-range and negative ids raised IndexError, a 2-D list RuntimeError; the README promises
    ValueError."""
    with pytest.raises(ValueError, match=message):
        every_entry_point(target, inputs)[entry]()


def test_ids_as_tensors_and_arrays_are_accepted(target, full):
    import numpy as np

    assert autoregressive_generate(torch.tensor(PROMPT), target, max_gen_len=5, eos_tokens_id=None) == full[:5]
    assert autoregressive_generate(np.array(PROMPT), target, max_gen_len=5, eos_tokens_id=None) == full[:5]


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_beam_search_refuses_an_encoder_decoder_model(arch):
    """BART answered tokens of no valid beam (its decoder was fed the prompt) and T5 raised transformers' own
    error about input ids."""
    from conftest import tiny_encoder_decoder

    with pytest.raises(ValueError, match="beam search takes decoder-only models"):
        beam_search_generate([5, 6, 7], tiny_encoder_decoder(arch), max_gen_len=3)
