"""Edges of sampling/beam_search.py (found by a mutation review): the context limit, more candidates than the
vocabulary, a zero min_length, and finished beams kept in the competition."""

import pytest
import torch

from conftest import ids, tiny_decoder
from sampling import autoregressive_generate, beam_search_generate


def test_beam_search_fills_the_context_to_its_last_position_as_greedy_does():
    small = tiny_decoder("gpt2", seed=0, context=16)  # learned positions: position 16 does not exist
    prompt = list(range(2, 18))  # exactly the context: one token still fits (the last is never fed back)
    assert len(beam_search_generate(prompt, small, max_gen_len=10, eos_tokens_id=-1)) == 1
    shorter = prompt[:10]
    greedy = autoregressive_generate(shorter, small, max_gen_len=20, eos_tokens_id=-1)
    assert len(greedy) == 7
    assert beam_search_generate(shorter, small, max_gen_len=20, num_beams=1, top_k=1, eos_tokens_id=-1) == greedy


def test_more_candidates_than_the_vocabulary_and_no_min_length():
    vocab = 6
    model = tiny_decoder("llama", seed=7, vocab=vocab, init=0.5)
    prompt = [2, 3, 4]
    with torch.no_grad():
        first = torch.log_softmax(model(ids([prompt])).logits[0, -1], -1)
    # one step, every token a candidate (top_k past the vocabulary): the most probable token, whatever the penalty
    for min_length in (0, 0.0, 5.0):
        out = beam_search_generate(prompt, model, max_gen_len=1, num_beams=3, top_k=vocab + 10,
                                   min_length=min_length, eos_tokens_id=-1)
        assert out == [int(first.argmax())]


def test_a_beam_that_ended_early_stays_in_the_competition():
    """A one-token answer ended by the end token outscores every longer one here: it must win, although no open
    beam is left with it after the next step."""
    vocab = 6
    model = tiny_decoder("llama", seed=7, vocab=vocab, init=0.5)
    prompt = [2, 3, 4]
    with torch.no_grad():
        first = torch.log_softmax(model(ids([prompt])).logits[0, -1], -1)
    eos = int(first.argmax())  # the most probable first token ends the answer: its score beats any two tokens'
    out = beam_search_generate(prompt, model, max_gen_len=3, num_beams=2, top_k=vocab, min_length=1.0, alpha=0.0,
                               eos_tokens_id=eos)
    assert out == [eos]


def test_the_length_penalty_is_gnmts():
    from sampling.beam_search import length_penalty

    assert length_penalty(1, 5.0, 1.2) == 1.0  # ((min_length + len) / (min_length + 1)) ** alpha
    assert length_penalty(3, 5.0, 1.0) == pytest.approx(8 / 6)
    assert length_penalty(4, 0.0, 2.0) == 16.0
