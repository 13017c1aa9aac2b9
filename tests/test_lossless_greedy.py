"""Greedy speculative decoding and greedy NASD give exactly the tokens of greedy autoregressive decoding."""

import pytest
import torch

from conftest import DECODER_ARCHS, PROMPT, ids, tiny_encoder_decoder
from ngram_assisted import (
    NGramDraftPolicy,
    NGramStorage,
    OneLevelNGramStorage,
    nasd_run,
    ngram_assisted_speculative_generate,
)
from sampling import (
    LoopSettings,
    autoregressive_generate,
    autoregressive_generate_encoder_decoder,
    speculative_generate,
    speculative_generate_encoder_decoder,
)

GEN = 40
NO_EOS = -1  # random models would stop at arbitrary points; these tests want the full length


@torch.no_grad()
def greedy_by_hand(model, prompt: list[int], n: int) -> list[int]:
    """The argmax of a full forward over the whole sequence, token by token: no runner, no cache, no loop of ours."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(ids([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def reference(decoder_pairs):
    return {arch: greedy_by_hand(decoder_pairs[arch][0], PROMPT, GEN) for arch in DECODER_ARCHS}


@pytest.mark.parametrize("arch", DECODER_ARCHS)
@pytest.mark.parametrize("use_cache", [False, True])
def test_autoregressive_cache_matches_no_cache(decoder_pairs, reference, arch, use_cache):
    """Both against the hand-made reference (the cache-off case compared a call with the same call)."""
    target = decoder_pairs[arch][0]
    out = autoregressive_generate(PROMPT, target, max_gen_len=GEN, eos_tokens_id=NO_EOS, use_cache=use_cache)
    assert len(out) == GEN
    assert out == reference[arch]


@pytest.mark.parametrize("arch", DECODER_ARCHS)
@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
@pytest.mark.parametrize("use_cache", [False, True])
def test_speculative_equals_autoregressive(near_pairs, reference, arch, gamma, use_cache):
    """A drafter that agrees in part, so that every case keeps some drafts and rejects others (a random drafter of
    gpt_neox never agreed: a wrong token after accepted drafts went unseen there)."""
    target, drafter = near_pairs[arch]
    out, rate = speculative_generate(PROMPT, drafter, target, gamma=gamma, max_gen_len=GEN, eos_tokens_id=NO_EOS,
                                     use_cache=use_cache)
    assert out == reference[arch]
    assert 0.0 < rate < 1.0


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("use_cache", [False, True])
def test_self_drafting_accepts_everything(decoder_pairs, reference, arch, use_cache):
    target = decoder_pairs[arch][0]
    out, rate = speculative_generate(PROMPT, target, target, gamma=4, max_gen_len=GEN, eos_tokens_id=NO_EOS,
                                     use_cache=use_cache, drafter_window=0)  # the drafter reads all, as the target
    assert out == reference[arch]
    assert rate == 1.0


@pytest.mark.parametrize("arch", DECODER_ARCHS)
@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("storage_cls", [NGramStorage, OneLevelNGramStorage])
def test_nasd_equals_autoregressive(decoder_pairs, reference, arch, gamma, use_cache, storage_cls):
    target = decoder_pairs[arch][0]
    storage = storage_cls(3, target.config.vocab_size)
    out, rate = ngram_assisted_speculative_generate(PROMPT, storage, target, gamma=gamma, max_gen_len=GEN,
                                                    eos_tokens_id=NO_EOS, use_cache=use_cache)
    assert out == reference[arch]
    assert 0.0 <= rate <= 1.0


def test_nasd_drafts_and_gets_accepted_on_repetitive_output(decoder_pairs, reference):
    """Random tiny models fall into loops; the n-gram drafter must then be accepted, or it is not drafting."""
    target = decoder_pairs["llama"][0]
    out, rate = ngram_assisted_speculative_generate(PROMPT, NGramStorage(4, 64), target, gamma=4, max_gen_len=GEN,
                                                    eos_tokens_id=NO_EOS, use_cache=True, stop_if_unknown=True)
    assert out == reference["llama"]
    assert rate > 0.0


@pytest.mark.parametrize("length", ["fixed", "follow", "double"])
@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("min_context", [1, 2])
def test_nasd_draft_length_schedules_change_nothing(decoder_pairs, reference, length, use_cache, min_context):
    """The chat's policies (PICKY, WIDE: "double", from contexts of 2 or 1 tokens) and the others only decide how
    much to draft, never what is kept."""
    target = decoder_pairs["llama"][0]
    policy = NGramDraftPolicy(stop_if_unknown=True, min_context=min_context, length=length)
    result = nasd_run(PROMPT, NGramStorage(4, 64), target, settings=LoopSettings(GEN, 8, NO_EOS), use_cache=use_cache,
                      policy=policy)
    assert result.tokens == reference["llama"]
    assert result.accepted > 0  # the tiny model loops, so the storage must have drafted and been right


@pytest.mark.parametrize("arch", ["t5", "bart"])
@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
@pytest.mark.parametrize("use_cache", [False, True])
def test_encoder_decoder_speculative_equals_autoregressive(arch, gamma, use_cache):
    target, drafter = tiny_encoder_decoder(arch, seed=0), tiny_encoder_decoder(arch, seed=1)
    expected = autoregressive_generate_encoder_decoder(PROMPT, target, max_gen_len=30, eos_tokens_id=NO_EOS)
    cached = autoregressive_generate_encoder_decoder(PROMPT, target, max_gen_len=30, eos_tokens_id=NO_EOS,
                                                     use_cache=use_cache)
    out, rate = speculative_generate_encoder_decoder(PROMPT, drafter, target, gamma=gamma, max_gen_len=30,
                                                     eos_tokens_id=NO_EOS, use_cache=use_cache)
    assert len(expected) == 30
    assert cached == expected
    assert out == expected


@pytest.mark.parametrize("use_cache", [False, True])
def test_adaptive_gamma_is_lossless(decoder_pairs, reference, use_cache):
    from sampling import LoopSettings, speculative_run

    target, drafter = decoder_pairs["llama"]
    for d in (drafter, target):
        result = speculative_run(PROMPT, d, target, settings=LoopSettings(GEN, 8, NO_EOS), use_cache=use_cache,
                                 adaptive_gamma=True)
        assert result.tokens == reference["llama"]


@pytest.mark.parametrize("use_cache", [False, True])
def test_confidence_stop_is_lossless_and_stops_rounds(decoder_pairs, reference, use_cache):
    import torch

    from sampling import LoopSettings, speculative_run

    target, drafter = decoder_pairs["llama"]
    for d in (drafter, target):
        # The median of the drafter's top probabilities along the answer: about half its drafts fall below it.
        with torch.no_grad():
            logits = d(ids([PROMPT + reference["llama"]])).logits[0, len(PROMPT) - 1 : -1]
        threshold = float(logits.softmax(-1).max(-1).values.median())
        rounds = []
        result = speculative_run(PROMPT, d, target, settings=LoopSettings(GEN, 8, NO_EOS), use_cache=use_cache,
                                 on_round=rounds.append, confidence=threshold)
        assert result.tokens == reference["llama"]
        drafted = [len(r.drafts) for r in rounds[1:-1]]  # the first round is the target's alone; the last is cut
        assert min(drafted) >= 1
        assert any(n < 8 for n in drafted), "the early stop never fired"


@pytest.mark.parametrize("use_cache", [False, True])
def test_drafts_past_the_answers_end_are_not_counted(decoder_pairs, reference, use_cache):
    """The target drafting for itself keeps every draft; an end token inside a round's drafts cuts the answer
    there, and the drafts after it count neither as drafted nor as kept."""
    from sampling import LoopSettings, speculative_run

    target = decoder_pairs["llama"][0]
    expected = reference["llama"]
    end = next(j for j in range(2, 8) if expected[j] not in expected[:j])  # the answer's first end token
    rounds = []
    result = speculative_run(PROMPT, target, target, settings=LoopSettings(GEN, 8, expected[end]),
                             use_cache=use_cache, drafter_window=0, on_round=rounds.append)
    assert result.tokens == expected[: end + 1]
    assert rounds[-1].drafts == expected[1 : end + 1] and rounds[-1].accepted == end  # what /debug shows
    assert result.rounds == 2  # the target's first token, then one round of 8 drafts cut at the end token
    assert result.accepted == result.drafted == end  # not 8: the drafts past the end are not the answer's
    assert result.acceptance_rate == 1.0
